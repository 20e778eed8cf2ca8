"""The seam of the state transfer: :class:`StateTransport`, and :class:`PairGroupTransport`.

A transport is one end of an ordered, reliable byte channel between the two members of a
transfer pair. Its contract, which ``tests/unit/test_transfer.py`` checks for every
implementation:

* ``send(buf)`` / ``recv(buf)`` start moving a 1-D, contiguous, non-empty ``uint8`` tensor on
  ``transport.device`` and return a :class:`Pending`; the caller leaves ``buf`` alone until
  ``wait()`` has returned. Per direction the k-th send fills the k-th recv (same length).
* ``Pending.wait(should_abort=None)`` returns once the operation completed. It raises
  :class:`TransferError` after at most the transport's timeout without completion; promptly
  (within the transport's poll interval) once ``should_abort()`` returns true, which also
  aborts the transport; and promptly when the peer is gone or has closed its end while the
  operation is incomplete. Waiting twice is harmless; an operation that completed stays so.
* ``abort(reason)`` may be called from any thread, returns promptly, and is idempotent: every
  incomplete and later wait on this end raises ``TransferError`` naming the reason, and the
  peer's waits fail as if this end had died.
* ``close()`` ends this end's use of the channel after its transfers: it tells the peer, waits
  briefly for the peer to do the same, and stops the transport's threads. Idempotent; a
  transport left open is closed at interpreter exit.
* After any ``TransferError`` the transport is spent: it serves no new operation.

:class:`PairGroupTransport` implements it over a 2-rank ``torch.distributed`` group with nothing
but point-to-point ``send``/``recv`` of tensors, so the same code runs on gloo (CPU) and NCCL.
"""

from __future__ import annotations

import atexit
import contextlib
import queue
import re
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

import torch

from understudy.common.errors import UnderstudyError

AbortCheck = Callable[[], bool]


class TransferError(UnderstudyError):
    """The state transfer failed: corruption, a rejected manifest, a dead or silent peer, or an
    abort. The message says which and where; the transport is spent."""

    # Operators read the class's qualified name in error records (a joiner's abort says
    # ``understudy.worker.transfer.TransferError: ...``): it stays the package's.
    __module__ = "understudy.worker.transfer"


class Pending(Protocol):
    def wait(self, should_abort: AbortCheck | None = None) -> None:
        """Block until the operation completed, polling ``should_abort`` meanwhile. Raises
        :class:`TransferError` (see the module docstring for when)."""


class StateTransport(Protocol):
    """One end of a transfer pair's ordered byte channel; the contract is in the module
    docstring."""

    @property
    def device(self) -> torch.device: ...

    def send(self, buf: torch.Tensor) -> Pending: ...

    def recv(self, buf: torch.Tensor) -> Pending: ...

    def abort(self, reason: str) -> None: ...

    def close(self) -> None: ...


class _PairGroup(Protocol):
    """What :class:`PairGroupTransport` needs of a process group (or backend)."""

    def rank(self) -> int: ...

    def size(self) -> int: ...

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int, /) -> Any: ...

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int, /) -> Any: ...


