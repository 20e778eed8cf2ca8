"""The leaver's end of a state transfer: :func:`send_state` (the protocol: :mod:`.wire`)."""

from __future__ import annotations

import time
import zlib
from collections import deque
from typing import Any

import torch

from understudy.worker.transfer.ends import TransferStats, _End, _run, transfer_finished
from understudy.worker.transfer.transports import (
    AbortCheck,
    Pending,
    StateTransport,
    TransferError,
)
from understudy.worker.transfer.wire import (
    _HEADER,
    _HEADER_MAGIC,
    _OK,
    _REPLY,
    ALIGN,
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MAX_MANIFEST_BYTES,
    VERSION,
    Path,
    _dtype_name,
    _dump_manifest,
    _Entry,
    _flatten,
    _pack_digests,
    _parse_reply,
    _to_tensor,
)


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
            allow-list: see "Trust" in :mod:`understudy.worker.transfer.wire`) or a chunk, the
            peer died or went silent, or the transfer was aborted.
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
    stats.start_memory()
    sender = _Sender(transport, tensors, entries, stats, should_abort)
    manifest = _dump_manifest(skeleton, entries, chunk_bytes)
    if len(manifest) > max_manifest_bytes:
        raise ValueError(f"the manifest takes {len(manifest)} bytes, more than "
                         f"max_manifest_bytes={max_manifest_bytes}: move large plain values "
                         f"into tensors")
    stats.manifest_bytes = len(manifest)
    _run(sender, lambda: sender.run(manifest, chunk_bytes))
    stats.seconds = time.perf_counter() - start
    stats.end_memory()
    transfer_finished(stats)
    return stats


class _Sender(_End):
    def __init__(self, transport: StateTransport, tensors: list[tuple[Path, torch.Tensor]],
                 entries: list[_Entry], stats: TransferStats,
                 should_abort: AbortCheck | None) -> None:
        super().__init__(transport, stats, should_abort)
        self.tensors = [t.detach() for _, t in tensors]
        self.entries = entries

    def run(self, manifest: bytes, chunk_bytes: int) -> None:
        # This end waits for a send only before reusing a staging region, and learns the rest
        # from the joiner's replies. Such a wait ends as promptly as a receive's when the peer
        # dies: gloo itself may never fail a send the peer had matched, but the transport's
        # wait fails as soon as it knows the peer is gone (its contract).
        header = _HEADER.pack(_HEADER_MAGIC, VERSION, 0, len(manifest), zlib.crc32(manifest))
        head, body = _to_tensor(header, self.device), _to_tensor(manifest, self.device)
        # every send, and the buffer it reads: kept alive until the send is known complete
        sends: list[tuple[Pending, torch.Tensor]] = [(self.send(head), head),
                                                     (self.send(body), body)]
        chunks, views = self.plan(chunk_bytes)  # while the joiner reads the manifest
        reply = torch.empty(_REPLY.size, dtype=torch.uint8, device=self.device)
        self.wait(self.recv(reply))
        status, reason = _parse_reply(reply)
        if status != _OK:
            raise TransferError(f"the joiner rejected the manifest: {reason}")
        # the staging's regions in use, oldest first: their chunk and its send
        staged: deque[tuple[int, Pending]] = deque()
        for chunk, view in zip(chunks, views, strict=True):
            self.check_abort()
            if view is None:
                buf = self.staging.take(chunk.nbytes)
                while buf is None:  # the ring is full: its oldest region is free once sent
                    index, op = staged.popleft()
                    self.wait(op)
                    self.digests.wait(index)
                    self.staging.release()
                    buf = self.staging.take(chunk.nbytes)
                self.copy(chunk, buf, pack=True)
            else:
                buf = view
            op = self.send(buf)
            sends.append((op, buf))
            if view is None:
                staged.append((chunk.index, op))
            self.digests.add(buf)  # while the bytes are in flight
        if chunks:
            table = _to_tensor(_pack_digests(self.digests.results()), self.device)
            sends.append((self.send(table), table))
            self.wait(self.recv(reply))
            status, reason = _parse_reply(reply)
            if status != _OK:
                self.peer_informed = True
                raise TransferError(f"the joiner rejected the state: {reason}")
        for op, _ in sends:  # all complete: the joiner has received everything
            self.wait(op)
