"""A rank's training, for its daemon's ``/metrics`` (issue 18, item 2; no port per rank).

Every :data:`EVERY_S` seconds (and once as the run ends) each rank sends its daemon one
:class:`~understudy.common.worker_report.WorkerReport` over the local socket: the durations of
the steps it committed since the last report and the time they spent in each part (from the
runtime's :class:`~understudy.worker.runtime.StepTiming` records), and the state transfers
that finished in this process (``transfer.ends.observe_transfers``). The daemon counts them
under the job and the rank. Off the training thread; a report the daemon does not take is
dropped (the counts it held are lost, nothing else).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

from understudy.common.daemon_client import DaemonClient, DaemonError
from understudy.common.worker_report import MAX_STEPS, Transfer, WorkerReport
from understudy.worker.transfer.ends import TransferStats, observe_transfers

#: seconds between two reports
EVERY_S = 5.0


class MetricsReporter:
    """This rank's reports, on a thread of its own, from the worker's start (a joiner's
    transfer comes before it holds a rank). :meth:`bind` gives ``place()``, the rank this
    process holds now and its epoch (a reshape renumbers the rank, a migration moves the
    epoch: the daemon takes a worker's word only under its job's current epoch), and
    ``timings()``, the runtime's step records (appended to as steps run)."""

    def __init__(self, job: str, epoch: int, every: float = EVERY_S) -> None:
        self.job, self.every, self._epoch = job, every, epoch
        self._place: Callable[[], tuple[int, int]] | None = None
        self._timings: Callable[[], Any] = tuple
        self._last: object | None = None  # the newest StepTiming already reported
        #: direction -> (payload bytes, seconds) of the transfers since the last report
        self._transfers: dict[str, tuple[int, float]] = {}
        self._lock = threading.Lock()  # the transfers' sums (taken on transferring threads)
        self._send = threading.Lock()  # the connection
        self._client: DaemonClient | None = None
        self._stop = threading.Event()
        self._unobserve = observe_transfers(self._transferred)
        self._thread = threading.Thread(target=self._run, name="understudy-metrics",
                                        daemon=True)
        self._thread.start()

    def bind(self, place: Callable[[], tuple[int, int]], timings: Callable[[], Any]) -> None:
        """Start reporting as a rank: until then (a standby taking its rank's state) the
        transfers are only kept."""
        self._place, self._timings = place, timings

    def _transferred(self, stats: TransferStats) -> None:
        # Summed by direction: a leaver sending ahead makes one transfer a step.
        with self._lock:
            n, s = self._transfers.get(stats.direction, (0, 0.0))
            self._transfers[stats.direction] = (n + stats.payload_bytes, s + stats.seconds)

    def _run(self) -> None:
        with self._send:
            self._connect(self._epoch)
        while not self._stop.wait(self.every):
            self.report()

    def _connect(self, epoch: int) -> DaemonClient | None:
        """The connection the reports go through, opened once, under the epoch the worker
        started or last reported in: a report is no write to the job's state, so a rank whose
        epoch has passed (a leaver's last report, after the commit) still sends it on the
        connection it has; only a new connection must say a current epoch."""
        if self._client is None:
            with contextlib.suppress(DaemonError):
                self._client = DaemonClient(f"{self.job}/metrics", epoch=epoch, timeout=5.0)
        return self._client

    def _new_timings(self) -> list[Any]:
        records = list(self._timings())  # one copy, taken while the GIL is held
        start = 0
        if self._last is not None:
            for i in range(len(records) - 1, -1, -1):
                if records[i] is self._last:
                    start = i + 1
                    break
        fresh = records[start:]
        if fresh:
            self._last = fresh[-1]
        return fresh

    def report(self) -> None:
        """Send what happened since the last report, if anything did (and the reporter is
        bound to a rank)."""
        if self._place is None:
            return
        with self._lock:
            transfers = tuple(Transfer(d, n, s) for d, (n, s) in sorted(self._transfers.items()))
            self._transfers = {}
        steps: list[float] = []
        parts = {"boundary": 0.0, "compute": 0.0, "vote": 0.0, "apply": 0.0}
        pending = 0.0
        for t in self._new_timings():
            total = t.boundary + t.compute + t.vote + t.apply
            parts["boundary"] += t.boundary
            parts["compute"] += t.compute
            parts["vote"] += t.vote
            parts["apply"] += t.apply
            pending += total
            if t.committed:  # a step's duration counts the attempts the vote turned down
                steps.append(pending)
                pending = 0.0
        if not steps and not transfers:
            return
        rank, epoch = self._place()
        report = WorkerReport(rank=rank, step_seconds=tuple(steps[-MAX_STEPS:]), parts=parts,
                              transfers=transfers)
        with self._send:
            client = self._connect(epoch)
            if client is None:
                return
            try:
                client.report(report)
            except DaemonError:
                client.close()
                self._client = None

    def close(self, final: bool = True) -> None:
        """Stop reporting; with ``final``, after one last report."""
        self._stop.set()
        self._thread.join(timeout=self.every + 1)
        self._unobserve()
        if final:
            self.report()
        with self._send:
            if self._client is not None:
                self._client.close()
                self._client = None
