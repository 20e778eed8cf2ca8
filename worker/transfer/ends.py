"""What the two ends of a state transfer share: how a chunk maps onto this end's tensors, the
staging ring, the statistics, and failing both ends at once.

Memory: neither end copies the state. A chunk that lies inside one contiguous tensor goes
straight from the leaver's tensor into the joiner's (no staging at all); a chunk that packs
several small tensors, or covers part of a non-contiguous one, goes through the end's staging
ring, one buffer of at most ``chunk_bytes`` (:class:`_Staging`) in which several such chunks
can be in flight at once. ``TransferStats.peak_staging_bytes`` reports what was used. The
joiner writes into preallocated destinations: with
:func:`~understudy.worker.transfer.receive_into`, into the joiner's own tensors wherever path,
dtype and shape match.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from understudy.worker.transfer.transports import (
    AbortCheck,
    Pending,
    StateTransport,
    TransferError,
)
from understudy.worker.transfer.wire import (
    ALIGN,
    CHECKSUM,
    _Chunk,
    _DeviceDigest,
    _digest,
    _Entry,
    _finish_device_digests,
    _plan,
)

#: called with every finished transfer's stats, on the thread that ran it (the worker's
#: metrics reporter listens: ``worker/telemetry.py``); an observer must be quick and not raise
_observers: list[Callable[[TransferStats], None]] = []


def observe_transfers(observer: Callable[[TransferStats], None]) -> Callable[[], None]:
    """Call ``observer`` with the stats of each transfer that ends in this process from now
    on; returns what stops it."""
    _observers.append(observer)
    return lambda: _observers.remove(observer) if observer in _observers else None


def transfer_finished(stats: TransferStats) -> None:
    """Tell the observers (:func:`observe_transfers`) of ``stats``."""
    for observer in list(_observers):
        observer(stats)


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
    #: this process's resident set as the transfer began, and its peak (VmHWM) as it ended;
    #: 0 where /proc says nothing. The peak is the one since the transfer began (the kernel's
    #: peak is reset then, see :func:`reset_peak`), whatever else the process did meanwhile (a
    #: leaver sending ahead trains at the same time; of two transfers at once in one process,
    #: each counts from the later start); where the reset is refused, the process's peak since
    #: it started (``peak_since_start``)
    rss_start_bytes: int = 0
    peak_rss_bytes: int = 0
    peak_since_start: bool = False

    @property
    def mb_per_s(self) -> float:
        """Payload rate in MB/s (10**6 bytes)."""
        return self.payload_bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0

    def __str__(self) -> str:
        reused = f" ({self.reused_entries} in place)" if self.direction == "receive" else ""
        return (f"{self.direction} {self.payload_bytes} B of tensors in {self.entries} entries"
                f"{reused} in {self.seconds * 1e3:.1f} ms ({self.mb_per_s:.0f} MB/s), "
                f"{self.chunks} chunks of {self.chunk_bytes} B ({self.direct_chunks} direct), "
                f"peak staging {self.peak_staging_bytes} B, manifest {self.manifest_bytes} B, RSS "
                f"{self.rss_start_bytes} B at the start, peak RSS {self.peak_rss_bytes} B "
                + ("(since the process started)" if self.peak_since_start
                   else "(during the transfer)"))

    def start_memory(self) -> None:
        """Reset the peak and note the resident set: call as the transfer begins."""
        self.peak_since_start = not reset_peak()
        self.rss_start_bytes = resident_bytes()[0]

    def end_memory(self) -> None:
        """Note the peak resident set: call as the transfer ends."""
        self.peak_rss_bytes = resident_bytes()[1]


def reset_peak() -> bool:
    """Make the kernel's peak resident set (``VmHWM``) this process's resident set now
    (``echo 5 > /proc/self/clear_refs``, Linux 4.0 on). False where it cannot (not Linux, a
    read-only ``/proc``): the peak then stays the one since the process started."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def resident_bytes() -> tuple[int, int]:
    """This process's resident set now and its peak so far (``VmRSS``, ``VmHWM``), in bytes;
    zeros where ``/proc/self/status`` cannot be read (not Linux)."""
    found = {"VmRSS:": 0, "VmHWM:": 0}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key = line.split(None, 1)[0]
                if key in found:
                    found[key] = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0, 0
    return found["VmRSS:"], found["VmHWM:"]


