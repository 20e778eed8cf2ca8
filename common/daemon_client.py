"""A worker's connection to its node daemon's local socket (protocol: ``common/sockproto.py``).

Synchronous and dependency-free (no torch, no grpc): workers use it from their training loop,
and the process-group bootstrap store wraps it. Every call has a timeout.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from understudy.common import env
from understudy.common.sockproto import Op, decode_value, encode_value, frame
from understudy.common.worker_report import WorkerReport

#: How long one long poll of the job's view waits for a change before it asks again.
JOB_POLL_WAIT_S = 5.0


class DaemonError(RuntimeError):
    """The daemon refused a request or could not be reached; the message says which.
    ``retryable``: the request was fine and etcd did not answer it (an outage); the same
    request may succeed later."""

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


class DaemonClient:
    def __init__(self, namespace: str, epoch: int = 0, path: str | None = None,
                 timeout: float = 30.0) -> None:
        path = path or os.environ.get(env.CHILD_SOCKET)
        if not path:
            raise DaemonError(f"no daemon socket: {env.CHILD_SOCKET} is not set")
        self.timeout = timeout
        self.namespace, self.path = namespace, path
        self._view: _JobView | None = None
        self._ids = itertools.count(1)
        #: one request at a time on the connection (a standby's signs of life come from a
        #: thread of their own while its main thread warms up)
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(path)
        except OSError as exc:
            self._sock.close()
            raise DaemonError(f"cannot reach the daemon at {path}: {exc.strerror}") from exc
        self._file = self._sock.makefile("rwb")
        try:
            self._call(Op.HELLO, namespace=namespace, epoch=epoch)
        except DaemonError:
            self.close()
            raise

    def close(self) -> None:
        if self._view is not None:
            self._view.close()
            self._view = None
        self._file.close()
        self._sock.close()

    def __enter__(self) -> DaemonClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, op: Op, wait: float = 0.0, **args: Any) -> dict[str, Any]:
        with self._lock:
            rid = next(self._ids)
            self._sock.settimeout(self.timeout + wait)
            try:
                self._file.write(frame({"id": rid, "op": op, **args}))
                self._file.flush()
                line = self._file.readline()
            except OSError as exc:
                raise DaemonError(f"daemon connection failed during {op}: {exc}") from exc
        if not line:
            raise DaemonError(f"the daemon closed the connection during {op}")
        reply: dict[str, Any] = json.loads(line)
        if reply.get("id") is None and not reply.get("ok"):  # the daemon refused the connection
            raise DaemonError(str(reply.get("error")))
        if reply.get("id") != rid:
            raise DaemonError(f"daemon answered request {reply.get('id')} instead of {rid}")
        if not reply.get("ok"):
            raise DaemonError(str(reply.get("error")), retryable=reply.get("retry") is True)
        return reply

    def ping(self) -> None:
        self._call(Op.PING)

    def set(self, key: str, value: bytes) -> None:
        self._call(Op.SET, key=key, value=encode_value(value))

    def get(self, key: str, timeout: float = 0.0) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` seconds for it to be set."""
        reply = self._call(Op.GET, wait=timeout, key=key, timeout=timeout)
        return decode_value(reply["value"])

    def add(self, key: str, amount: int) -> int:
        return int(self._call(Op.ADD, key=key, amount=amount)["value"])

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        reply = self._call(Op.COMPARE_SET, key=key, expected=encode_value(expected),
                           desired=encode_value(desired))
        return decode_value(reply["value"])

    def check(self, keys: list[str]) -> bool:
        return bool(self._call(Op.CHECK, keys=keys)["present"])

    def delete(self, key: str) -> bool:
        return bool(self._call(Op.DELETE, key=key)["deleted"])

    def warmth(self, mode: str, roles: list[str], detail: str = "",
               rank: int | None = None, holder: str | None = None) -> None:
        """As a standby worker: say what is warm (``rank``: the rank whose job it has built,
        which the controller prefers to give it; ``holder``: the id of the snapshot holder it
        runs, kept by the daemon until the worker exits). Every later request on this
        connection tells the daemon the worker is alive; one silent for long is replaced."""
        extra: dict[str, Any] = {} if rank is None else {"rank": rank}
        if holder is not None:
            extra["holder"] = holder
        self._call(Op.WARMTH, mode=mode, roles=roles, detail=detail, **extra)

    def job(self) -> dict[str, Any] | None:
        """The job's assignment, status and migration records (JSON objects) as the daemon
        last saw them, or None if the daemon does not know the job. After :meth:`follow_job`,
        from the view its background long poll keeps (no round trip), unless that poll is
        broken: then asked directly."""
        view = self._view
        if view is not None:
            fresh, info = view.current()
            if fresh:
                return info
        return self.job_changed(None, 0.0)[0]

    def job_changed(self, unless: str | None,
                    timeout: float) -> tuple[dict[str, Any] | None, str]:
        """The job's view and its token, once the token differs from ``unless`` or after
        ``timeout`` seconds (the daemon's long poll; None or 0: at once)."""
        args: dict[str, Any] = {} if unless is None else {"unless": unless, "timeout": timeout}
        reply = self._call(Op.JOB, wait=timeout if unless is not None else 0.0, **args)
        return reply["job"], str(reply.get("token", ""))

    @property
    def following(self) -> bool:
        """Whether :meth:`job` answers from a current view, with no round trip."""
        return self._view is not None and self._view.current()[0]

    def follow_job(self, epoch: Callable[[], int], wait: float = JOB_POLL_WAIT_S,
                   on_change: Callable[[], None] | None = None) -> None:
        """From now on keep the job's view current on a thread of its own, with a connection
        of its own that long-polls the daemon (``epoch()``: the worker's epoch, for a
        reconnection's hello), so that :meth:`job` costs no round trip: the boundary hook asks
        at every step. ``on_change`` is called (on that thread) each time the view changed."""
        if self._view is None:
            self._view = _JobView(self.namespace, self.path, epoch, wait, on_change)

    def report(self, report: WorkerReport) -> None:
        """Send a rank's report on its training to the daemon's metrics (``Op.METRICS``)."""
        self._call(Op.METRICS, **report.as_request())

    def num_keys(self) -> int:
        return int(self._call(Op.NUM_KEYS)["count"])


