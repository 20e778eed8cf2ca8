"""Moving a rank's training state from the leaver to the joiner (phase 2 of a migration).

The state is a tree of dicts, lists and tuples whose leaves are dense tensors (parameters,
optimizer state, RNG states...) or plain picklable values (step, schedule, data position,
``random.getstate()``...). :func:`send_state` streams it over a :class:`StateTransport`;
:func:`receive_state` / :func:`receive_into` rebuild it on the other end, bit for bit.

Use (both ends hold a 2-rank group, the *transfer pair*; the caller owns the transport)::

    with PairGroupTransport(pair_pg, timeout_s=30) as t:          # the leaver
        stats = send_state(t, {"model": model.state_dict(), "optim": opt.state_dict(),
                               "rng": torch.get_rng_state(), "step": step},
                           should_abort=cancelled.is_set)
    log.info("state sent", transfer=str(stats))                   # MB/s, chunks, peak staging

    with PairGroupTransport(pair_pg, timeout_s=30) as t:          # the joiner
        state, stats = receive_into(t, {"model": model.state_dict(),
                                        "optim": opt.state_dict()})
    opt.load_state_dict(state["optim"])  # parameters and optimizer tensors already hold it

The seam: :class:`StateTransport`
---------------------------------
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

The wire protocol (version 1)
-----------------------------
1. leaver -> joiner: a 32-byte header (magic, version, manifest length, crc32 of the manifest).
2. leaver -> joiner: the manifest, a pickle of ``{version, chunk_bytes, checksum, entries,
   staged, skeleton}``: one entry ``(path, dtype, shape, device type)`` per tensor, in state
   order; the chunks the leaver packs into its staging buffer; the *skeleton*, the state
   pickled with every tensor replaced by a reference to its entry. Plain Python values travel
   inside the skeleton; the manifest is capped by ``max_manifest_bytes`` on both ends.
3. joiner -> leaver: a 128-byte reply: the manifest is accepted, or why not.
4. leaver -> joiner: the chunks, then a table of their digests (8 bytes each). Both ends
   derive the same chunk plan from the manifest (:func:`_plan`): a tensor of at least
   ``chunk_bytes // 8`` bytes is cut into chunks of its own, of ``chunk_bytes`` but for its
   last; smaller ones are packed in order, each at a multiple of :data:`ALIGN` (zero gaps),
   into shared chunks of at most ``chunk_bytes``. The joiner keeps up to 16 chunks posted
   ahead, so the bytes never wait for a receive, and digests each chunk as it lands. When the
   leaver is about to reuse its staging buffer, the joiner first acknowledges (16 bytes) that
   the leaver's previous staged chunk landed: the leaver never waits for a send.
5. joiner -> leaver: a final reply: every chunk verified, or which did not. A corrupted chunk
   does not stop the stream: the joiner drains it to the end, so that both ends' operations
   stay matched, then reports.

Every operation is issued by both ends in one global order, so a backend that serialises a
pair's operations on one stream (NCCL) cannot deadlock. :func:`send_state` returns only after
the final reply: success means the joiner holds an exact copy. Any failure (corruption, a
rejected manifest, peer death, timeout, abort) raises :class:`TransferError` on both ends;
an end that fails without having told its peer aborts the transport, so that the peer fails at
once instead of after its timeout. The joiner's destination tensors are then partly written
and must not be used.

Memory: neither end copies the state. A chunk that lies inside one contiguous tensor goes
straight from the leaver's tensor into the joiner's (no staging at all); a chunk that packs
several small tensors, or covers part of a non-contiguous one, goes through one staging buffer
of at most ``chunk_bytes`` on each end. ``TransferStats.peak_staging_bytes`` reports what was
used. The joiner writes into preallocated destinations: with :func:`receive_into`, into the
joiner's own tensors wherever path, dtype and shape match.

Checksums: each chunk's digest is a 64-bit blake2b over its length, the wrapping int64 sums
of its 4 KiB rows, and its last partial row. The row sums are one torch reduction where the
bytes are (on the GPU for NCCL only 1/512 of the bytes reach the host), computed by the leaver
while the chunk is in flight and by the joiner while the next chunks land. Any change to a
single 8-byte word (every bit flip), truncation and shifted or misplaced data are always
detected; random damage (garbage, stale or zeroed bytes) escapes with odds of about 2**-64 per
row; what escapes for sure (compensating changes within one row, words swapped within a row)
is not what wires and memories do. Chosen by measurement on the 2-core development machine
(84 MiB state, 8 MiB chunks, joiner writing into existing tensors, 15 interleaved runs,
medians): raw send/recv 1.9 GB/s; no checksum 1.56 GB/s; these digests 1.56 GB/s; crc32
(``zlib``, the first candidate) 0.99 GB/s. On two cores every pass over the bytes competes
with the copies themselves, crc32 is several times slower per byte than a sum, and it needs
every byte on the host. Per-entry checksums in the manifest were rejected: they need a full
pass over the state before the first byte moves. The manifest is protected by crc32.

Trust: the manifest is unpickled by :func:`understudy.worker.safe_unpickle.load`, which imports
nothing outside an allow-list, so a peer cannot run code in the joiner through it. A state's
plain values may be ``dict``, ``list``, ``tuple``, ``set``, ``frozenset``, ``str``, ``bytes``,
``bytearray``, ``int``, ``float``, ``bool``, ``None``, ``complex``, ``collections.OrderedDict``,
``torch.Size``, ``torch.device`` and torch dtypes, and its tensors are dense tensors in dicts,
lists and tuples (what ``torch.load(weights_only=True)`` takes). A joiner refuses a manifest
that holds anything else, in a sentence naming it, before anything is written to its tensors,
and the leaver's :func:`send_state` fails with that sentence. Checksums guard against
corruption; the peer itself is not authenticated (``docs/security.md``): a peer that can speak
in the transfer can still send wrong tensor values.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import ctypes
import hashlib
import io
import itertools
import math
import pickle
import queue
import re
import struct
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NoReturn, Protocol

import torch

from understudy.common.errors import UnderstudyError
from understudy.worker import safe_unpickle

#: Bytes per chunk unless the caller says otherwise; 8 MiB measured best on gloo here.
DEFAULT_CHUNK_BYTES = 8 * 1024 * 1024
#: Cap on the manifest (entries plus plain Python values), enforced on both ends.
DEFAULT_MAX_MANIFEST_BYTES = 16 * 1024 * 1024
#: Every entry starts at a multiple of this in the stream; also the largest element size.
ALIGN = 16
VERSION = 1
CHECKSUM = "rowsum64-blake2b"
_ROW_WORDS = 512  # 4 KiB rows for the chunk digest
#: Chunks the joiner keeps posted ahead; costs no memory for chunks that move straight between
#: tensors.
_LOOKAHEAD = 16

_HEADER = struct.Struct("<8sIIQI4x")   # magic, version, flags, manifest length, manifest crc
_HEADER_MAGIC = b"USTXFER\x00"
_DIGESTS = struct.Struct("<4sI")       # magic, count; then one u64 digest per chunk
_ACK = struct.Struct("<4sQ4x")         # magic, chunk index
_ACK_MAGIC = b"USTG"
_DIGESTS_MAGIC = b"UDGT"
_REPLY = struct.Struct("<4sI120s")     # magic, status, reason
_REPLY_MAGIC = b"UACK"
_OK, _REJECTED, _CORRUPT = 0, 1, 2

AbortCheck = Callable[[], bool]
ChunkHook = Callable[[int, torch.Tensor], None]
Path = tuple[Hashable, ...]


class TransferError(UnderstudyError):
    """The state transfer failed: corruption, a rejected manifest, a dead or silent peer, or an
    abort. The message says which and where; the transport is spent."""


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


@dataclass
class TransferStats:
    """What one end of a transfer did; ``str()`` is one line for the log."""

    direction: str                 # "send" or "receive"
    payload_bytes: int = 0         # tensor bytes
    wire_bytes: int = 0            # everything through the transport, both ways
    manifest_bytes: int = 0
    seconds: float = 0.0
    chunks: int = 0
    chunk_bytes: int = 0
    direct_chunks: int = 0         # chunks that needed no staging on this end
    peak_staging_bytes: int = 0
    entries: int = 0
    reused_entries: int = 0        # receive_into: entries written into the target's tensors
    checksum: str = CHECKSUM

    @property
    def mb_per_s(self) -> float:
        """Payload rate in MB/s (10**6 bytes)."""
        return self.payload_bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0

    def __str__(self) -> str:
        return (f"{self.direction} {self.payload_bytes} B of tensors in {self.entries} entries "
                f"in {self.seconds * 1e3:.1f} ms ({self.mb_per_s:.0f} MB/s), {self.chunks} "
                f"chunks of {self.chunk_bytes} B ({self.direct_chunks} direct), peak staging "
                f"{self.peak_staging_bytes} B, manifest {self.manifest_bytes} B")


def send_state(transport: StateTransport, state: Any, *,
               chunk_bytes: int = DEFAULT_CHUNK_BYTES,
               max_manifest_bytes: int = DEFAULT_MAX_MANIFEST_BYTES,
               should_abort: AbortCheck | None = None) -> TransferStats:
    """Stream ``state`` to the peer; return once the peer has verified every byte.

    ``should_abort`` (the daemon's word that the migration is off, or the peer gone) is
    polled once per chunk and between the slices of every wait; when it returns true the
    transfer is aborted on both ends.

    Raises:
        ValueError: ``chunk_bytes`` is not a positive multiple of :data:`ALIGN`, a leaf tensor
            is not a dense tensor with data, a tensor hides inside a non-container object, a
            plain value does not pickle, or the manifest exceeds ``max_manifest_bytes``.
            Nothing was sent.
        TransferError: the peer rejected the manifest (a plain value of a type outside the
            allow-list: see "Trust" in the module docstring) or a chunk, the peer died or went
            silent, or the transfer was aborted.
    """
    start = time.perf_counter()
    if chunk_bytes <= 0 or chunk_bytes % ALIGN:
        raise ValueError(f"chunk_bytes must be a positive multiple of {ALIGN}, "
                         f"got {chunk_bytes!r}")
    tensors: list[tuple[Path, torch.Tensor]] = []
    skeleton = _flatten(state, (), tensors)
    entries = [_Entry(p, _dtype_name(t.dtype), tuple(t.shape), t.device.type)
               for p, t in tensors]
    stats = TransferStats("send", chunk_bytes=chunk_bytes, entries=len(entries))
    sender = _Sender(transport, tensors, entries, chunk_bytes, stats, should_abort)
    manifest = _dump_manifest(skeleton, entries, chunk_bytes, sender.staged)
    if len(manifest) > max_manifest_bytes:
        raise ValueError(f"the manifest takes {len(manifest)} bytes, more than "
                         f"max_manifest_bytes={max_manifest_bytes}: move large plain values "
                         f"into tensors")
    stats.manifest_bytes = len(manifest)
    _run(sender, lambda: sender.run(manifest))
    stats.seconds = time.perf_counter() - start
    return stats


def receive_state(transport: StateTransport, *,
                  max_manifest_bytes: int = DEFAULT_MAX_MANIFEST_BYTES,
                  device: torch.device | str | None = None,
                  should_abort: AbortCheck | None = None,
                  on_chunk: ChunkHook | None = None) -> tuple[Any, TransferStats]:
    """Receive a state sent by :func:`send_state` into fresh tensors; see :func:`receive_into`."""
    return receive_into(transport, None, max_manifest_bytes=max_manifest_bytes, device=device,
                        should_abort=should_abort, on_chunk=on_chunk)


def receive_into(transport: StateTransport, target: Any, *,
                 max_manifest_bytes: int = DEFAULT_MAX_MANIFEST_BYTES,
                 device: torch.device | str | None = None,
                 should_abort: AbortCheck | None = None,
                 on_chunk: ChunkHook | None = None) -> tuple[Any, TransferStats]:
    """Receive a state sent by :func:`send_state`, writing in place into ``target``'s tensors.

    ``target`` is a tree like the sender's (for instance ``{"model": model.state_dict(),
    "optim": optimizer.state_dict()}``): a tensor found at the same path with the same dtype and
    shape is overwritten in place (so the joiner's parameters and optimizer state are updated
    without a copy) and appears in the result as that very object; other entries get fresh
    contiguous tensors on ``device`` (default: the transport's), CPU entries stay on the CPU.
    The result is the sender's tree; strides, ``requires_grad`` and aliasing between tensors are
    not preserved.

    ``should_abort``: as for :func:`send_state`. ``on_chunk(index, landed)``
    sees each chunk's bytes as they landed, before they are digested: a hook for instruments
    and fault injection (writing to ``landed`` is corruption on the wire); production passes
    None.

    Raises:
        TransferError: the manifest is malformed, foreign, over ``max_manifest_bytes`` or
            holds a type outside the allow-list (nothing was written to ``target`` then), a
            chunk fails its checksum, the peer died or went silent, or the transfer was
            aborted. ``target``'s tensors are then partly written.
    """
    start = time.perf_counter()
    stats = TransferStats("receive")
    dev = torch.device(device) if device is not None else transport.device
    receiver = _Receiver(transport, stats, dev, on_chunk, should_abort)
    state = _run(receiver, lambda: receiver.run(target, max_manifest_bytes))
    stats.seconds = time.perf_counter() - start
    return state, stats


def _run(end: _End, body: Callable[[], Any]) -> Any:
    try:
        with torch.no_grad():
            return body()
    except BaseException as exc:
        if not end.peer_informed:  # make the peer fail now, not after its timeout
            end.transport.abort(str(exc) if isinstance(exc, TransferError)
                                else f"{type(exc).__name__}: {exc}")
        raise


# --- the state tree -----------------------------------------------------------------------


@dataclass(frozen=True)
class _Entry:
    path: Path
    dtype: str
    shape: tuple[int, ...]
    device_type: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _dtype(self.dtype).itemsize

    @property
    def name(self) -> str:
        return "/".join(str(k) for k in self.path) or "<root>"


class _Ref:
    """Stands for entry ``index`` in the skeleton."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def _flatten(obj: Any, path: Path, out: list[tuple[Path, torch.Tensor]]) -> Any:
    """The skeleton of ``obj``: tensors reachable through dicts, lists and tuples are appended
    to ``out`` and replaced by :class:`_Ref`; everything else is kept as is."""
    if isinstance(obj, torch.Tensor):
        _check_tensor(obj, path)
        out.append((path, obj))
        return _Ref(len(out) - 1)
    if isinstance(obj, dict):
        skel = copy.copy(obj)  # keeps the mapping's type and attributes (state_dict _metadata)
        for key, value in obj.items():
            skel[key] = _flatten(value, (*path, key), out)
        return skel
    if isinstance(obj, list):
        return [_flatten(v, (*path, i), out) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        items = [_flatten(v, (*path, i), out) for i, v in enumerate(obj)]
        if all(a is b for a, b in zip(items, obj, strict=True)):
            return obj
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def _tensors_by_path(obj: Any) -> dict[Path, torch.Tensor]:
    found: list[tuple[Path, torch.Tensor]] = []

    def walk(o: Any, path: Path) -> None:
        if isinstance(o, torch.Tensor):
            found.append((path, o))
        elif isinstance(o, dict):
            for k, v in o.items():
                walk(v, (*path, k))
        elif isinstance(o, list | tuple):
            for i, v in enumerate(o):
                walk(v, (*path, i))

    walk(obj, ())
    return dict(found)


def _check_tensor(t: torch.Tensor, path: Path) -> None:
    where = "/".join(str(k) for k in path) or "<root>"
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise ValueError(f"state entry {where} is a {type(t).__name__}; only plain dense "
                         f"tensors travel (convert it to its local tensor first)")
    if t.layout != torch.strided or t.device.type == "meta":
        raise ValueError(f"state entry {where} is a {t.layout} tensor on {t.device}; only "
                         f"dense tensors with data travel")


class _SkeletonPickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> int | None:
        if isinstance(obj, _Ref):
            return obj.index
        if isinstance(obj, torch.Tensor):
            raise ValueError("a tensor inside a non-container object would travel unchunked in "
                             "the manifest; put it directly in a dict, list or tuple")
        return None


def _dump_manifest(skeleton: Any, entries: list[_Entry], chunk_bytes: int,
                   staged: list[int]) -> bytes:
    buf = io.BytesIO()
    try:
        _SkeletonPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(skeleton)
        manifest = pickle.dumps({
            "version": VERSION, "chunk_bytes": chunk_bytes, "align": ALIGN, "checksum": CHECKSUM,
            "entries": [(e.path, e.dtype, e.shape, e.device_type) for e in entries],
            "staged": staged,
            "skeleton": buf.getvalue()}, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise ValueError(f"the state's plain values do not pickle: {exc}") from exc
    return manifest


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


#: every dtype by its name without ``torch.``; a peer's name is looked up here, never with getattr
_DTYPES = {name: v for name, v in vars(torch).items() if isinstance(v, torch.dtype)}


def _dtype(name: str) -> torch.dtype:
    dtype = _DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


# --- the stream ---------------------------------------------------------------------------


@dataclass
class _Chunk:
    index: int
    nbytes: int
    # (entry index, first byte, end byte) of a piece of an entry, and its offset in the chunk
    segments: list[tuple[int, int, int, int]] = field(default_factory=list)


def _plan(entries: list[_Entry], chunk_bytes: int) -> list[_Chunk]:
    """Cut the tensors' bytes into chunks of at most ``chunk_bytes``, the same way on both ends.

    An entry of at least ``chunk_bytes // 8`` gets chunks of its own (full ones but its last),
    so that each can move straight from the leaver's tensor into the joiner's; smaller entries
    are packed in order, each at a multiple of :data:`ALIGN`, into shared chunks. Pieces start
    at multiples of ``chunk_bytes`` (itself a multiple of ``ALIGN``): no element is ever split.
    """
    large = max(ALIGN, chunk_bytes // 8)
    chunks: list[_Chunk] = []
    packing: _Chunk | None = None
    for k, e in enumerate(entries):
        n = e.nbytes
        if n >= large:
            for lo in range(0, n, chunk_bytes):
                hi = min(n, lo + chunk_bytes)
                chunks.append(_Chunk(len(chunks), hi - lo, [(k, lo, hi, 0)]))
        elif n > 0:
            at = 0 if packing is None else -(-packing.nbytes // ALIGN) * ALIGN
            if packing is None or at + n > chunk_bytes:
                packing, at = _Chunk(len(chunks), 0), 0
                chunks.append(packing)
            packing.segments.append((k, 0, n, at))
            packing.nbytes = at + n
    return chunks


def _plain(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes can be addressed directly as a flat uint8 view."""
    return t.is_contiguous() and not t.is_conj() and not t.is_neg()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a :func:`_plain` tensor as a flat uint8 view. Not ``reshape(-1)``: a
    contiguous tensor may carry any stride on a dimension of size 1."""
    return t.detach().as_strided((t.numel(),), (1,)).view(torch.uint8)


def _copy_elements(t: torch.Tensor, a: int, b: int, flat: torch.Tensor, to_flat: bool) -> None:
    """Copy elements ``a:b`` of ``t`` in row-major order to (or from) the 1-D ``flat``, without
    materialising more of ``t`` than those elements (``t`` may be non-contiguous)."""
    if a == b:
        return
    if t.dim() <= 1 or t.is_contiguous():
        view = t.reshape(-1)[a:b] if t.is_contiguous() else t[a:b]
        (flat.copy_(view) if to_flat else view.copy_(flat))
        return
    inner = math.prod(t.shape[1:])
    pos = 0
    while a < b:
        row, off = divmod(a, inner)
        if off == 0 and b - a >= inner:
            rows = (b - a) // inner
            block = t[row:row + rows]
            part = flat[pos:pos + rows * inner].view(block.shape)
            (part.copy_(block) if to_flat else block.copy_(part))
            step = rows * inner
        else:
            step = min(b - a, inner - off)
            _copy_elements(t[row], off, off + step, flat[pos:pos + step], to_flat)
        a += step
        pos += step


def _digest(buf: torch.Tensor) -> int:
    """The 64-bit digest of a chunk (see "Checksums" in the module docstring). ``buf`` starts at
    a multiple of 8 bytes in its storage (:meth:`_End.direct` and the staging see to it)."""
    n = buf.numel()
    body = n - n % (8 * _ROW_WORDS)
    h = hashlib.blake2b(n.to_bytes(8, "little"), digest_size=8)
    if body:
        # int64 addition wraps on every backend, so both ends agree bit for bit.
        rows = buf[:body].view(torch.int64).view(-1, _ROW_WORDS).sum(1)
        h.update(_to_bytes(rows.view(torch.uint8)))
    if body < n:
        h.update(_to_bytes(buf[body:]))
    return int.from_bytes(h.digest(), "little")


def _to_tensor(data: bytes, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def _to_bytes(buf: torch.Tensor) -> bytes:
    host = buf.cpu()
    return ctypes.string_at(host.data_ptr(), host.numel())


def _reply(status: int, reason: str, device: torch.device) -> torch.Tensor:
    text = reason.encode("utf-8", "replace")[:_REPLY.size - 8]
    return _to_tensor(_REPLY.pack(_REPLY_MAGIC, status, text), device)


def _parse_reply(buf: torch.Tensor) -> tuple[int, str]:
    magic, status, text = _REPLY.unpack(_to_bytes(buf))
    if magic != _REPLY_MAGIC:
        raise TransferError("the joiner's reply is garbage: the two ends disagree on the "
                            "protocol")
    return status, text.rstrip(b"\0").decode("utf-8", "replace")


class _Staging:
    """The one scratch buffer of an end, allocated on first use with the size of the largest
    chunk of this transfer (at most ``chunk_bytes``)."""

    def __init__(self, device: torch.device, stats: TransferStats) -> None:
        self._device = device
        self._stats = stats
        self._buf: torch.Tensor | None = None
        self.capacity = 0

    def get(self, nbytes: int) -> torch.Tensor:
        assert nbytes <= self.capacity, "a chunk is never larger than the staging capacity"
        if self._buf is None:
            self._buf = torch.empty(self.capacity, dtype=torch.uint8, device=self._device)
            self._stats.peak_staging_bytes = max(self._stats.peak_staging_bytes, self.capacity)
        return self._buf[:nbytes]


class _End:
    """What both ends share: this end's tensors and how a chunk maps onto them."""

    def __init__(self, transport: StateTransport, stats: TransferStats,
                 should_abort: AbortCheck | None) -> None:
        self.transport = transport
        self.stats = stats
        self.should_abort = should_abort
        self.device = transport.device
        self.staging = _Staging(self.device, stats)
        self.tensors: list[torch.Tensor] = []
        self.entries: list[_Entry] = []
        self.peer_informed = False  # the peer was told why this end fails

    def plan(self, chunk_bytes: int) -> tuple[list[_Chunk], list[torch.Tensor | None]]:
        """The chunks, and for each the view it moves through on this end (None: staging)."""
        chunks = _plan(self.entries, chunk_bytes)
        views = [self.direct(c) for c in chunks]
        self.stats.chunks = len(chunks)
        self.stats.direct_chunks = sum(v is not None for v in views)
        self.stats.payload_bytes = sum(e.nbytes for e in self.entries)
        self.staging.capacity = max((c.nbytes for c, v in zip(chunks, views, strict=True)
                                     if v is None), default=0)
        return chunks, views

    def direct(self, chunk: _Chunk) -> torch.Tensor | None:
        """The chunk's bytes as a view of one tensor of this end, if it lies inside one."""
        if len(chunk.segments) != 1:
            return None
        k, lo, hi, _ = chunk.segments[0]
        t = self.tensors[k]
        if hi - lo != chunk.nbytes or t.device != self.device or not _plain(t):
            return None
        view = _bytes(t)[lo:hi]
        # A view of a tensor at an odd place in its storage goes through the (aligned) staging.
        return view if view.storage_offset() % 8 == 0 else None

    def copy(self, chunk: _Chunk, stage: torch.Tensor, pack: bool) -> None:
        """Pack the chunk's segments into ``stage`` (zeroing the gaps), or unpack them."""
        pos = 0
        for k, lo, hi, at in chunk.segments:
            if pack and at > pos:
                stage[pos:at].zero_()
            t = self.tensors[k]
            part = stage[at:at + hi - lo]
            if _plain(t):
                src = _bytes(t)[lo:hi]
                (part.copy_(src) if pack else src.copy_(part))
            else:
                size = t.element_size()
                _copy_elements(t, lo // size, hi // size, part.view(t.dtype), pack)
            pos = at + hi - lo
        if pack and pos < chunk.nbytes:
            stage[pos:chunk.nbytes].zero_()

    def send(self, buf: torch.Tensor) -> Pending:
        self.stats.wire_bytes += buf.numel()
        return self.transport.send(buf)

    def recv(self, buf: torch.Tensor) -> Pending:
        self.stats.wire_bytes += buf.numel()
        return self.transport.recv(buf)

    def wait(self, op: Pending) -> None:
        op.wait(self.should_abort)

    def check_abort(self) -> None:
        """Between chunks: the caller may call the transfer off while no wait is blocked."""
        if self.should_abort is not None and self.should_abort():
            self.transport.abort("the caller asked for it")
            raise TransferError("the transfer was aborted: the caller asked for it")

    def describe(self, chunk: _Chunk) -> str:
        names = [self.entries[k].name for k, *_ in chunk.segments]
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        return f"chunk {chunk.index} ({chunk.nbytes} bytes of {shown})"


class _Sender(_End):
    def __init__(self, transport: StateTransport, tensors: list[tuple[Path, torch.Tensor]],
                 entries: list[_Entry], chunk_bytes: int, stats: TransferStats,
                 should_abort: AbortCheck | None) -> None:
        super().__init__(transport, stats, should_abort)
        self.tensors = [t.detach() for _, t in tensors]
        self.entries = entries
        self.chunks, self.views = self.plan(chunk_bytes)

    @property
    def staged(self) -> list[int]:
        """The chunks this end packs into its staging buffer (the joiner learns them from the
        manifest, to acknowledge them when the staging is needed again)."""
        return [c.index for c, v in zip(self.chunks, self.views, strict=True) if v is None]

    def run(self, manifest: bytes) -> None:
        # This end never blocks on a send: gloo does not fail a send that the peer had matched
        # but not yet read when the peer dies, so such a wait would last the whole timeout.
        # What this end must know about its sends it learns from the joiner's replies instead,
        # and a receive fails at once when the peer is gone.
        header = _HEADER.pack(_HEADER_MAGIC, VERSION, 0, len(manifest), zlib.crc32(manifest))
        head, body = _to_tensor(header, self.device), _to_tensor(manifest, self.device)
        # every send, and the buffer it reads: kept alive until the send is known complete
        sends: list[tuple[Pending, torch.Tensor]] = [(self.send(head), head),
                                                     (self.send(body), body)]
        reply = torch.empty(_REPLY.size, dtype=torch.uint8, device=self.device)
        self.wait(self.recv(reply))
        status, reason = _parse_reply(reply)
        if status != _OK:
            raise TransferError(f"the joiner rejected the manifest: {reason}")
        digests: list[int] = []
        staged_last: int | None = None  # the chunk the staging buffer holds
        for chunk, view in zip(self.chunks, self.views, strict=True):
            self.check_abort()
            if view is None:
                if staged_last is not None:
                    self._await_ack(staged_last)  # the staging is free once that chunk landed
                buf = self.staging.get(chunk.nbytes)
                self.copy(chunk, buf, pack=True)
                staged_last = chunk.index
            else:
                buf = view
            sends.append((self.send(buf), buf))
            digests.append(_digest(buf))  # while the bytes are in flight
        if self.chunks:
            table = _to_tensor(_pack_digests(digests), self.device)
            sends.append((self.send(table), table))
            self.wait(self.recv(reply))
            status, reason = _parse_reply(reply)
            if status != _OK:
                self.peer_informed = True
                raise TransferError(f"the joiner rejected the state: {reason}")
        for op, _ in sends:  # all complete: the joiner has received everything
            self.wait(op)

    def _await_ack(self, index: int) -> None:
        ack = torch.empty(_ACK.size, dtype=torch.uint8, device=self.device)
        self.wait(self.recv(ack))
        magic, got = _ACK.unpack(_to_bytes(ack))
        if magic != _ACK_MAGIC or got != index:
            raise TransferError(f"the joiner acknowledged chunk {got} (magic {magic!r}) where "
                                f"chunk {index} was due: the two ends disagree on the plan")


def _pack_digests(digests: list[int]) -> bytes:
    return _DIGESTS.pack(_DIGESTS_MAGIC, len(digests)) + struct.pack(f"<{len(digests)}Q",
                                                                       *digests)


def _unpack_digests(buf: torch.Tensor, count: int) -> list[int]:
    data = _to_bytes(buf)
    magic, n = _DIGESTS.unpack_from(data)
    if magic != _DIGESTS_MAGIC or n != count:
        raise TransferError(f"the leaver's digest table is garbage (magic {magic!r}, {n} "
                            f"digests for {count} chunks)")
    return list(struct.unpack_from(f"<{n}Q", data, _DIGESTS.size))


class _Receiver(_End):
    def __init__(self, transport: StateTransport, stats: TransferStats, device: torch.device,
                 on_chunk: ChunkHook | None, should_abort: AbortCheck | None) -> None:
        super().__init__(transport, stats, should_abort)
        self.alloc_device = device
        self.on_chunk = on_chunk
        self.leaver_staged: list[int] = []

    def run(self, target: Any, max_manifest_bytes: int) -> Any:
        header = torch.empty(_HEADER.size, dtype=torch.uint8, device=self.device)
        self.wait(self.recv(header))
        magic, version, _, length, crc = _HEADER.unpack(_to_bytes(header))
        if magic != _HEADER_MAGIC or version != VERSION:
            self._reject(f"the stream is not an understudy state transfer of version "
                         f"{VERSION} (magic {magic!r}, version {version})")
        if not 0 < length <= max_manifest_bytes:
            self._reject(f"the manifest takes {length} bytes, more than max_manifest_bytes="
                         f"{max_manifest_bytes}")
        raw = torch.empty(length, dtype=torch.uint8, device=self.device)
        self.wait(self.recv(raw))
        manifest = _to_bytes(raw)
        del raw
        self.stats.manifest_bytes = length
        if zlib.crc32(manifest) != crc:
            self._reject("the manifest failed its checksum")
        try:
            state, chunk_bytes = self._load(manifest, target)
        except safe_unpickle.RefusedGlobal as exc:
            self._reject(f"{exc}")
        except (ValueError, TypeError, KeyError, IndexError, AttributeError,
                pickle.UnpicklingError, RuntimeError, OverflowError, MemoryError) as exc:
            # RuntimeError, MemoryError: the entries' tensors could not be allocated
            self._reject(f"the manifest is malformed: {exc}")
        self.wait(self.send(_reply(_OK, "", self.device)))
        self._stream(*self.plan(chunk_bytes), self.leaver_staged)
        return state

    def _load(self, manifest: bytes, target: Any) -> tuple[Any, int]:
        m = safe_unpickle.load(manifest)
        if type(m) is not dict or type(m.get("skeleton")) is not bytes:
            raise ValueError("the manifest is not a dict with a skeleton")
        chunk_bytes = m["chunk_bytes"]
        self.leaver_staged = [int(i) for i in m["staged"]]
        if self.leaver_staged != sorted(set(self.leaver_staged)):
            raise ValueError("the leaver's staged chunks are not in order")
        if (m["version"] != VERSION or m["align"] != ALIGN or m["checksum"] != CHECKSUM
                or not isinstance(chunk_bytes, int) or chunk_bytes <= 0 or chunk_bytes % ALIGN):
            raise ValueError(f"unsupported parameters "
                             f"{ {k: v for k, v in m.items() if k != 'skeleton'} }")
        self.entries = [_Entry(tuple(p), d, tuple(int(n) for n in s), str(dev))
                        for p, d, s, dev in m["entries"]]
        existing = _tensors_by_path(target) if target is not None else {}
        public: list[torch.Tensor] = []
        for e in self.entries:
            dtype = _dtype(e.dtype)
            mine = existing.get(e.path)
            if mine is not None and mine.dtype == dtype and tuple(mine.shape) == e.shape:
                self.stats.reused_entries += 1
                public.append(mine)
            else:
                dev = torch.device("cpu") if e.device_type == "cpu" else self.alloc_device
                public.append(torch.empty(e.shape, dtype=dtype, device=dev))
        self.tensors = [t.detach() for t in public]
        state = safe_unpickle.load(m["skeleton"], public)
        self.stats.entries = len(self.entries)
        self.stats.chunk_bytes = chunk_bytes
        return state, chunk_bytes

    def _reject(self, reason: str) -> NoReturn:
        self.wait(self.send(_reply(_REJECTED, reason, self.device)))
        self.peer_informed = True
        raise TransferError(f"the joiner rejected the transfer: {reason}")

    def _stream(self, chunks: list[_Chunk], views: list[torch.Tensor | None],
                leaver_staged: list[int]) -> None:
        # Up to _LOOKAHEAD chunks are posted ahead, in order, so that the bytes never wait for
        # a receive. A chunk this end stages waits until the previous one was unpacked; a chunk
        # the leaver stages waits until the leaver's previous one landed here and was
        # acknowledged (the leaver reuses its staging on that word).
        if not chunks:
            return
        # {a chunk the leaver stages: the one it staged before, to acknowledge first}
        ack_before = {nxt: prev for prev, nxt in itertools.pairwise(leaver_staged)}
        posted: deque[tuple[torch.Tensor, Pending]] = deque()
        sends: list[tuple[Pending, torch.Tensor]] = []
        staging_busy = False
        next_to_post = 0
        landed = -1  # the last chunk whose bytes are here
        table = torch.empty(_DIGESTS.size + 8 * len(chunks), dtype=torch.uint8,
                            device=self.device)
        table_op: Pending | None = None

        def fill() -> None:
            nonlocal staging_busy, next_to_post, table_op
            while len(posted) < _LOOKAHEAD and next_to_post < len(chunks):
                j = next_to_post
                if views[j] is None and staging_busy:
                    return
                prev = ack_before.get(j)
                if prev is not None:
                    if landed < prev:
                        return
                    ack = _to_tensor(_ACK.pack(_ACK_MAGIC, prev), self.device)
                    sends.append((self.send(ack), ack))
                staging_busy = staging_busy or views[j] is None
                buf = self.staging.get(chunks[j].nbytes) if views[j] is None else views[j]
                assert buf is not None
                posted.append((buf, self.recv(buf)))
                next_to_post += 1
            if next_to_post == len(chunks) and table_op is None:
                table_op = self.recv(table)

        fill()
        digests: list[int] = []
        for chunk, view in zip(chunks, views, strict=True):
            self.check_abort()
            buf, data = posted.popleft()
            self.wait(data)
            landed = chunk.index
            fill()
            if self.on_chunk is not None:
                self.on_chunk(chunk.index, buf)
            digests.append(_digest(buf))  # while the next chunks land
            if view is None:
                self.copy(chunk, buf, pack=False)
                staging_busy = False
                fill()
        assert table_op is not None, "the table is posted once every chunk is"
        self.wait(table_op)
        failed = [self.describe(c) for c, mine, theirs in zip(
            chunks, digests, _unpack_digests(table, len(chunks)), strict=True) if mine != theirs]
        # The verdict comes after every chunk: a failure is reported once the stream is drained,
        # which keeps both ends' operation order (and the pair) intact.
        reason = f"{failed[0]} failed its checksum" if failed else ""
        if len(failed) > 1:
            reason += f" ({len(failed)} chunks failed)"
        verdict = _reply(_CORRUPT if failed else _OK, reason, self.device)
        sends.append((self.send(verdict), verdict))
        for op, _ in sends:
            self.wait(op)
        if failed:
            self.peer_informed = True
            raise TransferError(f"{reason}: the state arrived corrupted")


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