class PairGroupTransport:
    """:class:`StateTransport` over a 2-rank process group: gloo on CPU, NCCL on GPU.

    A backend wait can be neither sliced nor cancelled (gloo's send/recv works have no future,
    ``Work.wait(timeout)`` closes the pair when it expires, ``ProcessGroupGloo.abort()`` wakes
    nobody). So each wait runs on this transport's waiter thread, bounded by ``timeout_s``, while
    the caller's thread waits for it in slices of ``poll_s``, between which it checks
    ``should_abort`` and whether the transport was spent meanwhile.

    Gloo fails an operation promptly when the peer dies only if the peer had not started on it;
    one in mid-transfer is released by its timeout alone. So on gloo a watch thread also holds a
    receive that only the peer's :meth:`close` (or its death) completes: the moment it does, the
    transport is spent and the caller's wait ends, whatever the backend does with the op
    itself. ``abort`` on gloo waits on a receive that is never matched for 1 ms: gloo answers an
    expired wait by closing every pair of the group, which fails the peer's waits too. Other
    backends get ``pg.abort()`` (NCCL aborts the communicator); there a wait blocks the host,
    and so honours ``timeout_s``, only with ``TORCH_NCCL_BLOCKING_WAIT=1``. The data path
    itself is nothing but tensor send/recv. Use it as a context manager, or call :meth:`close`.
    """

    _DATA_TAG, _ABORT_TAG, _CLOSE_TAG = 0, 1, 2

    def __init__(self, pg: _PairGroup, *, timeout_s: float = 30.0, poll_s: float = 0.05,
                 device: torch.device | str = "cpu") -> None:
        if pg.size() != 2:
            raise ValueError(f"a transfer pair has 2 ranks, this group has {pg.size()}")
        if not timeout_s > 0 or not poll_s > 0:
            raise ValueError(f"timeout_s and poll_s must be positive, got {timeout_s!r} and "
                             f"{poll_s!r}")
        self._pg = pg
        self._peer = 1 - pg.rank()
        self._timeout = timedelta(seconds=timeout_s)
        self._poll_s = poll_s
        self._device = torch.device(device)
        self._gloo = _backend_name(pg) == "gloo"
        self._lock = threading.Lock()
        self._spent: str | None = None   # why this transport can no longer be used
        self._peer_left = False          # the peer closed or died (not our own doing)
        self._aborted = self._closing = False
        # One waiter per direction: within a direction operations complete in the order they
        # were issued, so each waits them out in that order, as soon as they are issued.
        self._waiters = {what: _Waiter(what, self._timeout) for what in ("send", "receive")}
        _OPEN.add(self)
        self._watch: threading.Thread | None = None
        if self._gloo:
            self._watch = threading.Thread(target=self._watch_peer, daemon=True,
                                           name="understudy-transfer-peer")
            self._watch_op: Any = pg.recv([torch.empty(1, dtype=torch.uint8)], self._peer,
                                          self._CLOSE_TAG)
            self._watch.start()

    def __enter__(self) -> PairGroupTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def device(self) -> torch.device:
        return self._device

    def send(self, buf: torch.Tensor) -> Pending:
        return self._start(buf, "send")

    def recv(self, buf: torch.Tensor) -> Pending:
        return self._start(buf, "receive")

    def abort(self, reason: str) -> None:
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
            self._spent = self._spent or f"the transfer was aborted: {reason}"
        if self._gloo:
            never = torch.empty(1, dtype=torch.uint8)
            with contextlib.suppress(RuntimeError):  # the expected outcome: pairs closed
                self._pg.recv([never], self._peer, self._ABORT_TAG).wait(
                    timedelta(milliseconds=1))
        else:
            abort = getattr(self._pg, "abort", None)
            if abort is not None:
                abort()

    def close(self) -> None:
        """Tell the peer this end is done, and stop this end's threads. The peer's own close is
        awaited for a second at most (it has nothing left to say after a transfer: every
        operation of both ends was waited for), then the pair is aborted. Idempotent."""
        with self._lock:
            closing, self._closing = self._closing, True
            was_spent, self._spent = self._spent, self._spent or "the transport was closed"
        if closing:
            return
        if self._watch is not None:
            if was_spent is None:
                with contextlib.suppress(RuntimeError):
                    bye = torch.ones(1, dtype=torch.uint8)
                    self._pg.send([bye], self._peer, self._CLOSE_TAG).wait(self._timeout)
            self._watch.join(min(1.0, self._timeout.total_seconds()))
            if self._watch.is_alive():
                self.abort("the peer did not close its end")
                self._watch.join(1.0)
            if not self._watch.is_alive():
                # A gloo work keeps its group's connections alive: one that outlives the
                # interpreter is torn down with the process and aborts it.
                self._watch_op = None
        # A waiter stuck in an operation the backend never fails ends at that operation's
        # timeout; it holds what the operation needs, and _join_at_exit waits for it.
        for waiter in self._waiters.values():
            waiter.stop(1.0)
        if not any(waiter.alive for waiter in self._waiters.values()):
            _OPEN.discard(self)  # else _join_at_exit waits for the stuck one

    def _join(self) -> None:
        """Wait for this end's threads to leave the backend: a daemon thread still inside a
        C++ wait when the interpreter finalises aborts the process."""
        self.close()
        for waiter in self._waiters.values():
            waiter.stop(max(0.0, waiter.busy_until - time.monotonic()) + 1.0)
        _OPEN.discard(self)

    def _watch_peer(self) -> None:
        try:
            self._watch_op.wait(timedelta(days=1))  # ended by the peer's close, death, or abort
            why = f"peer rank {self._peer} closed the transfer pair"
        except RuntimeError as exc:
            if "Application timeout" in str(exc):
                return  # this end closed the pairs (a wait timed out, or abort): not the peer
            why = f"peer rank {self._peer} is gone: {_first_line(str(exc))}"
        with self._lock:
            if not self._closing and self._spent is None:
                self._spent, self._peer_left = why, True

    def _start(self, buf: torch.Tensor, what: str) -> _GroupOp:
        if (buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous()
                or buf.numel() == 0 or buf.device != self._device):
            raise ValueError(f"a transport buffer is a non-empty contiguous 1-D uint8 tensor on "
                             f"{self._device}, got {buf.dtype} {tuple(buf.shape)} on "
                             f"{buf.device}")
        with self._lock:
            if self._spent is not None:
                raise TransferError(self._spent)
        try:
            if what == "send":
                work = self._pg.send([buf], self._peer, self._DATA_TAG)
            else:
                work = self._pg.recv([buf], self._peer, self._DATA_TAG)
        except RuntimeError as exc:
            raise self._failed(what, exc) from exc
        op = _GroupOp(self, work, what, buf)
        self._waiters[what].put(op)
        return op

    def _await(self, op: _GroupOp, should_abort: AbortCheck | None) -> None:
        while not op.event.wait(self._poll_s):
            if should_abort is not None and should_abort():
                self.abort("the caller asked for it")
            with self._lock:
                spent, peer_left = self._spent, self._peer_left
            if spent is not None:
                # What the peer sent before it left has arrived; give the waiter a moment to
                # say so before calling the operation lost.
                if peer_left and op.event.wait(min(1.0, self._timeout.total_seconds())):
                    break
                raise TransferError(spent)
        if op.error is not None:
            raise self._failed(op.what, op.error) from op.error
        if op.completed is False:
            raise TransferError(f"a {op.what} with peer rank {self._peer} was interrupted")

    def _failed(self, what: str, exc: RuntimeError) -> TransferError:
        text = str(exc)
        with self._lock:
            if self._spent is None:
                if "Timed out" in text or "timed out" in text:
                    self._spent = (f"no progress for {self._timeout.total_seconds():g}s on a "
                                   f"{what} with peer rank {self._peer}: the peer is frozen or "
                                   f"gone")
                else:
                    self._spent = (f"a {what} with peer rank {self._peer} failed: "
                                   f"{_first_line(text)}")
            return TransferError(self._spent)  # the first failure is the cause


