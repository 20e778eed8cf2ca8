"""A Megatron-core GPT job on the understudy worker API: TP x DP on CPU, plain Adam.

The model is megatron-core's ``GPTModel`` with the local layer spec (2 layers, hidden 64, 4
heads, vocabulary 128, sequences of 32 tokens by default), built on the job's versioned groups
by :class:`understudy.worker.megatron.adapter.MegatronJob`; the data is synthetic and derives
from ``(seed, step, dp_index)``. Every run with the same arguments is bitwise identical, and so
is a run whose ranks move to standbys midway under ``understudy run``.

``--state-size 64MiB`` (also ``27KB``, ``1GiB``...) picks the hidden size at which a rank holds
that much parameters and Adam state (the smallest multiple of the attention heads that does).

Four ranks, TP=2 x DP=2, bootstrapped through a file store::

    for r in 0 1 2 3; do
        python examples/megatron_gpt/train.py --rank $r --world-size 4 --tp 2 \\
            --store /tmp/gpt-store --steps 50 --save /tmp/gpt-out &
    done; wait

On a GPU node, ``--distributed-optimizer`` trains it with Megatron's DDP and
``DistributedOptimizer`` instead (each rank's optimizer part copied on the next DP rank; see
:mod:`understudy.worker.megatron.distributed`); the device is ``LOCAL_RANK``'s GPU (modulo the
GPUs there are), or the current one.

The same job under the daemons, with two warm standbys::

    understudy run --job gpt --tp 2 --dp 2 --standby 2 -- \\
        python examples/megatron_gpt/train.py --steps 200 --save /tmp/gpt-out
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from understudy.worker.megatron import quiet_imports

# megatron-core 0.16.1 warns at import about what this machine lacks (Apex, Transformer Engine)
# and about its own deprecated modules: none of it concerns this job (``quiet_imports``).
with quiet_imports():
    from understudy.worker.megatron.adapter import GPTShape, MegatronJob, file_store_groups
    from understudy.worker.megatron.distributed import ShardedMegatronJob

from understudy.common import logs
from understudy.common.sizes import size_arg
from understudy.worker.api import JobContext
from understudy.worker.errors import record
from understudy.worker.runtime import Runtime


class GPTJob(MegatronJob):
    """:class:`MegatronJob` with optional extra work per step (to stand in for a bigger model)
    and a model sized to hold ``state_bytes`` per rank (None: ``shape`` as given)."""

    def __init__(self, shape: GPTShape | None = None, step_sleep: float = 0.0,
                 step_sleep_off: Path | None = None, state_bytes: int | None = None) -> None:
        super().__init__(shape)
        self.step_sleep, self.step_sleep_off = step_sleep, step_sleep_off
        self.state_bytes = state_bytes

    def build(self, ctx: JobContext) -> None:
        if self.state_bytes is not None:
            self.shape = replace(self.shape, hidden_size=hidden_for(
                self.state_bytes, self.shape, tp=ctx.tp))
        super().build(ctx)

    def compute(self, step: int) -> float:
        if self.step_sleep and not (self.step_sleep_off and self.step_sleep_off.exists()):
            time.sleep(self.step_sleep)
        return super().compute(step)


class ShardedGPTJob(GPTJob, ShardedMegatronJob):
    """:class:`GPTJob` with Megatron's DDP and ``DistributedOptimizer`` (``--distributed-
    optimizer``; CUDA only), each rank's optimizer part copied on the next DP rank."""

    def __init__(self, shape: GPTShape | None = None, step_sleep: float = 0.0,
                 step_sleep_off: Path | None = None, state_bytes: int | None = None,
                 bf16: bool = False) -> None:
        super().__init__(shape, step_sleep, step_sleep_off, state_bytes)
        self.bf16 = bf16


#: bytes of state per parameter: the fp32 value and Adam's two moments
STATE_PER_PARAM = 3 * 4