def _run(end: _End, body: Callable[[], Any]) -> Any:
    try:
        with torch.no_grad():
            return body()
    except BaseException as exc:
        if not end.peer_informed:  # make the peer fail now, not after its timeout
            end.transport.abort(str(exc) if isinstance(exc, TransferError)
                                else f"{type(exc).__name__}: {exc}")
        raise
    finally:
        end.digests.close()


class _Digests:
    """This end's chunk digests, computed in chunk order on a thread of their own while this
    end's thread moves the bytes (torch's reduction releases the GIL). On the leaver this is
    what keeps the stream going: digesting inline, its thread would write each chunk into the
    socket in ``send`` (gloo writes at once when nothing is queued) and only then digest it,
    one after the other. A chunk on a GPU is digested on the device instead, queued on this
    end's stream behind the chunk's bytes and read back with all the others in
    :meth:`results` (:class:`~understudy.worker.transfer.wire._DeviceDigest`): no host sync
    per chunk. One per transfer; :func:`_run` closes it."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._digests: list[Future[int] | _DeviceDigest] = []

    def add(self, buf: torch.Tensor) -> None:
        """Digest the next chunk's bytes; ``buf`` stays untouched until :meth:`wait` for it
        (on a GPU: until work queued on this thread's stream after this call)."""
        if buf.is_cuda:
            self._digests.append(_DeviceDigest.start(buf))
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="understudy-transfer-digest")
        self._digests.append(self._pool.submit(_digest, buf))

    def wait(self, index: int) -> None:
        """Block until chunk ``index``'s digest is taken (its buffer may then be reused)."""
        d = self._digests[index]
        if isinstance(d, Future):
            d.result()

    def results(self) -> list[int]:
        _finish_device_digests([d for d in self._digests if isinstance(d, _DeviceDigest)])
        return [d.result() if isinstance(d, Future) else d.value  # type: ignore[misc]
                for d in self._digests]

    def close(self) -> None:
        """Drop the digests not started and join the thread (a digest takes milliseconds)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

class _Staging:
    """The scratch bytes of an end: one buffer of ``capacity`` bytes (at most ``chunk_bytes``),
    allocated on first use and used as a ring. Each staged chunk takes the next free region and
    gives it back (:meth:`release`) in the order it was taken (the leaver: once its send
    completed; the joiner: once unpacked), so that several staged chunks can be in flight at
    once without a second buffer."""

    def __init__(self, device: torch.device, stats: TransferStats) -> None:
        self._device = device
        self._stats = stats
        self._buf: torch.Tensor | None = None
        self.capacity = 0
        self._live: deque[tuple[int, int]] = deque()  # regions in use, oldest first

    def size_for(self, staged: list[_Chunk], chunk_bytes: int) -> None:
        """Room for all the ``staged`` chunks at once, or ``chunk_bytes``, whichever is less
        (a chunk is never larger than ``chunk_bytes``, a multiple of :data:`ALIGN`)."""
        sizes = [_aligned(c.nbytes) for c in staged]
        self.capacity = max(max(sizes, default=0), min(sum(sizes), chunk_bytes))

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A region of ``nbytes`` (starting at a multiple of :data:`ALIGN`), or None while the
        regions in use leave no room for it: :meth:`release` the oldest first."""
        n = _aligned(nbytes)
        assert 0 < n <= self.capacity, "a staged chunk always fits in the staging"
        if not self._live:
            start = 0
        else:
            first, end = self._live[0][0], self._live[-1][1]
            if self._live[-1][0] < first:           # wrapped: the room is between them
                start = end if end + n <= first else -1
            elif end + n <= self.capacity:          # after the newest region
                start = end
            else:                                   # wrap around to the front
                start = 0 if n <= first else -1
        if start < 0:
            return None
        if self._buf is None:
            self._buf = torch.empty(self.capacity, dtype=torch.uint8, device=self._device)
            self._stats.peak_staging_bytes = max(self._stats.peak_staging_bytes, self.capacity)
        self._live.append((start, start + n))
        return self._buf[start:start + nbytes]

    def release(self) -> None:
        """Give back the oldest region in use."""
        self._live.popleft()


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class _End:
    """What both ends share: this end's tensors and how a chunk maps onto them."""

    def __init__(self, transport: StateTransport, stats: TransferStats,
                 should_abort: AbortCheck | None) -> None:
        self.transport = transport
        self.stats = stats
        self.should_abort = should_abort
        self.device = transport.device
        self.staging = _Staging(self.device, stats)
        self.digests = _Digests()
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
        self.staging.size_for([c for c, v in zip(chunks, views, strict=True) if v is None],
                              chunk_bytes)
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
