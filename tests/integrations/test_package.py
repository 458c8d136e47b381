"""`toma.integrations` costs nothing to those who do not use it: importing toma (and the integrations package)
imports no framework."""

import json

from helpers import run_python


def test_import_toma_and_its_integrations_package_imports_no_framework():
    out = run_python(
        """
import json, sys
import toma, toma.integrations
print(json.dumps(sorted(name for name in ("transformers", "lightning", "pytorch_lightning", "accelerate")
                        if name in sys.modules)))
"""
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
