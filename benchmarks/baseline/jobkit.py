"""What the baselines' jobs (``torchrun_job.py``, ``torchft_job.py``) share: the plain-PyTorch
example's job, a job context whose waits are plain, and the JSON lines each process writes.

Imported by the jobs once they have taken their start time: it imports torch.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from understudy.worker.api import JobContext, Work

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples" / "plain_torch"))
from train import PlainJob  # noqa: E402

__all__ = ["Log", "PlainContext", "PlainJob"]


class PlainContext(JobContext):
    """A job context whose waits are plain ``work.wait()``: no polling, no abort (under
    torchft, its managed work records an error instead of raising, and ``should_commit`` then
    says no)."""

    def wait(self, work: Work, what: str, timeout: float | None = None) -> None:
        work.wait()


class Log:
    """This process's JSON lines (``<directory>/rank<r>-<pid>.jsonl``), flushed at once."""

    def __init__(self, directory: Path, rank: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self._f = open(directory / f"rank{rank}-{os.getpid()}.jsonl", "a",  # noqa: SIM115
                       buffering=1)

    def __call__(self, kind: str, **fields: Any) -> None:
        rec = {"kind": kind, "t": time.time(), "rank": self.rank, "pid": os.getpid(), **fields}
        self._f.write(json.dumps(rec) + "\n")
