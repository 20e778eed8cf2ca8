"""``DaemonStore``: a ``torch.distributed.Store`` backed by the node daemon's key-value service.

Process groups bootstrap through etcd, reached over the daemon's local socket
(``daemon/localsock.py``): no TCPStore on one rank, nothing but etcd as a point of failure. One
store serves one namespace, ``<job>/<group>/v<version>``; the daemon keeps its keys under
``<prefix>/kv/<namespace>/`` and refuses a hello whose epoch it has fenced out, so a process of
an old epoch cannot join a group version.

torch 2.13 accepts a Python subclass of ``Store`` wherever it takes a store (a pybind trampoline
forwards the C++ virtual calls), so ``ProcessGroupGloo(PrefixStore(p, DaemonStore(...)), rank,
size, timeout)`` bootstraps through the daemon; gloo calls ``set``, ``wait`` and ``get``. A Python
exception raised here reaches the caller of the group's constructor unchanged.

Timeouts follow torch's ``Store`` semantics: ``get`` and ``wait`` without a timeout use the
store's own (``set_timeout``); zero means no deadline. Waits run in short slices, so a build
being abandoned (``cancel``) stops waiting within one slice instead of at the timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from understudy.common.daemon_client import DaemonClient, DaemonError
from understudy.groups.errors import GroupStoreError, StoreCancelled, StoreTimeout

#: Longest single wait sent to the daemon; bounds how late a cancellation is noticed.
WAIT_SLICE = 0.5
#: The daemon's limit on a key's length (``localsock._key_arg``).
_MAX_KEY_CHARS = 1024

_T = TypeVar("_T")


class DaemonStore(dist.Store):
    """A torch store over one daemon connection, scoped to ``namespace``.

    Thread-safe: requests are serialised on one connection and waits on a second one, cut into
    slices so that a cancellation is seen within :data:`WAIT_SLICE`.

    Raises (from the constructor):
        GroupStoreError: the daemon cannot be reached or refused the hello (bad namespace,
            stale epoch); the message is the daemon's sentence.
        ValueError: ``timeout`` or ``request_timeout`` is negative or not finite.
    """

    def __init__(self, namespace: str, epoch: int = 0, *, path: str | None = None,
                 timeout: float = 300.0, request_timeout: float = 10.0,
                 cancel: threading.Event | None = None) -> None:
        super().__init__()
        if not 0 <= timeout < float("inf"):
            raise ValueError(f"store timeout must be a non-negative number of seconds, "
                             f"got {timeout!r}")
        if not 0 < request_timeout < float("inf"):
            raise ValueError(f"request timeout must be a positive number of seconds, "
                             f"got {request_timeout!r}")
        self.namespace = namespace
        self.epoch = epoch
        self._cancel = cancel if cancel is not None else threading.Event()
        # Two connections: blocking waits go on their own, so that a set from another thread
        # (the one that would end the wait) is never queued behind it.
        self._lock, self._wait_lock = threading.Lock(), threading.Lock()
        self._closed = False
        clients: list[DaemonClient] = []
        try:
            while len(clients) < 2:
                clients.append(DaemonClient(namespace, epoch, path, request_timeout))
        except DaemonError as exc:
            for c in clients:
                c.close()
            raise GroupStoreError(f"cannot open the bootstrap store {namespace!r} "
                                  f"(epoch {epoch}): {exc}") from exc
        self._client, self._waiter = clients
        self.set_timeout(timedelta(seconds=timeout))

    def __repr__(self) -> str:
        return f"DaemonStore({self.namespace!r}, epoch={self.epoch})"

    def close(self) -> None:
        """Close the connection; later requests raise ``GroupStoreError``. Idempotent."""
        with self._lock, self._wait_lock:
            if not self._closed:
                self._closed = True
                self._client.close()
                self._waiter.close()

    def _call(self, what: str, fn: Callable[[], _T]) -> _T:
        with self._lock:
            if self._closed:
                raise GroupStoreError(f"the bootstrap store {self.namespace!r} is closed")
            try:
                return fn()
            except DaemonError as exc:
                raise GroupStoreError(f"{what} in {self.namespace!r} failed: {exc}") from exc

    # -- the torch.distributed.Store interface ------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        _check_key(key)
        data = _as_bytes(value)
        self._call(f"set {key!r}", lambda: self._client.set(key, data))

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting up to the store's timeout for it to be set.

        Raises:
            StoreTimeout: it was not set in time. StoreCancelled: the wait was cancelled.
            GroupStoreError: the daemon failed.
        """
        _check_key(key)
        return self._wait_value(key, self._deadline(None))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Return once every key is set (torch passes ``timeout`` or uses the store's).

        Raises: as :meth:`get`.
        """
        for key in keys:
            _check_key(key)
        deadline = self._deadline(timeout)
        for key in keys:
            if not self._present(key):
                self._wait_value(key, deadline)

    def add(self, key: str, value: int) -> int:
        _check_key(key)
        return self._call(f"add to {key!r}", lambda: self._client.add(key, value))

    def compare_set(self, key: str, expected_value: str | bytes,
                    desired_value: str | bytes) -> bytes:
        """torch semantics: set ``desired_value`` if the key holds ``expected_value`` (empty:
        is absent); return the value now stored, or ``expected_value`` for an absent key."""
        _check_key(key)
        expected, desired = _as_bytes(expected_value), _as_bytes(desired_value)
        return self._call(f"compare_set {key!r}",
                          lambda: self._client.compare_set(key, expected, desired))

    def check(self, keys: list[str]) -> bool:
        for key in keys:
            _check_key(key)
        if not keys:
            return True
        return self._call("check", lambda: self._client.check(list(keys)))

    def delete_key(self, key: str) -> bool:
        _check_key(key)
        return self._call(f"delete {key!r}", lambda: self._client.delete(key))

    def num_keys(self) -> int:
        return self._call("num_keys", self._client.num_keys)

    # -- waiting ------------------------------------------------------------------------------

    def _deadline(self, timeout: timedelta | None) -> tuple[float | None, float]:
        if timeout is None:
            timeout = self.timeout  # type: ignore[attr-defined]  # C++ property, not in stubs
        seconds = timeout.total_seconds()
        # Zero is torch's kNoTimeout: wait without a deadline (still in cancellable slices).
        return (None if seconds == 0 else time.monotonic() + seconds), seconds

    def _wait_value(self, key: str, deadline_and_seconds: tuple[float | None, float]) -> bytes:
        deadline, seconds = deadline_and_seconds
        while True:
            if self._cancel.is_set():
                raise StoreCancelled(f"the wait for {key!r} in {self.namespace!r} was cancelled")
            remaining = WAIT_SLICE if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                raise StoreTimeout(f"key {key!r} did not appear in the bootstrap store "
                                   f"{self.namespace!r} within {seconds:g}s")
            wait = min(WAIT_SLICE, remaining)
            with self._wait_lock:
                if self._closed:
                    raise GroupStoreError(f"the bootstrap store {self.namespace!r} is closed")
                try:
                    return self._waiter.get(key, timeout=wait)
                except DaemonError:
                    # The daemon answers a missing key with an error; ask whether the key is
                    # there rather than read its sentence. A dead connection raises here.
                    pass
            self._present(key)

    def _present(self, key: str) -> bool:
        return self._call(f"check {key!r}", lambda: self._client.check([key]))


def _check_key(key: str) -> None:
    if not isinstance(key, str) or not key or len(key) > _MAX_KEY_CHARS or "\x00" in key:
        raise ValueError(f"store key {key!r} must be a non-empty string of at most "
                         f"{_MAX_KEY_CHARS} characters without NUL")


def _as_bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
