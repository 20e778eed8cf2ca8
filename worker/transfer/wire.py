"""The state transfer's wire format: the manifest, the chunk plan, the digests.

The wire protocol (version 2)
-----------------------------
1. leaver -> joiner: a 32-byte header (magic, version, manifest length, crc32 of the manifest).
2. leaver -> joiner: the manifest, a pickle of ``{version, chunk_bytes, checksum, entries,
   skeleton}``: one entry ``(path, dtype, shape, device type)`` per tensor, in state order; the
   *skeleton*, the state pickled with every tensor replaced by a reference to its entry. Plain
   Python values travel inside the skeleton; the manifest is capped by ``max_manifest_bytes``
   on both ends.
3. joiner -> leaver: a 128-byte reply: the manifest is accepted, or why not.
4. leaver -> joiner: the chunks, then a table of their digests (8 bytes each). Both ends
   derive the same chunk plan from the manifest (:func:`_plan`): a tensor of at least
   ``chunk_bytes // 8`` bytes is cut into chunks of its own, of ``chunk_bytes`` but for its
   last; smaller ones are packed in order, each at a multiple of :data:`ALIGN` (zero gaps),
   into shared chunks of at most :func:`_pack_bytes` (a quarter of ``chunk_bytes``), so that
   several of them fit in an end's staging ring at once (:mod:`.ends`). The joiner keeps
   chunks posted ahead (:mod:`.receiver`), so the bytes never wait for a receive, and digests
   each chunk as it lands. Neither end waits for the other between chunks: the leaver reuses
   a staging region once the transport says its send completed.
5. joiner -> leaver: a final reply: every chunk verified, or which did not. A corrupted chunk
   does not stop the stream: the joiner drains it to the end, so that both ends' operations
   stay matched, then reports.

Version 1 acknowledged each staged chunk before the leaver reused its one staging buffer, and
packed small tensors into chunks of a full ``chunk_bytes``: a round trip whenever two staged
chunks followed each other closely. Version 2 has no acknowledgements.

Every operation is issued by both ends in one global order, so a backend that serialises a
pair's operations on one stream (NCCL) cannot deadlock.

Checksums: each chunk's digest is a 64-bit blake2b over its length, the wrapping int64 sums
of its 4 KiB rows, and its last partial row. The row sums are one torch reduction where the
bytes are, computed by the leaver while the chunk is in flight and by the joiner while the next
chunks land (``_Digests`` in :mod:`.ends`): on the host on a thread of each end's own; on a GPU
queued on the end's stream, only 1/512 of the bytes reaching the host, all chunks' at once at
the end (one host sync per transfer, not one per chunk). Any change to a
single 8-byte word (every bit flip), truncation and shifted or misplaced data are always
detected; random damage (garbage, stale or zeroed bytes) escapes with odds of about 2**-64 per
row; what escapes for sure (compensating changes within one row, words swapped within a row)
is not what wires and memories do. Chosen over crc32 (``zlib``, the first candidate) by
measurement: on two cores every pass over the bytes competes with the copies themselves, crc32
is several times slower per byte than a sum, and it needs every byte on the host. Per-entry
checksums in the manifest were rejected: they need a full pass over the state before the first
byte moves. The manifest is protected by crc32.

Trust: the manifest is unpickled by :func:`understudy.worker.safe_unpickle.load`, which imports
nothing outside an allow-list, so a peer cannot run code in the joiner through it. A state's
plain values may be ``dict``, ``list``, ``tuple``, ``set``, ``frozenset``, ``str``, ``bytes``,
``bytearray``, ``int``, ``float``, ``bool``, ``None``, ``complex``, ``collections.OrderedDict``,
``torch.Size``, ``torch.device`` and torch dtypes, and its tensors are dense tensors in dicts,
lists and tuples (what ``torch.load(weights_only=True)`` takes). A joiner refuses a manifest
that holds anything else, in a sentence naming it, before anything is written to its tensors,
and the leaver's :func:`~understudy.worker.transfer.send_state` fails with that sentence.
Checksums guard against corruption; the peer itself is not authenticated
(``docs/security.md``): a peer that can speak in the transfer can still send wrong tensor
values.
"""

from __future__ import annotations

import copy
import ctypes
import functools
import hashlib
import io
import math
import pickle
import struct
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from understudy.worker.transfer.transports import TransferError

#: Bytes per chunk unless the caller says otherwise: with 2, 4 and 8 MiB the 256 MiB and 1 GiB
#: states moved at the same rate within the noise here, 8 MiB with the least CPU
#: (docs/benchmarks.md, "State transfer at real sizes").
DEFAULT_CHUNK_BYTES = 8 * 1024 * 1024
#: Cap on the manifest (entries plus plain Python values), enforced on both ends.
DEFAULT_MAX_MANIFEST_BYTES = 16 * 1024 * 1024
#: Every entry starts at a multiple of this in the stream; also the largest element size.
ALIGN = 16
VERSION = 2
CHECKSUM = "rowsum64-blake2b"
_ROW_WORDS = 512  # 4 KiB rows for the chunk digest

_HEADER = struct.Struct("<8sIIQI4x")   # magic, version, flags, manifest length, manifest crc
_HEADER_MAGIC = b"USTXFER\x00"
_DIGESTS = struct.Struct("<4sI")       # magic, count; then one u64 digest per chunk
_DIGESTS_MAGIC = b"UDGT"
_REPLY = struct.Struct("<4sI120s")     # magic, status, reason
_REPLY_MAGIC = b"UACK"
_OK, _REJECTED, _CORRUPT = 0, 1, 2

Path = tuple[Hashable, ...]


