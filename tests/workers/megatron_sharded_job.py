"""``examples/megatron_gpt/train.py --distributed-optimizer``, unchanged but for the device:
on CPU with megatron-core's CUDA device literals redirected (``megatron_sharded.cpu_emulation``),
for ``tests/integration/test_megatron_sharded.py``'s runs under the daemons. Takes the
example's arguments."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.workers.megatron_sharded import OnCPU, cpu_emulation

TRAIN = Path(__file__).resolve().parents[2] / "examples" / "megatron_gpt" / "train.py"


def main() -> int:
    spec = importlib.util.spec_from_file_location("megatron_gpt_train", TRAIN)
    assert spec is not None and spec.loader is not None
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    cpu_emulation()

    class EmulatedGPTJob(OnCPU, train.ShardedGPTJob):  # type: ignore[misc,name-defined]
        pass

    train.ShardedGPTJob = EmulatedGPTJob
    train.pick_device = lambda args: None  # the CPU
    code: int = train.main()
    return code


if __name__ == "__main__":
    sys.exit(main())
