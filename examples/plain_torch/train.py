"""A plain-PyTorch job on the understudy worker API: a tensor- and data-parallel MLP with Adam.

The model is ``y = W2 dropout(gelu(W1 x + b1)) + b2``, split Megatron-style over the TP group:
``W1`` by rows (column-parallel), ``W2`` by columns (row-parallel), the partial outputs summed
by an all-reduce over the TP group. Gradients are averaged over the DP group. The data is a
synthetic regression whose batches derive from ``(seed, step, dp_index)``, so the data position
is the step itself; the learning rate warms up linearly, then decays along a cosine.

Every run with the same arguments is bitwise identical, and so is a run whose ranks hand their
state to fresh processes midway (``--save`` then ``--load``).

Four ranks, TP=2 x DP=2, bootstrapped through a file store::

    for r in 0 1 2 3; do
        python examples/plain_torch/train.py --rank $r --world-size 4 --tp 2 \\
            --store /tmp/plain-store --steps 50 &
    done; wait

``--fail-at`` and ``--freeze-at`` inject faults for tests (a transient compute error, a frozen
process); production code knows nothing of them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from understudy.daemon import logs
from understudy.worker import rng
from understudy.worker.api import JobContext, TrainingJob, allreduce_options
from understudy.worker.errors import record
from understudy.worker.runtime import Runtime, StaticGroups


class _SumOverTP(torch.autograd.Function):
    """Sum partial outputs over the TP group; the gradient passes through unchanged (each TP
    rank's partial contributed to the sum with weight one)."""

    @staticmethod
    def forward(fctx: Any, partial: torch.Tensor, ctx: JobContext) -> torch.Tensor:
        total = partial.clone()
        work = ctx.group("tp").allreduce([total], allreduce_options(dist.ReduceOp.SUM))
        ctx.wait(work, "the TP all-reduce")
        return total

    @staticmethod
    def backward(fctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class PlainJob(TrainingJob):
    def __init__(self, *, features: int = 16, hidden: int = 64, batch: int = 32,
                 lr: float = 1e-2, warmup: int = 5, total_steps: int = 1000,
                 dropout: float = 0.1, fail_at: int | None = None,
                 freeze_at: int | None = None, marker_dir: Path | None = None,
                 step_sleep: float = 0.0) -> None:
        self.features, self.hidden, self.batch = features, hidden, batch
        self.lr, self.warmup, self.total_steps, self.dropout = lr, warmup, total_steps, dropout
        self.fail_at, self.freeze_at, self.marker_dir = fail_at, freeze_at, marker_dir
        self._failed = False
        self.step_sleep = step_sleep

    def build(self, ctx: JobContext) -> None:
        if self.hidden % ctx.tp:
            raise ValueError(f"hidden={self.hidden} does not split over tp={ctx.tp}")
        self.ctx = ctx
        # Full matrices from the job's seed, then this rank's slice: the model is the same
        # whatever the TP degree.
        init = torch.Generator().manual_seed(ctx.seed)
        w1 = torch.randn(self.hidden, self.features, generator=init) / math.sqrt(self.features)
        w2 = torch.randn(self.features, self.hidden, generator=init) / math.sqrt(self.hidden)
        part = slice(ctx.tp_index * self.hidden // ctx.tp,
                     (ctx.tp_index + 1) * self.hidden // ctx.tp)
        self.params = torch.nn.ParameterDict({
            "w1": torch.nn.Parameter(w1[part].clone()),
            "b1": torch.nn.Parameter(torch.zeros(self.hidden // ctx.tp)),
            "w2": torch.nn.Parameter(w2[:, part].clone()),
            "b2": torch.nn.Parameter(torch.zeros(self.features)),
        })
        self.optimizer = torch.optim.Adam(self.params.parameters(), lr=self.lr)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.committed = 0
        # Dropout draws from the global generator, which the runtime saves and restores; each
        # rank has its own stream, as each holds different activations.
        rng.seed_all(ctx.seed * 1_000_003 + ctx.rank)

    def reseed(self, step: int) -> None:
        # This rank's dropout stream follows from (seed, rank, step): a rank rebuilt from a
        # data-parallel replica's state draws the masks the lost rank would have.
        rng.seed_all((self.ctx.seed * 1_000_003 + self.ctx.rank) * 1_000_033 + step)

    def _lr_factor(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.total_steps - self.warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    def _batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed((self.ctx.seed * 1_000_003 + step) * 1_009
                                          + self.ctx.dp_index)
        x = torch.randn(self.batch, self.features, generator=g)
        return x, torch.sin(x) + 0.1 * torch.randn(x.shape, generator=g)

    def compute(self, step: int) -> float:
        ctx, p = self.ctx, self.params
        if self.step_sleep:
            time.sleep(self.step_sleep)
        x, y = self._batch(step)
        self.optimizer.zero_grad(set_to_none=False)
        hidden = F.dropout(F.gelu(x @ p["w1"].T + p["b1"]), self.dropout, training=True)
        out = _SumOverTP.apply(hidden @ p["w2"].T, ctx) + p["b2"]
        loss = F.mse_loss(out, y)
        loss.backward()
        grads = [q.grad for q in self.params.values()]
        assert all(g is not None for g in grads), "every parameter takes part in the loss"
        flat = torch.cat([g.flatten() for g in grads if g is not None])
        work = ctx.group("dp").allreduce([flat], allreduce_options(dist.ReduceOp.SUM))
        ctx.wait(work, "the DP gradient all-reduce")
        flat /= ctx.dp
        offset = 0
        for g in grads:
            if g is not None:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        # Faults are injected after the step's collectives, so that no peer waits on us.
        if step == self.fail_at and not self._failed:
            self._failed = True
            raise RuntimeError(f"injected fault at step {step}")
        if step == self.freeze_at:
            if self.marker_dir is not None:
                (self.marker_dir / f"frozen-rank{ctx.rank}").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)
        return loss.item()

    def apply(self, step: int) -> None:
        self.optimizer.step()
        self.schedule.step()
        self.committed = step + 1

    def discard(self, step: int) -> None:
        self.optimizer.zero_grad(set_to_none=False)

    def state(self) -> dict[str, Any]:
        return {"params": self.params.state_dict(), "optimizer": self.optimizer.state_dict(),
                "schedule": self.schedule.state_dict(),
                "data": {"position": self.committed}, "step": self.committed}

    def load_state(self, state: dict[str, Any]) -> None:
        self.params.load_state_dict(state["params"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        self.committed = int(state["step"])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, default=int(os.environ.get("RANK", "0")))
    p.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--store", help="file shared by all ranks to bootstrap groups (standalone "
                   "runs; under `understudy run` the daemons bootstrap the groups)")
    p.add_argument("--job", default="plain-torch")
    p.add_argument("--steps", type=int, required=True, help="stop once this many are committed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--collective-timeout", type=float, default=60.0)
    p.add_argument("--group-timeout", type=float, default=300.0,
                   help="gloo's own timeout; keep it above --collective-timeout")
    p.add_argument("--load", type=Path, help="start from a state saved with --save")
    p.add_argument("--save", type=Path, help="directory for the final state and timings")
    p.add_argument("--snapshot-at", type=int,
                   help="also save the state once this many steps are committed, under "
                        "SAVE/snapshot")
    p.add_argument("--step-sleep", type=float, default=0.0,
                   help="seconds of extra work per step (to stand in for a bigger model)")
    p.add_argument("--fail-at", type=int, help="fault: fail this step's compute once")
    p.add_argument("--freeze-at", type=int, help="fault: SIGSTOP this rank in this step")
    return p.parse_args(argv)


@record
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.environ.get("UNDERSTUDY_JOB"):
        return _under_understudy(args)
    if args.store is None:
        raise SystemExit("--store is needed when the job does not run under `understudy run`")
    logs.configure(stream=sys.stderr)
    if args.save is not None:
        args.save.mkdir(parents=True, exist_ok=True)
    groups = StaticGroups(dist.FileStore(args.store, args.world_size), rank=args.rank,
                          world_size=args.world_size, tp=args.tp, timeout=args.group_timeout,
                          prefix=f"{args.job}/groups")
    ctx = JobContext(job=args.job, rank=args.rank, world_size=args.world_size, tp=args.tp,
                     groups=groups, seed=args.seed, collective_timeout=args.collective_timeout)
    job = PlainJob(fail_at=args.fail_at, freeze_at=args.freeze_at, marker_dir=args.save)
    runtime = Runtime(job, ctx)
    runtime.build()
    if args.load is not None:
        runtime.load_state(torch.load(args.load / f"rank{args.rank}.pt", weights_only=True))
    if args.snapshot_at is not None:
        runtime.run(args.snapshot_at)
        if args.save is not None:
            save(runtime, args.save / "snapshot", args.rank)
    runtime.run(args.steps)
    if args.save is not None:
        save(runtime, args.save, args.rank)
    return 0


def _under_understudy(args: argparse.Namespace) -> int:
    """Under ``understudy run``: the launcher sets up the groups, migrations and standbys."""
    from understudy.worker.launch import main as launch

    def finish(runtime: Runtime) -> None:
        if args.save is not None:
            save(runtime, args.save, runtime.ctx.rank)

    return launch(lambda: PlainJob(fail_at=args.fail_at, freeze_at=args.freeze_at,
                                   marker_dir=args.save, step_sleep=args.step_sleep),
                  args.steps, seed=args.seed, on_finish=finish,
                  collective_timeout=args.collective_timeout)


def save(runtime: Runtime, directory: Path, rank: int) -> None:
    """The state as ``rank<r>.pt``, the counters and timings as ``rank<r>.json``."""
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(runtime.state(), directory / f"rank{rank}.pt")
    summary = {"step": runtime.step, "redone": runtime.redone,
               "timings": [asdict(t) for t in runtime.timings]}
    (directory / f"rank{rank}.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    sys.exit(main())
