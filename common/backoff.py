"""Waits between retries of a call to etcd: exponential, capped, jittered.

After an etcd outage every daemon of the fleet retries the same calls: register again, campaign
for the controller key, read the jobs. With fixed waits they stay in lock-step (the outage
started at the same moment for all of them), so when etcd answers again thousands of daemons
call it within the same few milliseconds, and again one wait later. Each wait here is drawn
from ``[b/2, b]``, ``b = min(cap, first * 2**n)`` for the ``n``-th retry in a row ("equal
jitter"): the retries of a fleet spread over the cap within a few attempts, and no daemon waits
less than half the bound (nobody spins).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Backoff:
    """The waits of one retry loop. :meth:`next` before each retry, :meth:`reset` once the
    call succeeded. The defaults are a daemon's retries of a call to etcd."""

    first: float = 0.1
    cap: float = 1.0
    rng: random.Random = field(default_factory=random.Random, repr=False)
    #: retries in a row so far
    attempt: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.first <= self.cap:
            raise ValueError(f"backoff needs 0 < first <= cap, got {self.first}, {self.cap}")

    def next(self) -> float:
        """Seconds to wait before the next retry."""
        bound = min(self.cap, self.first * 2.0 ** min(self.attempt, 30))
        self.attempt += 1
        return self.rng.uniform(bound / 2, bound)

    def reset(self) -> None:
        self.attempt = 0
