"""megatron-core's ``DistributedOptimizer`` in the Megatron adapter
(:mod:`understudy.worker.megatron.distributed`), which megatron-core 0.16.1 runs on CUDA only.

1. Without CUDA, ``--distributed-optimizer`` is refused with the exact reason, before any group
   is built.
2. On CPU, **emulated**: ``tests/workers/megatron_sharded.py --cpu-emulation`` redirects
   megatron-core's three CUDA device literals to the CPU (see ``cpu_emulation`` there), so the
   adapter's code path runs on real megatron-core code (its DDP buffers, range maps,
   ``DistributedOptimizer`` and inner AdamW) over real gloo groups in two processes. DP rank
   1's job is replaced twice: at step 2 by a new job that takes rank 1's own state (a drain's
   hand-over), at step 4 by one that takes the state rank 0 rebuilds from its copy of rank
   1's optimizer part (a recovery), whose own copy of rank 0's part crosses during step 4.
   Both ranks end bitwise equal to an uninterrupted run, losses included, and each rank's copy
   is bitwise its predecessor's part.
3. On a GPU: the same worker, unemulated, on CUDA with NCCL (skipped here, saying so). With one
   GPU, each process gets its own ``NCCL_HOSTID`` (NCCL refuses two ranks of a communicator on
   one device otherwise), as ``scripts/gpu-selftest`` does.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.unit.test_runtime import assert_bitwise_equal

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "workers" / "megatron_sharded.py"
TRAIN = REPO / "examples" / "megatron_gpt" / "train.py"
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _run(out: Path, hand_over: str, *, emulate: bool, timeout: float = 240) -> None:
    """Both ranks of the worker; returns once both saved their state."""
    out.mkdir(parents=True)
    procs = []
    for rank in (0, 1):
        env = {**os.environ, **ONE_THREAD}
        if not emulate and torch.cuda.device_count() < 2:
            env["NCCL_HOSTID"] = f"understudy-test-{rank}"
        args = [sys.executable, str(WORKER), "--rank", str(rank), "--world", "2",
                "--store", str(out / "store"), "--out", str(out), "--steps", "6",
                "--hand-over", hand_over, *(["--cpu-emulation"] if emulate else [])]
        with (out / f"log{rank}").open("w") as log:
            procs.append(subprocess.Popen(args, cwd=REPO, env=env, stdout=log,
                                          stderr=subprocess.STDOUT))
    try:
        for rank, proc in enumerate(procs):
            code = proc.wait(timeout)
            assert code == 0, f"rank {rank} exited {code}:\n" + \
                (out / f"log{rank}").read_text()[-5000:]
    finally:
        for proc in procs:
            proc.kill()


def _check_hand_overs(tmp_path: Path, *, emulate: bool) -> None:
    expected, got = tmp_path / "uninterrupted", tmp_path / "replaced"
    _run(expected, "", emulate=emulate)
    _run(got, "own:2,copy:4", emulate=emulate)
    log = (got / "log1").read_text()
    assert "rank 1 replaced at step 2 with own state" in log
    assert "rank 1 replaced at step 4 with copy state" in log
    states = {}
    for rank in (0, 1):
        a = torch.load(expected / f"rank{rank}.pt", weights_only=True)
        b = torch.load(got / f"rank{rank}.pt", weights_only=True)
        assert a["step"] == 6 and a["optimizer"]["state"], f"rank {rank} did not train"
        assert_bitwise_equal(a, b, f"rank {rank}")
        states[rank] = b
        losses = (got / f"losses{rank}.txt").read_text().splitlines()
        assert losses == (expected / f"losses{rank}.txt").read_text().splitlines()[-len(losses):]
    # Each rank's copy is its predecessor's part, moments and step count, bit for bit.
    for rank, predecessor in ((0, 1), (1, 0)):
        assert_bitwise_equal(states[predecessor]["part"], states[rank]["buddy"]["part"],
                             f"rank {rank}'s copy")
        assert_bitwise_equal(states[predecessor]["optimizer"]["state"],
                             states[rank]["buddy"]["optimizer"]["state"], f"rank {rank}'s copy")
    first = [float(line.split()[1]) for line in
             (expected / "losses0.txt").read_text().splitlines()]
    assert first[-1] < first[0], f"the loss did not fall: {first}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_cuda_the_distributed_optimizer_is_refused_with_the_reason(
        tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, str(TRAIN), "--distributed-optimizer", "--steps", "1",
                          "--store", str(tmp_path / "store")], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "--distributed-optimizer: megatron-core 0.16.1's DistributedOptimizer runs on CUDA " \
           "only" in res.stderr
    assert "distrib_optimizer.py" in res.stderr
    assert not (tmp_path / "store").exists(), "a group was bootstrapped before the refusal"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_distributed_optimizer_hand_overs_are_bitwise_emulated_on_cpu(tmp_path: Path) -> None:
    _check_hand_overs(tmp_path, emulate=True)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and NCCL: "
                    "megatron-core 0.16.1 runs its DistributedOptimizer on CUDA only")
@pytest.mark.timeout(600)
def test_distributed_optimizer_hand_overs_are_bitwise_on_a_gpu(tmp_path: Path) -> None:
    _check_hand_overs(tmp_path, emulate=False)
