"""A rank that waits too long in one collective says so, so that the controller can find the
rank its peers wait on.

A rank that hangs (deadlocked, stopped, stuck in a driver call) sends no reset and does not
exit: its peers wait for it in their next collective until their collective timeout fails
*them*, and the job then recovers, or pauses, on the wrong ranks while the hung one holds its
place (seen: two hung ranks of a TP=2 x DP=2 job left the two that waited on them failed by
their timeout and the job paused). So
every rank's worker runs a :class:`StuckReporter`: while one of its waits
(``groups/abortable.py``) has lasted past ``after`` seconds (half the collective timeout), it
writes a :class:`~understudy.common.records.StuckReport` to ``<job>/stuck`` key ``<rank>``
through its daemon, again every ``every`` seconds while the wait lasts, and deletes it once the
wait ends. When every rank of a job that is still held waits but some, the controller takes
those that do not for hung and plans their recovery like a failed rank's
(``daemon/planner.py``, ``hung_ranks``); their daemons stop them once the new assignment lands.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from understudy.common.daemon_client import DaemonClient, DaemonError
from understudy.common.records import STUCK_NAMESPACE, StuckReport
from understudy.groups import abortable

#: seconds between two looks at this process's waits
LOOK_S = 1.0
#: seconds between two reports of the same wait
EVERY_S = 3.0


class StuckReporter:
    """One rank's stuck reports, on a thread of its own. ``place()`` gives this process's
    current rank and epoch, ``step()`` its committed steps; ``after`` is how long a wait lasts
    before it is reported."""

    def __init__(self, job: str, place: Callable[[], tuple[int, int]], step: Callable[[], int],
                 after: float, look: float = LOOK_S, every: float = EVERY_S) -> None:
        self.job, self._place, self._step = job, place, step
        self.after, self.look, self.every = after, look, every
        self._stop = threading.Event()
        self._client: tuple[int, DaemonClient] | None = None
        self._reported: tuple[int, float] | None = None  # (rank, monotonic time of last)
        self._thread = threading.Thread(target=self._run, name="understudy-stuck",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            # A reported wait that ends is withdrawn at once: a report left up after its wait
            # could make the controller take the ranks that did not wait for hung.
            abortable.long_wait_ended.wait(self.look)
            abortable.long_wait_ended.clear()
            if self._stop.is_set():
                return
            try:
                self.check()
            except DaemonError:
                self._drop()  # the next look tries again, on a fresh connection

    def check(self, now: float | None = None) -> None:
        """Report the wait in progress if it has lasted past ``after``; withdraw the report
        once no wait has."""
        now = time.monotonic() if now is None else now
        wait = abortable.waiting()
        rank, epoch = self._place()
        if wait is None or now - wait[0] < self.after:
            if self._reported is not None:
                said, _ = self._reported
                self._reported = None
                self._connect(epoch).delete(str(said))
            return
        if self._reported is not None and self._reported[0] == rank and \
                now - self._reported[1] < self.every:
            return
        report = StuckReport(job=self.job, rank=rank, epoch=epoch, step=self._step(),
                             waited=round(now - wait[0], 3), what=wait[1][:200],
                             at=time.time(), after=self.after)
        self._connect(epoch).set(str(rank), report.encode())
        self._reported = (rank, now)

    def _connect(self, epoch: int) -> DaemonClient:
        if self._client is not None and self._client[0] != epoch:
            self._drop()
        if self._client is None:
            self._client = (epoch, DaemonClient(STUCK_NAMESPACE.format(job=self.job),
                                                epoch=epoch, timeout=5.0))
        return self._client[1]

    def _drop(self) -> None:
        if self._client is not None:
            self._client[1].close()
            self._client = None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(self.look + 10)
        self._drop()
