"""`import toma` imports no training framework: the integrations are modules a user imports on purpose."""

import json

from helpers import run_python

FRAMEWORKS = ("lightning", "pytorch_lightning", "accelerate", "transformers")


def test_import_toma_imports_no_framework():
    code = f"""
import json, sys
import toma, toma.integrations
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in {FRAMEWORKS!r})))
"""
    assert json.loads(run_python(code).stdout.strip().splitlines()[-1]) == []
