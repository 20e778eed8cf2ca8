"""One rank of a DP-only Megatron GPT trained with Megatron's DistributedOptimizer
(:class:`~understudy.worker.megatron.distributed.ShardedMegatronJob`) on CUDA, standalone (a
file store, no daemons); ``tests/integration/test_megatron_gpu.py`` runs it.

``--hand-over own:2,copy:4``: at each of these steps DP rank 1's job is replaced by a new
one, built the way a joiner builds it, which takes

- ``own``: rank 1's own state (a drain's hand-over), or
- ``copy``: the state rank 0 rebuilds from its copy of rank 1's optimizer part (a recovery:
  ``replica_state``), without rank 1's copy of rank 0's part, which rank 0 sends during the
  next step;

and the job goes on to ``--steps``; without ``--hand-over`` it is the uninterrupted run. Each
rank saves its final state (on the CPU) as ``rank<r>.pt`` in ``--out``, and its losses as
``losses<r>.txt``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from understudy.worker.megatron import quiet_imports

with quiet_imports():
    from understudy.worker.megatron.adapter import file_store_groups
    from understudy.worker.megatron.distributed import ShardedMegatronJob

from understudy.worker.api import JobContext


def to_cpu(value: Any) -> Any:
    """A copy of ``value`` with every tensor on the CPU (nothing shared with the job)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    return value


def train(job: ShardedMegatronJob, first: int, last: int) -> None:
    for step in range(first, last):
        job.reseed(step)
        job.compute(step)
        job.apply(step)


def run(args: argparse.Namespace, job_class: type[ShardedMegatronJob] = ShardedMegatronJob,
        ) -> None:
    out: Path = args.out
    groups, provider = file_store_groups(str(args.store), job="gpt", rank=args.rank,
                                         world_size=args.world, tp=1, timeout=120)
    ctx = JobContext(job="gpt", rank=args.rank, world_size=args.world, tp=1, groups=provider,
                     seed=7, collective_timeout=60)
    job = job_class(bf16=args.bf16)
    job.build(ctx)
    done = 0
    for at, kind in args.hand_over:
        train(job, done, at)
        done = at
        handed = out / f"handed{at}.pt"
        if kind == "copy" and args.rank == 0:
            # Whole or not at all: rank 1 polls for the name.
            torch.save(to_cpu(job.replica_state(1)), handed.with_suffix(".part"))
            handed.with_suffix(".part").rename(handed)
        if args.rank != 1:
            continue
        if kind == "own":
            state = to_cpu(job.state())
        else:
            deadline = time.monotonic() + 60
            while not handed.exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank 0 never handed rank 1's state of step {at} over")
                time.sleep(0.05)
            state = torch.load(handed, weights_only=True)
            assert state["buddy"] is None and state["buddy_missing"]
        del job
        job = job_class(bf16=args.bf16)
        job.build(ctx)
        job.load_state(state)
        print(f"rank 1 replaced at step {at} with {kind} state", flush=True)
    train(job, done, args.steps)
    assert not job.buddy_missing
    torch.save(to_cpu(job.state()), out / f"rank{args.rank}.pt")
    (out / f"losses{args.rank}.txt").write_text(
        "\n".join(f"{s} {v!r}" for s, v in sorted(job.losses.items())))
    groups.close()


def hand_overs(text: str) -> list[tuple[int, str]]:
    """``own:2,copy:4`` -> ``[(2, "own"), (4, "copy")]``; empty: none."""
    events = []
    for item in filter(None, text.split(",")):
        kind, _, at = item.partition(":")
        if kind not in ("own", "copy") or not at.isdigit():
            raise argparse.ArgumentTypeError(f"{item!r} is not own:STEP or copy:STEP")
        events.append((int(at), kind))
    return sorted(events)


class OnCPU:
    """The job's own CUDA choices (its device, Megatron's CUDA RNG tracker) made the CPU ones
    of :class:`~understudy.worker.megatron.adapter.MegatronJob`: a mixin, first in the bases,
    for :func:`cpu_emulation`."""

    def _check_device(self) -> None:
        pass

    def _device(self) -> torch.device:
        return torch.device("cpu")

    def _install_rng(self, ctx: JobContext) -> Any:
        from understudy.worker.megatron import cpu

        tracker = cpu.install()
        cpu.model_parallel_cpu_manual_seed(tracker, ctx.seed, tp_rank=ctx.tp_index)
        return tracker


def cpu_emulation() -> None:
    """**Emulation, for the CPU tests only**: megatron-core 0.16.1 refuses to run its
    ``DistributedOptimizer`` without CUDA through three device literals, which this redirects to
    the CPU in this process, so that the adapter's code path (with :class:`OnCPU`) runs on real
    megatron-core code over real gloo groups:

    - ``torch.cuda.current_device()``, where ``_ParamAndGradBuffer`` allocates its buffers,
      answers ``"cpu"``;
    - a CPU fp32 or bf16 parameter's ``type()`` answers ``torch.cuda.FloatTensor`` or
      ``torch.cuda.BFloat16Tensor`` (the type check in
      ``DistributedOptimizer._build_model_and_main_param_groups``);
    - ``torch.tensor(..., device='cuda')`` in ``megatron/core/optimizer/optimizer.py`` (the
      optimizer's flags) makes a CPU tensor.

    What this cannot show: NCCL's point-to-point order, CUDA kernels' bitwise agreement between
    owner and copy; the GPU test runs the same worker without it.
    """
    import types

    import megatron.core.optimizer.optimizer as megatron_optimizer

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    tensor_type = torch.Tensor.type

    def cuda_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        name = tensor_type(self, *args, **kwargs)
        if not args and not kwargs and name in ("torch.FloatTensor", "torch.BFloat16Tensor"):
            return name.replace("torch.", "torch.cuda.")
        return name

    torch.nn.Parameter.type = cuda_type  # type: ignore[method-assign,assignment]

    class TorchOnCPU(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            return getattr(torch, name)

        @staticmethod
        def tensor(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
            return torch.tensor(*args, **kwargs)

    megatron_optimizer.torch = TorchOnCPU("torch")  # type: ignore[assignment]


class EmulatedJob(OnCPU, ShardedMegatronJob):
    """:class:`ShardedMegatronJob` on CPU, after :func:`cpu_emulation`."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--store", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--hand-over", type=hand_overs, default=[],
                   help="rank 1's job replaced at these steps: own:2,copy:4")
    p.add_argument("--bf16", action="store_true",
                   help="bf16 parameters, Megatron's fp32 main copies in the optimizer")
    p.add_argument("--cpu-emulation", action="store_true",
                   help="run on CPU with megatron-core's CUDA literals redirected (the CPU "
                   "test; see cpu_emulation)")
    return p.parse_args(argv)


def main() -> int:
    args = parse_args()
    if args.cpu_emulation:
        cpu_emulation()
        run(args, EmulatedJob)
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --cpu-emulation)")
    if torch.cuda.device_count() > 1:
        torch.cuda.set_device(args.rank % torch.cuda.device_count())
    run(args)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    sys.exit(main())
