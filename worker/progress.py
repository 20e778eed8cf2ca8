"""How far a job has got, for the operator: rank 0 says how many steps are committed.

Every :data:`EVERY_S` seconds (and once more as the run ends) the process that holds rank 0
writes a :class:`~understudy.common.records.ProgressReport` to ``<job>/progress`` key ``0`` of
the workers' key-value service, through its daemon, under its epoch: ``kv/<job>/progress/0``
in etcd, which ``understudy jobs`` reads (``cli/jobs.py``). One small write per job every few
seconds, off the training thread; a write the daemon cannot take is dropped (the next one says
more).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from understudy.common.daemon_client import DaemonClient, DaemonError
from understudy.common.records import PROGRESS_NAMESPACE, ProgressReport

#: seconds between two reports
EVERY_S = 5.0


class ProgressReporter:
    """Rank 0's reports, on a thread of its own. ``place()`` gives this process's current rank
    and epoch (a reshape renumbers ranks, a migration moves the epoch); ``step()`` the committed
    step count."""

    def __init__(self, job: str, place: Callable[[], tuple[int, int]],
                 step: Callable[[], int], every: float = EVERY_S) -> None:
        self.job, self._place, self._step, self.every = job, place, step, every
        self._stop = threading.Event()
        self._client: tuple[int, DaemonClient] | None = None
        self._said: tuple[int, int] | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="understudy-progress",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.report()

    def report(self) -> None:
        """Write the report now if this process holds rank 0 and it changed."""
        with self._lock:
            rank, epoch = self._place()
            step = self._step()
            if rank != 0 or (step, epoch) == self._said:
                return
            try:
                if self._client is not None and self._client[0] != epoch:
                    self._client[1].close()
                    self._client = None
                if self._client is None:
                    self._client = (epoch, DaemonClient(PROGRESS_NAMESPACE.format(job=self.job),
                                                        epoch=epoch, timeout=5.0))
                report = ProgressReport(job=self.job, step=step, epoch=epoch, at=time.time())
                self._client[1].set("0", report.encode())
                self._said = (step, epoch)
            except DaemonError:
                if self._client is not None:
                    self._client[1].close()
                self._client = None

    def close(self, final: bool = True) -> None:
        """Stop reporting; with ``final``, after one last report (the run's final step)."""
        self._stop.set()
        self._thread.join(timeout=self.every + 1)
        if final:
            self.report()
        with self._lock:
            if self._client is not None:
                self._client[1].close()
                self._client = None
