"""A standby's warmup of an example job, in a process of its own: replays the recording of its
role type, then lingers so that an observer can look at its sockets.

The plain-torch job by default, built on the replay groups; with ``--megatron``, the Megatron
GPT job of a run under ``understudy run`` (``--job``, seed 0), built as the launcher builds it:
on the rank's stable groups, the replay groups standing in for their communicators.

Writes ``OUT/replay.json`` (the report, and the sockets this process held at each compute of
the shadow iterations and after them) and ``OUT/replay-state.pt`` (the job's state after the
shadow iterations).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from sandbox_common import JOB, MEGATRON_SCRIPT, SCRIPT, SEED, megatron_example, plain_example

from understudy.groups.groupset import GroupSet
from understudy.sandbox.warmup import SandboxTarget, warm_up
from understudy.worker.api import TrainingJob


def sockets() -> list[str]:
    """Every socket this process holds, of any family, seen through its file descriptors
    (unlike ``/proc/net``, this does not depend on the network namespace one looks from)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed in between (the listing's own descriptor)
        if target.startswith("socket:"):
            found.append(target)
    return found


def watched(base: type[TrainingJob]) -> TrainingJob:
    """The example job, noting the sockets held in the middle of every shadow iteration."""

    class Watched(base):
        seen: list[list[str]]

        def compute(self, step: int) -> float | None:
            loss = super().compute(step)
            self.seen = [*getattr(self, "seen", []), sockets()]
            return loss

    return Watched()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--recordings", type=Path, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--linger", type=float, default=0.0)
    p.add_argument("--megatron", action="store_true")
    p.add_argument("--job", default=JOB)
    args = p.parse_args()
    groups = None
    if args.megatron:
        target = SandboxTarget(job=args.job, world_size=args.world_size, tp=args.tp,
                               rank=args.rank, script=MEGATRON_SCRIPT, seed=0)
        job = watched(megatron_example().GPTJob)
        groups = GroupSet(args.job, f"r{args.rank}-sandbox",
                          store_factory=lambda ns, cancel: dist.HashStore())
    else:
        target = SandboxTarget(job=args.job, world_size=args.world_size, tp=args.tp,
                               rank=args.rank, script=SCRIPT, seed=SEED)
        job = watched(plain_example().PlainJob)
    warmed = warm_up(lambda: job, target, args.recordings, groups=groups)
    report = asdict(warmed.report)
    report["outcome"] = warmed.report.outcome.value
    torch.save(job.state(), args.out / "replay-state.pt")
    result = {"report": report, "sockets_in_compute": getattr(job, "seen", []),
              "sockets_after": sockets()}
    (args.out / "replay.json").write_text(json.dumps(result))
    time.sleep(args.linger)  # the replay groups are still alive: whatever they held, is held
    return 0


if __name__ == "__main__":
    sys.exit(main())
