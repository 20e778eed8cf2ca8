"""What a rank tells its daemon about its training, for the daemon's metrics (issue 18, item 2).

Every few seconds each rank sends one report over the local socket (``Op.METRICS``): the steps
it committed since the last one, their durations, the time its steps spent in each part (the
boundary hook, compute, the vote, apply), and the state transfers it finished. The daemon adds
them to its ``/metrics`` (no port per rank). A report is the worker's word, so it is checked
field by field and bounded before the daemon believes it (:meth:`WorkerReport.parse`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

#: the parts of a step, as :class:`~understudy.worker.runtime.StepTiming` times them
STEP_PARTS = ("boundary", "compute", "vote", "apply")
#: at most this many step durations in one report (a worker with more sends the newest)
MAX_STEPS = 5000
#: at most this many transfers in one report
MAX_TRANSFERS = 100
DIRECTIONS = ("send", "receive")


class ReportError(ValueError):
    """A report that does not fit: refused whole, nothing of it counted."""


@dataclass(frozen=True)
class Transfer:
    direction: str
    payload_bytes: int
    seconds: float


@dataclass(frozen=True)
class WorkerReport:
    rank: int
    #: durations of the steps committed since the last report, seconds (all attempts of each)
    step_seconds: tuple[float, ...] = ()
    #: seconds spent in each of :data:`STEP_PARTS` by those steps
    parts: dict[str, float] = field(default_factory=dict)
    transfers: tuple[Transfer, ...] = ()

    def as_request(self) -> dict[str, Any]:
        return {"rank": self.rank, "step_seconds": list(self.step_seconds[-MAX_STEPS:]),
                "parts": dict(self.parts),
                "transfers": [{"direction": t.direction, "bytes": t.payload_bytes,
                               "seconds": t.seconds} for t in self.transfers[-MAX_TRANSFERS:]]}

    @classmethod
    def parse(cls, req: dict[str, Any]) -> WorkerReport:
        """The report in a request, checked.

        Raises:
            ReportError: a field is missing, of the wrong type, negative, not finite, or
                beyond its bound.
        """
        rank = req.get("rank")
        if not isinstance(rank, int) or not _count(rank) or rank > 1_000_000:
            raise ReportError("metrics: rank must be an integer from 0 to 1000000")
        steps = req.get("step_seconds", [])
        if not isinstance(steps, list) or len(steps) > MAX_STEPS or not all(
                _seconds(s) for s in steps):
            raise ReportError(f"metrics: step_seconds must be a list of at most {MAX_STEPS} "
                              "non-negative numbers of seconds")
        parts = req.get("parts", {})
        if not isinstance(parts, dict) or set(parts) - set(STEP_PARTS) or not all(
                _seconds(v) for v in parts.values()):
            raise ReportError(f"metrics: parts must map some of {', '.join(STEP_PARTS)} to "
                              "non-negative seconds")
        transfers = req.get("transfers", [])
        if not isinstance(transfers, list) or len(transfers) > MAX_TRANSFERS:
            raise ReportError(f"metrics: transfers must be a list of at most {MAX_TRANSFERS}")
        out = []
        for t in transfers:
            if not isinstance(t, dict) or t.get("direction") not in DIRECTIONS or not _count(
                    t.get("bytes")) or not _seconds(t.get("seconds")):
                raise ReportError("metrics: a transfer is {direction: send|receive, bytes: "
                                  "count, seconds: non-negative}")
            out.append(Transfer(t["direction"], t["bytes"], float(t["seconds"])))
        return cls(rank=rank, step_seconds=tuple(float(s) for s in steps),
                   parts={k: float(v) for k, v in parts.items()}, transfers=tuple(out))


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _seconds(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) \
        and 0 <= x < 1e7
