"""Moving a rank's training state from the leaver to the joiner (phase 2 of a migration).

The state is a tree of dicts, lists and tuples whose leaves are dense tensors (parameters,
optimizer state, RNG states...) or plain picklable values (step, schedule, data position,
``random.getstate()``...). :func:`send_state` streams it over a :class:`StateTransport`;
:func:`receive_state` / :func:`receive_into` rebuild it on the other end, bit for bit.

The seam: :class:`StateTransport`
---------------------------------
A transport is one end of an ordered, reliable byte channel between the two members of a
transfer pair. Its contract, which ``tests/unit/test_transfer.py`` checks for every
implementation:

* ``send(buf)`` / ``recv(buf)`` start moving a 1-D, contiguous, non-empty ``uint8`` tensor on
  ``transport.device`` and return a :class:`Pending`; the caller leaves ``buf`` alone until
  ``wait()`` has returned. Per direction the k-th send fills the k-th recv (same length).
* ``Pending.wait()`` returns once the operation completed, and raises :class:`TransferError`
  after at most the transport's timeout without completion, at once when the peer is gone, and
  promptly after ``abort()``. Waiting twice is harmless.
* ``abort(reason)`` may be called from any thread, returns promptly, and is idempotent: every
  pending and later wait on this end raises ``TransferError`` naming the reason, and the peer's
  waits fail as if this end had died. After any ``TransferError`` the transport is spent; it is
  built for one transfer and then dropped.

:class:`PairGroupTransport` implements it over a 2-rank ``torch.distributed`` group with nothing
but point-to-point ``send``/``recv`` of tensors, so the same code runs on gloo (CPU) and NCCL.

The wire protocol (version 1)
-----------------------------
1. leaver -> joiner: a 32-byte header (magic, version, manifest length, crc32 of the manifest).
2. leaver -> joiner: the manifest, a pickle of ``{version, chunk_bytes, checksum, entries,
   skeleton}``: one entry ``(path, dtype, shape, device type)`` per tensor, in state order, and
   the *skeleton*, the state pickled with every tensor replaced by a reference to its entry.
   Plain Python values travel inside the skeleton; the manifest is capped by
   ``max_manifest_bytes`` on both ends.
3. joiner -> leaver: a 128-byte reply: the manifest is accepted, or why not.
4. leaver -> joiner: the chunks, each followed by a 16-byte trailer (chunk index, digest). Both
   ends derive the same chunk plan from the manifest (:func:`_plan`): a tensor of at least
   ``chunk_bytes // 8`` bytes is cut into chunks of its own, of ``chunk_bytes`` but for its
   last; smaller ones are packed in order, each at a multiple of :data:`ALIGN` (zero gaps),
   into shared chunks of at most ``chunk_bytes``. The joiner keeps up to 8 chunks posted ahead.
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
bytes are (on the GPU for NCCL: only 1/512 of the bytes reach the host), computed by the leaver
while the chunk is in flight and by the joiner while the next chunks land. It detects every
change confined to one row (bit flips, garbage, stale or zeroed bytes), truncation, shifted or
misplaced data; what it misses (compensating changes within one row, words swapped within a
row) is not what wires and memories do. Measured here on the 2-core development machine with an
84 MiB state, against raw send/recv of the same bytes: crc32 (``zlib``) over every chunk
reached 35-55 % of raw, the row sums 70-100 %; crc32 also needs every byte on the host.
The manifest, small, is protected by crc32.

Trust: the manifest is unpickled. The peer is a member of the same job, admitted by the
epoch-fenced bootstrap store; checksums guard against corruption, not against a malicious peer.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import hashlib
import io
import math
import pickle
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

from understudy.daemon.errors import UnderstudyError

#: Bytes per chunk unless the caller says otherwise; 8 MiB measured best on gloo here.
DEFAULT_CHUNK_BYTES = 8 * 1024 * 1024
#: Cap on the manifest (entries plus plain Python values), enforced on both ends.
DEFAULT_MAX_MANIFEST_BYTES = 16 * 1024 * 1024
#: Every entry starts at a multiple of this in the stream; also the largest element size.
ALIGN = 16
VERSION = 1
CHECKSUM = "rowsum64-blake2b"
_ROW_WORDS = 512  # 4 KiB rows for the chunk digest
#: Chunks the joiner keeps posted ahead (and the leaver keeps in flight); costs no memory for
#: chunks that move straight between tensors.
_LOOKAHEAD = 8

_HEADER = struct.Struct("<8sIIQI4x")   # magic, version, flags, manifest length, manifest crc
_HEADER_MAGIC = b"USTXFER\x00"
_DIGESTS = struct.Struct("<4sI")       # magic, count; then one u64 digest per chunk
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
    def wait(self) -> None:
        """Block until the operation completed. Raises :class:`TransferError` (see the module
        docstring for when)."""


class StateTransport(Protocol):
    """One end of a transfer pair's ordered byte channel; the contract is in the module
    docstring."""

    @property
    def device(self) -> torch.device: ...

    def send(self, buf: torch.Tensor) -> Pending: ...

    def recv(self, buf: torch.Tensor) -> Pending: ...

    def abort(self, reason: str) -> None: ...


class _PairGroup(Protocol):
    """What :class:`PairGroupTransport` needs of a process group (or backend)."""

    def rank(self) -> int: ...

    def size(self) -> int: ...

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int, /) -> Any: ...

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int, /) -> Any: ...


class PairGroupTransport:
    """:class:`StateTransport` over a 2-rank process group: gloo on CPU, NCCL on GPU.

    ``timeout_s`` bounds every wait. ``abort`` must also release a wait that is blocked in the
    backend: gloo's ``ProcessGroupGloo.abort()`` does not, and its send/recv works have no
    future to poll, so on gloo ``abort`` waits on a receive that is never matched for 1 ms;
    gloo answers an expired wait by closing every pair of the group, which fails the blocked
    waits here and, through the closed connection, the peer's. Other backends get
    ``pg.abort()`` (NCCL aborts the communicator). Either way the group is spent: it was built
    for this one transfer.
    """

    _DATA_TAG = 0
    _ABORT_TAG = 1

    def __init__(self, pg: _PairGroup, *, timeout_s: float = 30.0,
                 device: torch.device | str = "cpu") -> None:
        if pg.size() != 2:
            raise ValueError(f"a transfer pair has 2 ranks, this group has {pg.size()}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        self._pg = pg
        self._peer = 1 - pg.rank()
        self._timeout = timedelta(seconds=timeout_s)
        self._device = torch.device(device)
        self._lock = threading.Lock()
        self._spent: str | None = None   # why this transport can no longer be used
        self._aborted = False

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
        if _backend_name(self._pg) == "gloo":
            never = torch.empty(1, dtype=torch.uint8)
            with contextlib.suppress(RuntimeError):  # the expected outcome: pairs closed
                self._pg.recv([never], self._peer, self._ABORT_TAG).wait(
                    timedelta(milliseconds=1))
        else:
            abort = getattr(self._pg, "abort", None)
            if abort is not None:
                abort()

    def _start(self, buf: torch.Tensor, what: str) -> _GroupOp:
        if (buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous()
                or buf.numel() == 0 or buf.device != self._device):
            raise ValueError(f"a transport buffer is a non-empty contiguous 1-D uint8 tensor on "
                             f"{self._device}, got {buf.dtype} {tuple(buf.shape)} on "
                             f"{buf.device}")
        self._raise_if_spent()
        try:
            if what == "send":
                work = self._pg.send([buf], self._peer, self._DATA_TAG)
            else:
                work = self._pg.recv([buf], self._peer, self._DATA_TAG)
        except RuntimeError as exc:
            raise self._failed(what, exc) from exc
        return _GroupOp(self, work, what, buf)

    def _raise_if_spent(self) -> None:
        with self._lock:
            if self._spent is not None:
                raise TransferError(self._spent)

    def _failed(self, what: str, exc: RuntimeError) -> TransferError:
        text = str(exc)
        with self._lock:
            if self._aborted:
                assert self._spent is not None
                return TransferError(self._spent)
            if "Timed out" in text or "timed out" in text:
                why = (f"no progress for {self._timeout.total_seconds():g}s on a {what} with "
                       f"peer rank {self._peer}: the peer is frozen or gone")
            else:
                why = f"a {what} with peer rank {self._peer} failed: {_first_line(text)}"
            self._spent = self._spent or why
            return TransferError(why)


class _GroupOp:
    def __init__(self, owner: PairGroupTransport, work: Any, what: str,
                 buf: torch.Tensor) -> None:
        self._owner = owner
        self._work = work
        self._what = what
        self._buf = buf  # kept alive until the backend is done with it
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        self._owner._raise_if_spent()
        try:
            completed = self._work.wait(self._owner._timeout)
        except RuntimeError as exc:
            raise self._owner._failed(self._what, exc) from exc
        self._owner._raise_if_spent()
        if completed is False:
            raise TransferError(f"a {self._what} with the peer was interrupted")
        self._done = True


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
               should_abort: AbortCheck | None = None, poll_s: float = 0.05) -> TransferStats:
    """Stream ``state`` to the peer; return once the peer has verified every byte.

    ``should_abort`` is polled every ``poll_s`` seconds from a watchdog thread (a backend wait
    cannot be sliced), so it must be thread-safe and cheap; when it returns true the transfer
    is aborted on both ends.

    Raises:
        ValueError: ``chunk_bytes`` is not a positive multiple of :data:`ALIGN`, a leaf tensor
            is not a dense tensor with data, a tensor hides inside a non-container object, a
            plain value does not pickle, or the manifest exceeds ``max_manifest_bytes``.
        TransferError: the peer rejected the manifest or a chunk, the peer died or went
            silent, or the transfer was aborted.
    """
    if chunk_bytes <= 0 or chunk_bytes % ALIGN:
        raise ValueError(f"chunk_bytes must be a positive multiple of {ALIGN}, "
                         f"got {chunk_bytes!r}")
    tensors: list[tuple[Path, torch.Tensor]] = []
    skeleton = _flatten(state, (), tensors)
    entries = [_Entry(p, _dtype_name(t.dtype), tuple(t.shape), t.device.type)
               for p, t in tensors]
    manifest = _dump_manifest(skeleton, entries, chunk_bytes)
    if len(manifest) > max_manifest_bytes:
        raise ValueError(f"the manifest takes {len(manifest)} bytes, more than "
                         f"max_manifest_bytes={max_manifest_bytes}: move large plain values "
                         f"into tensors")
    stats = TransferStats("send", chunk_bytes=chunk_bytes, entries=len(entries),
                          manifest_bytes=len(manifest))
    sender = _Sender(transport, tensors, entries, chunk_bytes, stats)
    with _Watchdog(transport, should_abort, poll_s):
        _run(sender, lambda: sender.run(manifest))
    return stats


def receive_state(transport: StateTransport, *,
                  max_manifest_bytes: int = DEFAULT_MAX_MANIFEST_BYTES,
                  device: torch.device | str | None = None,
                  should_abort: AbortCheck | None = None, poll_s: float = 0.05,
                  on_chunk: ChunkHook | None = None) -> tuple[Any, TransferStats]:
    """Receive a state sent by :func:`send_state` into fresh tensors; see :func:`receive_into`."""
    return receive_into(transport, None, max_manifest_bytes=max_manifest_bytes, device=device,
                        should_abort=should_abort, poll_s=poll_s, on_chunk=on_chunk)


def receive_into(transport: StateTransport, target: Any, *,
                 max_manifest_bytes: int = DEFAULT_MAX_MANIFEST_BYTES,
                 device: torch.device | str | None = None,
                 should_abort: AbortCheck | None = None, poll_s: float = 0.05,
                 on_chunk: ChunkHook | None = None) -> tuple[Any, TransferStats]:
    """Receive a state sent by :func:`send_state`, writing in place into ``target``'s tensors.

    ``target`` is a tree like the sender's (for instance ``{"model": model.state_dict(),
    "optim": optimizer.state_dict()}``): a tensor found at the same path with the same dtype and
    shape is overwritten in place (so the joiner's parameters and optimizer state are updated
    without a copy) and appears in the result as that very object; other entries get fresh
    contiguous tensors on ``device`` (default: the transport's), CPU entries stay on the CPU.
    The result is the sender's tree; strides and aliasing between tensors are not preserved.

    ``on_chunk(index, landed_bytes)`` sees each chunk as it landed, before it is verified: an
    instrumentation and fault-injection hook (writing to it simulates corruption on the wire).

    Raises:
        TransferError: the manifest is malformed, foreign or over ``max_manifest_bytes``, a
            chunk fails its checksum, the peer died or went silent, or the transfer was
            aborted. ``target``'s tensors are then partly written.
    """
    stats = TransferStats("receive")
    dev = torch.device(device) if device is not None else transport.device
    receiver = _Receiver(transport, stats, dev, on_chunk)
    with _Watchdog(transport, should_abort, poll_s):
        state = _run(receiver, lambda: receiver.run(target, max_manifest_bytes))
    return state, stats


def _run(end: _End, body: Callable[[], Any]) -> Any:
    start = time.perf_counter()
    try:
        with torch.no_grad():
            result = body()
    except BaseException as exc:
        if not end.peer_informed:  # make the peer fail now, not after its timeout
            end.transport.abort(str(exc) if isinstance(exc, TransferError)
                                else f"{type(exc).__name__}: {exc}")
        raise
    end.stats.seconds = time.perf_counter() - start
    return result


class _Watchdog:
    """Polls ``should_abort`` on a named thread while a transfer runs; aborts the transport
    when it says so. Stopped and joined (bounded) when the transfer ends."""

    def __init__(self, transport: StateTransport, should_abort: AbortCheck | None,
                 poll_s: float) -> None:
        if not poll_s > 0:
            raise ValueError(f"poll_s must be positive, got {poll_s!r}")
        self._transport = transport
        self._should_abort = should_abort
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> _Watchdog:
        if self._should_abort is not None:
            self._thread = threading.Thread(target=self._loop, name="understudy-transfer-watch",
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0 + 4 * self._poll_s)

    def _loop(self) -> None:
        assert self._should_abort is not None
        while True:
            try:
                reason = "the caller asked for it" if self._should_abort() else None
            except Exception as exc:  # a broken predicate must not leave the transfer unguarded
                reason = f"should_abort raised {type(exc).__name__}: {exc}"
            if reason is not None:
                self._transport.abort(reason)
                return
            if self._stop.wait(self._poll_s):
                return


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


class _SkeletonUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, tensors: list[torch.Tensor]) -> None:
        super().__init__(io.BytesIO(data))
        self._tensors = tensors

    def persistent_load(self, pid: Any) -> Any:
        if not isinstance(pid, int) or not 0 <= pid < len(self._tensors):
            raise pickle.UnpicklingError(f"the skeleton refers to tensor {pid!r}, which the "
                                         f"manifest does not list")
        return self._tensors[pid]


def _dump_manifest(skeleton: Any, entries: list[_Entry], chunk_bytes: int) -> bytes:
    buf = io.BytesIO()
    try:
        _SkeletonPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(skeleton)
        return pickle.dumps({
            "version": VERSION, "chunk_bytes": chunk_bytes, "align": ALIGN, "checksum": CHECKSUM,
            "entries": [(e.path, e.dtype, e.shape, e.device_type) for e in entries],
            "skeleton": buf.getvalue()}, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise ValueError(f"the state's plain values do not pickle: {exc}") from exc


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
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
    return t.detach().reshape(-1).view(torch.uint8)


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

    @property
    def size(self) -> int:
        return 0 if self._buf is None else self._buf.numel()


class _End:
    """What both ends share: this end's tensors and how a chunk maps onto them."""

    def __init__(self, transport: StateTransport, stats: TransferStats) -> None:
        self.transport = transport
        self.stats = stats
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

    def describe(self, chunk: _Chunk) -> str:
        names = [self.entries[k].name for k, *_ in chunk.segments]
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        return f"chunk {chunk.index} ({chunk.nbytes} bytes of {shown})"


class _Sender(_End):
    def __init__(self, transport: StateTransport, tensors: list[tuple[Path, torch.Tensor]],
                 entries: list[_Entry], chunk_bytes: int, stats: TransferStats) -> None:
        super().__init__(transport, stats)
        self.tensors = [t.detach() for _, t in tensors]
        self.entries = entries
        self.chunks, self.views = self.plan(chunk_bytes)

    def run(self, manifest: bytes) -> None:
        header = _HEADER.pack(_HEADER_MAGIC, VERSION, 0, len(manifest), zlib.crc32(manifest))
        sends = [self.send(_to_tensor(header, self.device)),
                 self.send(_to_tensor(manifest, self.device))]
        accepted = torch.empty(_REPLY.size, dtype=torch.uint8, device=self.device)
        self.recv(accepted).wait()  # first: a joiner that refuses the header takes no manifest
        status, reason = _parse_reply(accepted)
        if status != _OK:
            raise TransferError(f"the joiner rejected the manifest: {reason}")
        for op in sends:
            op.wait()
        verdict = torch.empty(_REPLY.size, dtype=torch.uint8, device=self.device)
        digests: list[int] = []
        inflight: deque[tuple[Pending, torch.Tensor]] = deque()  # sends, and what they read
        staging_reader: Pending | None = None  # the send that still reads the staging buffer
        for chunk, view in zip(self.chunks, self.views, strict=True):
            if view is None:
                if staging_reader is not None:
                    staging_reader.wait()
                buf = self.staging.get(chunk.nbytes)
                self.copy(chunk, buf, pack=True)
                data = staging_reader = self.send(buf)
            else:
                buf = view
                data = self.send(buf)
            digests.append(_digest(buf))  # while the bytes are in flight
            inflight.append((data, buf))
            while len(inflight) > _LOOKAHEAD:
                inflight.popleft()[0].wait()
        got = None
        if self.chunks:
            table = _to_tensor(_pack_digests(digests), self.device)
            inflight.append((self.send(table), table))
            got = self.recv(verdict)
        while inflight:
            inflight.popleft()[0].wait()
        if got is not None:
            got.wait()
            status, reason = _parse_reply(verdict)
            if status != _OK:
                self.peer_informed = True
                raise TransferError(f"the joiner rejected the state: {reason}")


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
                 on_chunk: ChunkHook | None) -> None:
        super().__init__(transport, stats)
        self.alloc_device = device
        self.on_chunk = on_chunk

    def run(self, target: Any, max_manifest_bytes: int) -> Any:
        header = torch.empty(_HEADER.size, dtype=torch.uint8, device=self.device)
        self.recv(header).wait()
        magic, version, _, length, crc = _HEADER.unpack(_to_bytes(header))
        if magic != _HEADER_MAGIC or version != VERSION:
            self._reject(f"the stream is not an understudy state transfer of version "
                         f"{VERSION} (magic {magic!r}, version {version})")
        if length > max_manifest_bytes:
            self._reject(f"the manifest takes {length} bytes, more than max_manifest_bytes="
                         f"{max_manifest_bytes}")
        raw = torch.empty(length, dtype=torch.uint8, device=self.device)
        self.recv(raw).wait()
        manifest = _to_bytes(raw)
        del raw
        self.stats.manifest_bytes = length
        if zlib.crc32(manifest) != crc:
            self._reject("the manifest failed its checksum")
        try:
            state, chunk_bytes = self._load(manifest, target)
        except (ValueError, TypeError, KeyError, IndexError, pickle.UnpicklingError, EOFError,
                AttributeError, ImportError) as exc:
            self._reject(f"the manifest is malformed: {exc}")
        self.send(_reply(_OK, "", self.device)).wait()
        self._stream(*self.plan(chunk_bytes))
        return state

    def _load(self, manifest: bytes, target: Any) -> tuple[Any, int]:
        m = pickle.loads(manifest)
        chunk_bytes = m["chunk_bytes"]
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
        state = _SkeletonUnpickler(m["skeleton"], public).load()
        self.stats.entries = len(self.entries)
        self.stats.chunk_bytes = chunk_bytes
        return state, chunk_bytes

    def _reject(self, reason: str) -> NoReturn:
        self.send(_reply(_REJECTED, reason, self.device)).wait()
        self.peer_informed = True
        raise TransferError(f"the joiner rejected the transfer: {reason}")

    def _stream(self, chunks: list[_Chunk], views: list[torch.Tensor | None]) -> None:
        # Up to _LOOKAHEAD chunks are posted ahead, in order, so that the bytes never wait for
        # a receive; a chunk that needs the staging waits until the previous one was unpacked.
        if not chunks:
            return
        posted: deque[tuple[torch.Tensor, Pending]] = deque()
        staging_busy = False
        next_to_post = 0
        table = torch.empty(_DIGESTS.size + 8 * len(chunks), dtype=torch.uint8,
                            device=self.device)
        table_op: Pending | None = None

        def fill() -> None:
            nonlocal staging_busy, next_to_post, table_op
            while len(posted) < _LOOKAHEAD and next_to_post < len(chunks):
                j = next_to_post
                if views[j] is None:
                    if staging_busy:
                        return
                    staging_busy = True
                buf = self.staging.get(chunks[j].nbytes) if views[j] is None else views[j]
                assert buf is not None
                posted.append((buf, self.recv(buf)))
                next_to_post += 1
            if next_to_post == len(chunks) and table_op is None:
                table_op = self.recv(table)

        fill()
        digests: list[int] = []
        for chunk, view in zip(chunks, views, strict=True):
            buf, data = posted.popleft()
            data.wait()
            if self.on_chunk is not None:
                self.on_chunk(chunk.index, buf)
            digests.append(_digest(buf))  # while the next chunks land
            if view is None:
                self.copy(chunk, buf, pack=False)
                staging_busy = False
            fill()
        assert table_op is not None, "the table is posted once every chunk is"
        table_op.wait()
        failed = [self.describe(c) for c, mine, theirs in zip(
            chunks, digests, _unpack_digests(table, len(chunks)), strict=True) if mine != theirs]
        # The verdict comes after every chunk: a failure is reported once the stream is drained,
        # which keeps both ends' operation order (and the pair) intact.
        reason = f"{failed[0]} failed its checksum" if failed else ""
        if len(failed) > 1:
            reason += f" ({len(failed)} chunks failed)"
        self.send(_reply(_CORRUPT if failed else _OK, reason, self.device)).wait()
        if failed:
            self.peer_informed = True
            raise TransferError(f"{reason}: the state arrived corrupted")


def _backend_name(pg: Any) -> str:
    try:
        return str(pg.name()).lower()
    except (AttributeError, RuntimeError):
        return ""


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text
