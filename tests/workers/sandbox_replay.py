"""A standby's warmup of the plain-torch example job, in a process of its own: replays the
recording of its role type, then lingers so that an observer can look at its sockets.

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
from sandbox_common import JOB, SCRIPT, SEED, plain_example

from understudy.sandbox.warmup import SandboxTarget, warm_up


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


class WatchedJob(plain_example().PlainJob):  # type: ignore[misc]
    """The example job, noting the sockets held in the middle of every shadow iteration."""

    seen: list[list[str]]

    def compute(self, step: int) -> float:
        loss = super().compute(step)
        self.seen = [*getattr(self, "seen", []), sockets()]
        return loss


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--recordings", type=Path, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--linger", type=float, default=0.0)
    args = p.parse_args()
    target = SandboxTarget(job=JOB, world_size=args.world_size, tp=args.tp, rank=args.rank,
                           script=SCRIPT, seed=SEED)
    job = WatchedJob()
    warmed = warm_up(lambda: job, target, args.recordings)
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
