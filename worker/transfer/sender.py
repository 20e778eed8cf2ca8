"""The leaver's end of a state transfer: :func:`send_state` (the protocol: :mod:`.wire`)."""

from __future__ import annotations

import time
import zlib
from typing import Any

import torch

from understudy.worker.transfer.ends import TransferStats, _End, _run
from understudy.worker.transfer.transports import (
    AbortCheck,
    Pending,
    StateTransport,
    TransferError,
)
from understudy.worker.transfer.wire import (
    _ACK,
    _ACK_MAGIC,
    _HEADER,
    _HEADER_MAGIC,
    _OK,
    _REPLY,
    ALIGN,
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MAX_MANIFEST_BYTES,
    VERSION,
    Path,
    _digest,
    _dtype_name,
    _dump_manifest,
    _Entry,
    _flatten,
    _pack_digests,
    _parse_reply,
    _to_bytes,
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
