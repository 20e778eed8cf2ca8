"""A data-parallel job that trains on the GPU under the daemons (``TrainingJob.gpu``):
``tests/integration/test_gpu_cluster.py`` drains and crashes it on real daemons.

Two linear layers with dropout between them and Adam, the parameters, gradients and optimizer
state on the worker's GPU; each step's gradients are averaged over the DP group with one
all-reduce of a CUDA tensor, which the group's NCCL backend carries. The batch of a step is a
function of the seed, the step and the rank's DP index, and the dropout masks follow from
``reseed``, so a rank rebuilt from its replica draws what the lost one would have. At the end
each rank saves its state, moved to the CPU, as ``--save/rank<r>.pt`` (what
``tests/integration/bitwise.py`` compares) with the device it trained on in ``rank<r>.json``.

Run it under ``understudy run --dp N -- python gpu_dp.py --steps S --save DIR``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from understudy.worker import rng
from understudy.worker.api import JobContext, TrainingJob, allreduce_options
from understudy.worker.launch import main as launch
from understudy.worker.runtime import Runtime


def _cpu(tree: Any) -> Any:
    if torch.is_tensor(tree):
        return tree.detach().cpu()
    if isinstance(tree, dict):
        return {k: _cpu(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_cpu(v) for v in tree)
    return tree


class GpuDataParallelJob(TrainingJob):
    gpu = True

    def __init__(self, width: int, batch: int, step_sleep: float, cpu: bool = False) -> None:
        self.width, self.batch, self.step_sleep, self.cpu = width, batch, step_sleep, cpu
        self.committed = 0

    def build(self, ctx: JobContext) -> None:
        if ctx.tp != 1 or ctx.pp != 1:
            raise ValueError("gpu_dp.py is data-parallel only: run it with --tp 1 --pp 1")
        if not (self.cpu or torch.cuda.is_available()):
            raise RuntimeError("gpu_dp.py trains on a GPU: this machine has no CUDA")
        self.ctx = ctx
        self.device = (torch.device("cpu") if self.cpu
                       else torch.device("cuda", torch.cuda.current_device()))
        g = torch.Generator().manual_seed(ctx.seed)  # every replica starts from the same model
        w = self.width
        self.model = torch.nn.Sequential(torch.nn.Linear(w, w), torch.nn.ReLU(),
                                         torch.nn.Dropout(0.1), torch.nn.Linear(w, w))
        with torch.no_grad():
            for q in self.model.parameters():
                q.copy_(torch.randn(q.shape, generator=g) * 0.05)
        self.model.to(self.device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-3)

    def reseed(self, step: int) -> None:
        rng.seed_all((self.ctx.seed * 1_000_003 + self.ctx.rank) * 1_000_033 + step)

    def compute(self, step: int) -> float | None:
        ctx = self.ctx
        g = torch.Generator().manual_seed(ctx.seed * 7919 + step * 131 + ctx.rank)
        x = torch.randn(self.batch, self.width, generator=g).to(self.device)
        y = torch.randn(self.batch, self.width, generator=g).to(self.device)
        self.optimizer.zero_grad(set_to_none=False)
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        grads = [q.grad for q in self.model.parameters()]
        flat = torch.cat([q.flatten() for q in grads if q is not None])
        work = ctx.group("dp").allreduce([flat], allreduce_options(dist.ReduceOp.SUM))
        ctx.wait(work, "the DP gradient all-reduce")
        flat /= ctx.dp
        offset = 0
        for q in grads:
            assert q is not None
            q.copy_(flat[offset:offset + q.numel()].view_as(q))
            offset += q.numel()
        if self.step_sleep:
            time.sleep(self.step_sleep)  # a bigger model's compute: room for the scenario
        return float(loss.detach())

    def apply(self, step: int) -> None:
        self.optimizer.step()
        self.committed = step + 1

    def discard(self, step: int) -> None:
        self.optimizer.zero_grad(set_to_none=False)

    def state(self) -> dict[str, Any]:
        return {"params": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "step": self.committed}

    def load_state(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["params"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.committed = int(state["step"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--save", type=Path, required=True)
    p.add_argument("--cpu", action="store_true",
                   help="train on the CPU over gloo (developing the test where there is no GPU)")
    args = p.parse_args(argv)

    def finish(runtime: Runtime) -> None:
        rank = runtime.ctx.rank
        args.save.mkdir(parents=True, exist_ok=True)
        job = runtime.job
        assert isinstance(job, GpuDataParallelJob)
        devices = sorted({str(q.device) for q in job.model.parameters()})
        torch.save(_cpu(runtime.state()), args.save / f"rank{rank}.pt")
        (args.save / f"rank{rank}.json").write_text(json.dumps(
            {"step": runtime.step, "devices": devices, "redone": runtime.redone}))

    return launch(lambda: GpuDataParallelJob(args.width, args.batch, args.step_sleep,
                                                    args.cpu),
                  args.steps, seed=args.seed, on_finish=finish)


if __name__ == "__main__":
    sys.exit(main())
