"""A plain torch.distributed training script, as teams write them for torchrun. It knows nothing
of understudy (it must not import it): ``understudy run --restart-only`` runs it unmodified.

env:// rendezvous (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; rank 0 hosts the
TCPStore), gloo, a small data-parallel MLP with dropout and SGD with momentum written out (no
``torch.optim``, whose first use imports ``torch._dynamo``: a second of CPU per process). It
keeps its own checkpoints: every ``--save-every`` steps, and at the step boundary after a
SIGTERM (the flag rides on the gradient all-reduce, so every rank stops at the same step), each
rank writes its model, momentum, step and RNG state, and after a barrier rank 0 points
``latest`` at them. On start it resumes from ``latest``. The batch of a step is a function of
the seed, the step and the rank, so a run resumed from a checkpoint is bit for bit the
uninterrupted one.

Each process appends JSON lines to ``--events/rank<r>.jsonl``: ``start`` (with the torchrun
variables it was given), ``resumed``, ``saved``, ``exit``. At the end rank 0 writes ``--out``: the
step and the SHA-256 of the parameters' bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                 "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS")

_stop = False


def _on_sigterm(signum: int, frame: Any) -> None:
    global _stop
    _stop = True


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", type=Path, required=True, help="checkpoint directory")
    p.add_argument("--events", type=Path, required=True, help="directory of the JSON-lines logs")
    p.add_argument("--out", type=Path, required=True, help="rank 0's final digest")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args()
    signal.signal(signal.SIGTERM, _on_sigterm)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    args.events.mkdir(parents=True, exist_ok=True)
    log_file = open(args.events / f"rank{rank}.jsonl", "a")  # noqa: SIM115 - the process's

    def log(event: str, **fields: Any) -> None:
        log_file.write(json.dumps({"event": event, "rank": rank, "pid": os.getpid(),
                                   "time": time.time(), **fields}) + "\n")
        log_file.flush()

    log("start", env={k: os.environ.get(k) for k in TORCHRUN_VARS})
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(64, 4))
    params = list(model.parameters())
    momentum = [torch.zeros_like(q) for q in params]
    torch.manual_seed(args.seed + 1 + rank)  # dropout differs by rank
    step = 0
    latest = args.ckpt / "latest"
    if latest.exists():
        step = int(latest.read_text())
        state = torch.load(args.ckpt / f"step{step}" / f"rank{rank}.pt")
        with torch.no_grad():
            for q, v in zip(params, state["params"], strict=True):
                q.copy_(v)
            for m, v in zip(momentum, state["momentum"], strict=True):
                m.copy_(v)
        torch.set_rng_state(state["rng"])
        assert state["step"] == step
        log("resumed", step=step)

    def save(reason: str) -> None:
        folder = args.ckpt / f"step{step}"
        folder.mkdir(parents=True, exist_ok=True)
        torch.save({"params": [q.detach().clone() for q in params], "momentum": momentum,
                    "rng": torch.get_rng_state(), "step": step}, folder / f"rank{rank}.pt")
        dist.barrier()
        if rank == 0:
            tmp = args.ckpt / "latest.tmp"
            tmp.write_text(str(step))
            tmp.replace(latest)
        dist.barrier()
        log("saved", step=step, reason=reason)

    while step < args.steps:
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 101 + rank)
        x = torch.randn(32, 16, generator=g)
        y = torch.randn(32, 4, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        grads = torch.autograd.grad(loss, params)
        flat = torch.cat([*(gr.reshape(-1) for gr in grads),
                          torch.tensor([1.0 if _stop else 0.0])])
        dist.all_reduce(flat)
        stopping = bool(flat[-1].item() > 0)
        offset = 0
        with torch.no_grad():
            for q, m in zip(params, momentum, strict=True):
                gr = flat[offset:offset + q.numel()].view_as(q) / world
                offset += q.numel()
                m.mul_(0.9).add_(gr)
                q.sub_(0.05 * m)
        step += 1
        if stopping:
            save("sigterm")
            log("exit", step=step, why="sigterm")
            dist.destroy_process_group()
            return 0
        if step % args.save_every == 0:
            save("periodic")
        if args.step_sleep:
            time.sleep(args.step_sleep)
    if rank == 0:
        digest = hashlib.sha256(b"".join(q.detach().numpy().tobytes() for q in params))
        args.out.write_text(json.dumps({"step": step, "sha256": digest.hexdigest()}))
    dist.barrier()
    log("exit", step=step, why="finished")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
