"""What the sandbox tests and their worker scripts share: the example jobs, loaded from their
files under module names of their own."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "plain_torch" / "train.py"
MEGATRON_SCRIPT = SCRIPT.parents[1] / "megatron_gpt" / "train.py"
JOB = "sandbox-test"
SEED = 7


def plain_example() -> ModuleType:
    """``examples/plain_torch/train.py`` as a module (its ``PlainJob``, ``_SumOverTP``...)."""
    return _load("understudy_sandbox_plain_example", SCRIPT)


def megatron_example() -> ModuleType:
    """``examples/megatron_gpt/train.py`` as a module (its ``GPTJob``)."""
    return _load("understudy_sandbox_megatron_example", MEGATRON_SCRIPT)


def _load(name: str, script: Path) -> ModuleType:
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, script)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module
