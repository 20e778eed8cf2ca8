"""The joiner's end of a state transfer: :func:`receive_into` and :func:`receive_state`."""

from __future__ import annotations

import pickle
import time
import zlib
from collections import deque
from collections.abc import Callable
from typing import Any, NoReturn

import torch

from understudy.worker import safe_unpickle
from understudy.worker.transfer.ends import TransferStats, _End, _run, transfer_finished
from understudy.worker.transfer.landing import Landing
from understudy.worker.transfer.transports import (
    AbortCheck,
    Pending,
    StateTransport,
    TransferError,
)
from understudy.worker.transfer.wire import (
    _CORRUPT,
    _DIGESTS,
    _HEADER,
    _HEADER_MAGIC,
    _OK,
    _REJECTED,
    ALIGN,
    CHECKSUM,
    DEFAULT_MAX_MANIFEST_BYTES,
    VERSION,
    _Chunk,
    _dtype,
    _Entry,
    _reply,
    _tensors_by_path,
    _to_bytes,
    _unpack_digests,
)

#: Chunks the joiner keeps posted ahead; costs no memory for chunks that move straight between
#: tensors.
_LOOKAHEAD = 64
ChunkHook = Callable[[int, torch.Tensor], None]


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
                 on_chunk: ChunkHook | None = None,
                 landing: Landing | None = None) -> tuple[Any, TransferStats]:
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

    ``landing``: told of each tensor's bytes as they land in place, so that another thread can
    use them before the transfer ends (:mod:`~understudy.worker.transfer.landing`: CPU tensors
    only; a device's land all at once, at the end).

    Raises:
        TransferError: the manifest is malformed, foreign, over ``max_manifest_bytes`` or
            holds a type outside the allow-list (nothing was written to ``target`` then), a
            chunk fails its checksum, the peer died or went silent, or the transfer was
            aborted. ``target``'s tensors are then partly written.
    """
    start = time.perf_counter()
    stats = TransferStats("receive")
    stats.start_memory()
    dev = torch.device(device) if device is not None else transport.device
    receiver = _Receiver(transport, stats, dev, on_chunk, should_abort, landing)
    try:
        state = _run(receiver, lambda: receiver.run(target, max_manifest_bytes))
    except BaseException as exc:
        if landing is not None:
            landing.fail(exc)
        raise
    if landing is not None:
        landing.finish()
    stats.seconds = time.perf_counter() - start
    stats.end_memory()
    transfer_finished(stats)
    return state, stats


class _Receiver(_End):
    def __init__(self, transport: StateTransport, stats: TransferStats, device: torch.device,
                 on_chunk: ChunkHook | None, should_abort: AbortCheck | None,
                 landing: Landing | None = None) -> None:
        super().__init__(transport, stats, should_abort)
        self.alloc_device = device
        self.on_chunk = on_chunk
        self.landing = landing
        self.public: list[torch.Tensor] = []  # the entries as the result holds them

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
        chunks, views = self.plan(chunk_bytes)
        if self.landing is not None:
            self.landing.begin(state, self.public)
        self._stream(chunks, views)
        return state

    def _load(self, manifest: bytes, target: Any) -> tuple[Any, int]:
        m = safe_unpickle.load(manifest)
        if type(m) is not dict or type(m.get("skeleton")) is not bytes:
            raise ValueError("the manifest is not a dict with a skeleton")
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
        self.public = public
        self.tensors = [t.detach() for t in public]
        state = safe_unpickle.load(m["skeleton"], public)
        self.stats.entries = len(self.entries)
        self.stats.chunk_bytes = chunk_bytes
        return state, chunk_bytes

    def _reject(self, reason: str) -> NoReturn:
        self.wait(self.send(_reply(_REJECTED, reason, self.device)))
        self.peer_informed = True
        raise TransferError(f"the joiner rejected the transfer: {reason}")

    def _stream(self, chunks: list[_Chunk], views: list[torch.Tensor | None]) -> None:
        # Up to _LOOKAHEAD chunks are posted ahead, in order, so that the bytes never wait for
        # a receive; a chunk this end stages is posted once the staging ring has room for it,
        # which unpacking the chunks staged before it makes.
        if not chunks:
            return
        posted: deque[tuple[torch.Tensor, Pending]] = deque()
        next_to_post = 0
        table = torch.empty(_DIGESTS.size + 8 * len(chunks), dtype=torch.uint8,
                            device=self.device)
        table_op: Pending | None = None

        def fill() -> None:
            nonlocal next_to_post, table_op
            while len(posted) < _LOOKAHEAD and next_to_post < len(chunks):
                buf = views[next_to_post]
                if buf is None:
                    buf = self.staging.take(chunks[next_to_post].nbytes)
                    if buf is None:
                        return
                posted.append((buf, self.recv(buf)))
                next_to_post += 1
            if next_to_post == len(chunks) and table_op is None:
                table_op = self.recv(table)

        fill()
        for chunk, view in zip(chunks, views, strict=True):
            self.check_abort()
            buf, data = posted.popleft()
            self.wait(data)
            fill()
            if self.on_chunk is not None:
                self.on_chunk(chunk.index, buf)
            self.digests.add(buf)  # while the next chunks land
            if view is None:
                self.copy(chunk, buf, pack=False)
                self.digests.wait(chunk.index)
                self.staging.release()
                fill()
            if self.landing is not None and self.device.type == "cpu":
                for entry, _, end, _ in chunk.segments:
                    self.landing.landed(entry, end)
        assert table_op is not None, "the table is posted once every chunk is"
        self.wait(table_op)
        failed = [self.describe(c) for c, mine, theirs in zip(
            chunks, self.digests.results(), _unpack_digests(table, len(chunks)), strict=True)
            if mine != theirs]
        # The verdict comes after every chunk: a failure is reported once the stream is drained,
        # which keeps both ends' operation order (and the pair) intact.
        reason = f"{failed[0]} failed its checksum" if failed else ""
        if len(failed) > 1:
            reason += f" ({len(failed)} chunks failed)"
        self.wait(self.send(_reply(_CORRUPT if failed else _OK, reason, self.device)))
        if failed:
            self.peer_informed = True
            raise TransferError(f"{reason}: the state arrived corrupted")