def rank_params(shape: GPTShape, tp: int) -> int:
    """Parameters a rank holds (megatron-core's local GPT layer spec, embeddings shared with the
    output layer): what TP splits (QKV, the projection's and the MLP's weights, the vocabulary)
    over ``tp``, the rest (biases of the row-parallel layers, layer norms, positions) whole."""
    h, v = shape.hidden_size, shape.vocab_size
    split_per_layer = 3 * h * h + 3 * h + h * h + 4 * h * h + 4 * h + 4 * h * h
    whole_per_layer = h + h + 2 * 2 * h  # proj and fc2 biases, two layer norms
    return (shape.num_layers * (split_per_layer // tp + whole_per_layer) + v * h // tp
            + shape.seq_length * h + 2 * h)


def hidden_for(state_bytes: int, shape: GPTShape, tp: int) -> int:
    """The smallest hidden size, a multiple of the attention heads, at which a rank holds at
    least ``state_bytes`` of parameters and Adam state."""
    step = shape.num_attention_heads
    hidden = step
    while rank_params(replace(shape, hidden_size=hidden), tp) * STATE_PER_PARAM < state_bytes:
        hidden += step
    return hidden


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, default=int(os.environ.get("RANK", "0")))
    p.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--state-size", type=size_arg, metavar="SIZE",
                   help="the state a rank holds (parameters and Adam's moments): 27KB, 64MiB, "
                   "1GiB...; sets the hidden size to match (default: hidden 64, about 0.5 MB "
                   "per rank at TP 2)")
    p.add_argument("--distributed-optimizer", action="store_true",
                   help="Megatron's DistributedDataParallel and DistributedOptimizer (ZeRO-1), "
                   "each rank's optimizer part copied on the next DP rank so that a lost rank "
                   "loses no step; needs CUDA (megatron-core 0.16.1 runs them on CUDA only). "
                   "--state-size then sizes the model as for the replicated job")
    p.add_argument("--bf16", action="store_true",
                   help="with --distributed-optimizer: bf16 parameters (Megatron's "
                   "Float16Module), fp32 main copies in the optimizer, gradients reduced in fp32")
    p.add_argument("--store", help="file shared by all ranks to bootstrap groups (standalone "
                   "runs; under `understudy run` the daemons bootstrap the groups)")
    p.add_argument("--job", default="megatron-gpt")
    p.add_argument("--steps", type=int, required=True, help="stop once this many are committed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--collective-timeout", type=float, default=60.0)
    p.add_argument("--group-timeout", type=float, default=300.0,
                   help="gloo's own timeout (standalone); keep it above --collective-timeout")
    p.add_argument("--save", type=Path, help="directory for the final state, losses and timings")
    p.add_argument("--step-sleep", type=float, default=0.0,
                   help="seconds of extra work per step (to stand in for a bigger model)")
    p.add_argument("--step-sleep-off", type=Path, help="no more step sleep once this file "
                   "exists (a test lets the job run out at full speed once its faults are "
                   "over; the sleep never changes the state)")
    return p.parse_args(argv)


def make_job(args: argparse.Namespace) -> GPTJob:
    if args.distributed_optimizer:
        return ShardedGPTJob(step_sleep=args.step_sleep, step_sleep_off=args.step_sleep_off,
                             state_bytes=args.state_size, bf16=args.bf16)
    return GPTJob(step_sleep=args.step_sleep, step_sleep_off=args.step_sleep_off,
                  state_bytes=args.state_size)


def pick_device(args: argparse.Namespace) -> None:
    """With ``--distributed-optimizer``: ``LOCAL_RANK``'s GPU (else ``--rank``'s), modulo the
    GPUs there are; without CUDA, the reason it cannot run, before any group is built."""
    if args.bf16 and not args.distributed_optimizer:
        raise SystemExit("--bf16 needs --distributed-optimizer (the CPU job trains in fp32)")
    if not args.distributed_optimizer:
        return
    if not torch.cuda.is_available():
        from understudy.worker.megatron.distributed import CUDA_ONLY
        raise SystemExit(f"--distributed-optimizer: {CUDA_ONLY}")
    index = int(os.environ.get("LOCAL_RANK", args.rank))
    torch.cuda.set_device(index % torch.cuda.device_count())


@record
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    pick_device(args)
    if os.environ.get("UNDERSTUDY_JOB"):
        return _under_understudy(args)
    if args.store is None:
        raise SystemExit("--store is needed when the job does not run under `understudy run`")
    logs.configure(stream=sys.stderr)
    groups, provider = file_store_groups(args.store, job=args.job, rank=args.rank,
                                         world_size=args.world_size, tp=args.tp,
                                         timeout=args.group_timeout)
    ctx = JobContext(job=args.job, rank=args.rank, world_size=args.world_size, tp=args.tp,
                     groups=provider, seed=args.seed, collective_timeout=args.collective_timeout)
    runtime = Runtime(make_job(args), ctx)
    runtime.build()
    runtime.run(args.steps)
    if args.save is not None:
        save(runtime, args.save, args.rank)
    groups.close()
    return 0


def _under_understudy(args: argparse.Namespace) -> int:
    """Under ``understudy run``: the launcher sets up the groups, migrations and standbys."""
    from understudy.worker.launch import main as launch

    def finish(runtime: Runtime) -> None:
        if args.save is not None:
            save(runtime, args.save, runtime.ctx.rank)

    return launch(lambda: make_job(args), args.steps, seed=args.seed, on_finish=finish,
                  collective_timeout=args.collective_timeout)


def save(runtime: Runtime, directory: Path, rank: int) -> None:
    """The state as ``rank<r>.pt``; the counters, this process's losses and the timings as
    ``rank<r>.json``."""
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(runtime.state(), directory / f"rank{rank}.pt")
    job: Any = runtime.job
    summary = {"step": runtime.step, "redone": runtime.redone,
               "losses": {str(s): v for s, v in sorted(job.losses.items())},
               "timings": [asdict(t) for t in runtime.timings]}
    (directory / f"rank{rank}.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    sys.exit(main())
