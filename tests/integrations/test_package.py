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


def test_import_toma_leaves_fsdp2_unimported_until_a_model_needs_it():
    """FSDP2 (and with it torch.distributed.tensor) cost 0.6-2 s at `import toma`; a model sharded by
    `fully_shard` has imported it already, so toma recognises one without importing it."""
    out = run_python(
        """
import json, sys
import torch, toma
loaded = [name for name in ("torch.distributed.fsdp", "torch.distributed.tensor", "toma.accumulation.fsdp2")
          if name in sys.modules]
from toma.accumulation.sharded_models import is_fsdp2
plain = is_fsdp2(torch.nn.Linear(2, 2))
from torch.distributed.fsdp import FSDPModule
class Unit(FSDPModule, torch.nn.Linear):  # what fully_shard makes of a Linear, without a process group
    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)
print(json.dumps([loaded, plain, is_fsdp2(Unit(2, 2))]))
""",
        fresh=True,  # the fork server imports more than toma
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [[], False, True]