# --- the state tree -----------------------------------------------------------------------
@dataclass(frozen=True)
class _Entry:
    path: Path
    dtype: str
    shape: tuple[int, ...]
    device_type: str

    @functools.cached_property
    def nbytes(self) -> int:  # computed once: the plan asks for it per chunk, on both ends
        return math.prod(self.shape) * _dtype(self.dtype).itemsize

    @property
    def name(self) -> str:
        return _where(self.path)


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
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise ValueError(f"state entry {_where(path)} is a {type(t).__name__}; only plain "
                         f"dense tensors travel (convert it to its local tensor first)")
    if t.layout != torch.strided or t.device.type == "meta":
        raise ValueError(f"state entry {_where(path)} is a {t.layout} tensor on {t.device}; "
                         f"only dense tensors with data travel")


def _where(path: Path) -> str:
    return "/".join(str(k) for k in path) or "<root>"


class _SkeletonPickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> int | None:
        if isinstance(obj, _Ref):
            return obj.index
        if isinstance(obj, torch.Tensor):
            raise ValueError("a tensor inside a non-container object would travel unchunked in "
                             "the manifest; put it directly in a dict, list or tuple")
        return None


def _dump_manifest(skeleton: Any, entries: list[_Entry], chunk_bytes: int) -> bytes:
    buf = io.BytesIO()
    try:
        _SkeletonPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(skeleton)
        manifest = pickle.dumps({
            "version": VERSION, "chunk_bytes": chunk_bytes, "align": ALIGN, "checksum": CHECKSUM,
            "entries": [(e.path, e.dtype, e.shape, e.device_type) for e in entries],
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


def _pack_bytes(chunk_bytes: int) -> int:
    """The most bytes of a chunk that packs small entries: a quarter of ``chunk_bytes`` (so that
    four fit in an end's staging ring), never less than the largest small entry."""
    return max(ALIGN, chunk_bytes // 8, chunk_bytes // 4 // ALIGN * ALIGN)


def _plan(entries: list[_Entry], chunk_bytes: int) -> list[_Chunk]:
    """Cut the tensors' bytes into chunks of at most ``chunk_bytes``, the same way on both ends.

    An entry of at least ``chunk_bytes // 8`` gets chunks of its own (full ones but its last),
    so that each can move straight from the leaver's tensor into the joiner's; smaller entries
    are packed in order, each at a multiple of :data:`ALIGN`, into shared chunks of at most
    :func:`_pack_bytes`. Pieces start at multiples of ``chunk_bytes`` (itself a multiple of
    ``ALIGN``): no element is ever split.
    """
    large = max(ALIGN, chunk_bytes // 8)
    pack = _pack_bytes(chunk_bytes)
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
            if packing is None or at + n > pack:
                packing, at = _Chunk(len(chunks), 0), 0
                chunks.append(packing)
            packing.segments.append((k, 0, n, at))
            packing.nbytes = at + n
    return chunks


def _digest(buf: torch.Tensor) -> int:
    """The 64-bit digest of a chunk (see "Checksums" in the module docstring). ``buf`` starts at
    a multiple of 8 bytes in its storage (``_End.direct`` in :mod:`.ends` and the staging see
    to it)."""
    n, parts = _digest_parts(buf)
    return _finish_digest(n, b"".join(_to_bytes(p) for p in parts))


def _digest_parts(buf: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
    """What a chunk's digest hashes, as uint8 tensors where ``buf`` is: its 4 KiB rows' wrapping
    int64 sums, then its last partial row."""
    n = buf.numel()
    body = n - n % (8 * _ROW_WORDS)
    parts = []
    if body:
        # int64 addition wraps on every backend, so both ends agree bit for bit.
        parts.append(buf[:body].view(torch.int64).view(-1, _ROW_WORDS).sum(1).view(torch.uint8))
    if body < n:
        parts.append(buf[body:])
    return n, parts


def _finish_digest(n: int, hashed: bytes) -> int:
    h = hashlib.blake2b(n.to_bytes(8, "little"), digest_size=8)
    h.update(hashed)
    return int.from_bytes(h.digest(), "little")


@dataclass
class _DeviceDigest:
    """A chunk's digest on a GPU, computed without waiting for the device: its reductions are
    queued on the current stream behind the chunk's bytes (so the buffer may be reused by work
    queued after them), and their few bytes (1/512 of the chunk) are read back for a whole
    transfer at once by :func:`_finish_device_digests`. Per chunk, reading them back would wait
    for everything queued before on the stream (staging copies, other digests): on an H200 that
    wait held half of each end's time at 1 GiB (docs/benchmarks.md, "GPU self-test")."""

    n: int
    parts: list[torch.Tensor]
    value: int | None = None

    @classmethod
    def start(cls, buf: torch.Tensor) -> _DeviceDigest:
        n, parts = _digest_parts(buf)
        if n % (8 * _ROW_WORDS):
            parts[-1] = parts[-1].clone()  # the partial row is a view of the reusable buffer
        return cls(n, parts)


def _finish_device_digests(digests: list[_DeviceDigest]) -> None:
    """Read back the queued reductions of ``digests`` (one copy per device) and hash them."""
    by_device: dict[torch.device, list[_DeviceDigest]] = {}
    for d in digests:
        if d.value is None:
            device = d.parts[0].device if d.parts else torch.device("cpu")
            by_device.setdefault(device, []).append(d)
    for group in by_device.values():
        parts = [p for d in group for p in d.parts]
        data = _to_bytes(torch.cat(parts)) if parts else b""
        at = 0
        for d in group:
            size = sum(p.numel() for p in d.parts)
            d.value = _finish_digest(d.n, data[at:at + size])
            d.parts = []
            at += size


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
