"""The public forms, thin drivers of the one engine: each form's step (`toma.core.steps`), run through the call's
`toma.core.runner.Runner` (`runner.perform`; built by `call_runners.calls`; `runs` for the runs that are more than a
step), shared by

- `toma.batch` / `toma.range` / `toma.chunked` / `toma.accumulate`: decorators with a per-function cache
  (`namespace`), and `toma.map`;
- `toma.execute.*`: run the decorated block at once, cached per call site (`inline`);
- `explicit.*`: the same as plain calls, with `toma_*` keyword options; `simple.*`: plain calls without a
  cache (`plain`).

A new form is a new step (`toma.core.steps`) and its calls here, not a new loop.
"""

from toma.forms.live_settings import PackageModule
from toma.forms.namespace import toma
from toma.forms.plain import explicit, simple

__all__ = ["toma", "explicit", "simple", "PackageModule"]
