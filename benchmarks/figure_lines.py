"""The figures a GPU benchmark reports to benchmarks/gpu_check.py: one JSON line each, in the file TOMA_FIGURES names."""

import json
import os
from typing import Any


def record(name: str, value: Any, unit: str) -> None:
    """One figure as a JSON line in the file TOMA_FIGURES names, if it names one."""
    path = os.environ.get("TOMA_FIGURES")
    if path:
        with open(path, "a", encoding="utf-8") as file:
            file.write(json.dumps(dict(figure=name, value=value, unit=unit)) + "\n")
