"""When a node can no longer prove that it holds its lease.

etcd restarts a lease's TTL when it receives a keep-alive, which is after the daemon sent it. So
the lease cannot expire at etcd before ``sent + ttl`` of the last acknowledged keep-alive. From
``sent + ttl - margin`` on, the daemon cannot prove its lease alive: it reports an etcd outage.
It does not kill its workers for that (silence is not evidence: ``daemon/node.py``); what keeps a
replaced rank from doing harm is the job's epoch, checked where state is committed or written.
Pure: time is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FenceTimer:
    margin: float
    _deadline: float | None = None
    last_ack: float | None = None

    def arm(self, sent_at: float, ttl: float) -> None:
        """A keep-alive sent at ``sent_at`` was acknowledged with ``ttl`` seconds."""
        deadline = sent_at + ttl - self.margin
        if self._deadline is None or deadline > self._deadline:
            self._deadline = deadline
        self.last_ack = sent_at

    def disarm(self) -> None:
        self._deadline = None
        self.last_ack = None

    @property
    def deadline(self) -> float | None:
        return self._deadline

    def expired(self, now: float) -> bool:
        return self._deadline is not None and now >= self._deadline
