"""What the sandbox tests and their worker scripts share: the plain-torch example job, loaded
from its file under a module name of its own."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "plain_torch" / "train.py"
JOB = "sandbox-test"
SEED = 7


def plain_example() -> ModuleType:
    """``examples/plain_torch/train.py`` as a module (its ``PlainJob``, ``_SumOverTP``...)."""
    name = "understudy_sandbox_plain_example"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, SCRIPT)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module