class _Waiter:
    """A named thread that waits out one direction's operations in order, each bounded by the
    transport's timeout, and flags each one's outcome for the caller's sliced wait."""

    def __init__(self, what: str, timeout: timedelta) -> None:
        self._timeout = timeout
        self._queue: queue.SimpleQueue[_GroupOp | None] = queue.SimpleQueue()
        self.busy_until = 0.0  # monotonic deadline of the operation being waited for
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"understudy-transfer-{what}")
        self._thread.start()

    def put(self, op: _GroupOp) -> None:
        self._queue.put(op)

    def stop(self, join_s: float) -> None:
        self._queue.put(None)
        self._thread.join(join_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _loop(self) -> None:
        while (op := self._queue.get()) is not None:
            self.busy_until = time.monotonic() + self._timeout.total_seconds()
            try:
                op.completed = op.work.wait(self._timeout)
            except RuntimeError as exc:
                op.error = exc
            op.event.set()
            del op  # the buffer goes as soon as the caller lets it go


#: Transports not closed yet. Held strongly: their threads outlive the caller's reference, and
#: a thread still inside a backend wait when the interpreter finalises aborts the process
#: ("terminate called without an active exception"), so every one is closed at exit.
_OPEN: set[PairGroupTransport] = set()


@atexit.register
def _join_at_exit() -> None:
    for transport in list(_OPEN):
        transport._join()


class _GroupOp:
    def __init__(self, owner: PairGroupTransport, work: Any, what: str,
                 buf: torch.Tensor) -> None:
        self.owner = owner
        self.work = work
        self.what = what
        self.buf = buf  # kept alive until the backend is done with it
        self.event = threading.Event()
        self.completed: bool | None = None
        self.error: RuntimeError | None = None

    def wait(self, should_abort: AbortCheck | None = None) -> None:
        self.owner._await(self, should_abort)


def _backend_name(pg: Any) -> str:
    try:
        return str(pg.name()).lower()
    except (AttributeError, RuntimeError):
        return ""


def _first_line(text: str) -> str:
    """A backend message, cut to its first sentence, without gloo's ``[file.cc:123]`` prefix."""
    line = text.strip().splitlines()[0] if text.strip() else text
    line = re.sub(r"^\[[^\]]*\]\s*", "", line)
    return line.split(". ")[0].rstrip(".")