class _JobView:
    """The job's view, kept by a daemon thread that long-polls the daemon on a connection of
    its own (see :meth:`DaemonClient.follow_job`). :meth:`current` says whether the view is
    fresh: the poll answered within its wait (plus a margin) and its connection is up."""

    def __init__(self, namespace: str, path: str | None, epoch: Callable[[], int],
                 wait: float, on_change: Callable[[], None] | None = None) -> None:
        self.namespace, self.path, self.epoch, self.wait = namespace, path, epoch, wait
        self.on_change = on_change
        self._info: dict[str, Any] | None = None
        self._at: float | None = None  # monotonic time of the last answer; None: broken
        self._stop = threading.Event()
        self._client: DaemonClient | None = None
        self._thread = threading.Thread(target=self._run, name="job-view", daemon=True)
        self._thread.start()

    def current(self) -> tuple[bool, dict[str, Any] | None]:
        at = self._at
        fresh = at is not None and time.monotonic() - at < self.wait + 2.0
        return fresh, self._info

    def close(self) -> None:
        self._stop.set()
        client = self._client
        if client is not None:
            client._sock.close()  # ends a long poll in flight; the thread then leaves

    def _run(self) -> None:
        token: str | None = None
        seen: str | None = None  # the last answer's token, across reconnections
        while not self._stop.is_set():
            try:
                if self._client is None:
                    self._client = DaemonClient(self.namespace, epoch=self.epoch(),
                                                path=self.path, timeout=10.0)
                    token = None
                info, token = self._client.job_changed(token, self.wait)
                self._info, self._at = info, time.monotonic()
                if token != seen and seen is not None and self.on_change is not None:
                    self.on_change()
                seen = token
            except (DaemonError, OSError, ValueError):
                self._at = None
                client, self._client = self._client, None
                if client is not None:
                    client._file.close()
                    client._sock.close()
                self._stop.wait(0.2)
        if self._client is not None:
            self._client._file.close()
            self._client._sock.close()
