"""The in-memory snapshot tier: a holder in a standby worker's host memory (its clients are in
``worker/holder_client.py``).

A standby worker waits on a spare node with idle host memory. When the job takes snapshots
(``worker/snapshots.py``), it runs a :class:`SnapshotHolder`: a TCP server bound to its node's
address (``UNDERSTUDY_NODE_ADDRESS``, which the daemon sets from its ``addresses``; else what
the host name resolves to, as gloo does), port 0. It advertises itself under the job's key
``<job>/holders/<node>`` (:class:`HolderAddress`: address, incarnation id, and a token only the
job's workers can read through their daemons) and reports its id with its warmth, so the node
record (bound to the node's lease, and dropped by the daemon when the worker exits or is
promoted) says which holder is alive. Each rank pushes its snapshots, serialized once with
``torch.save``, to one holder; a rollback fetches them back.

Protocol: one frame per message each way, on a connection that may carry several requests::

    magic "USSH" | version u8 | header length u32 | payload length u64 | payload crc32 u32
    header: a JSON object (at most 64 KiB) | payload: raw bytes

Requests name an :class:`Op` and carry the holder's token. ``push`` announces a snapshot
(rank, step, size, and ``epoch``, the epoch the pushing rank held when it took it) and is
answered ``ok`` only if it will be kept, so that a refused one never sends its bytes; ``data``
then carries the ``torch.save`` archive and is answered ``ok`` with ``held``, the steps now held
for that rank, and ``epochs``, the epoch of each. ``fetch`` (rank, step, and optionally the
``epoch`` wanted) is answered ``ok`` with the archive, its ``epoch`` and the crc the push came
with (checked end to end), ``list`` with what is held. The epoch fields are optional (protocol
version 1 is unchanged for a peer that sends none): a push without one is kept as epoch 0, a
fetch without one takes whichever epoch is held. A
request refused for what it asks (a step not held, no room) gets ``error`` (one sentence) and
the connection serves on. Bytes that are not this protocol (wrong magic or version, oversized
header, bad JSON, a crc that does not match, a wrong token, an unknown op, data nobody
announced) get ``error`` if it can still be framed and the connection is closed: nothing is
stored, and the holder serves the other connections on. The holder never unpickles what it
holds: a payload is opaque bytes that must look like a ``torch.save`` archive, loaded
(``weights_only``) by the rank that fetches it.

**Epochs.** A rank replaced by the controller may still run for a while under its old epoch (its
node cut off from etcd only). The holder refuses a push from an epoch older than the newest it
keeps for that rank, so once the rank's new holder (the joiner, the survivors after a switch)
has pushed, nothing of the replaced process replaces or evicts a copy; a copy of the same step
from a newer epoch replaces the older one. A fetch that names the epoch it wants (the one the
rollback plan names) gets that copy or a refusal, never another epoch's.

The newest ``keep`` copies of each rank, by (epoch, step), are kept, within ``capacity`` bytes in
all: a push that would not fit (after evicting that rank's oldest) is refused, and the rank keeps
its storage copies only. Ordering by epoch first lets a job that rolled back keep pushing the
steps it redoes, evicting the copies of the abandoned run.

A holder's copies live exactly as long as its process: a standby that dies loses them (the
controller stops counting them when the warmth is gone), and a standby promoted to a rank closes
its holder once it has switched (it serves the survivors' fetches until then, and as the joiner
of a rollback it takes its own rank's copy from its own memory).
"""

from __future__ import annotations

import contextlib
import enum
import hmac
import json
import mmap
import os
import re
import secrets
import socket
import struct
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Any

from understudy.common import env, logs
from understudy.common.snapshot_tiers import HOLDER_ID_RE

MAGIC = b"USSH"
VERSION = 1
_HEAD = struct.Struct(">4sBIQI")
MAX_HEADER = 64 * 1024
#: the largest reply a client accepts (the holder's own limit is its capacity)
MAX_FETCH = 1 << 40
#: send and receive in pieces of this size, each within the socket timeout
CHUNK = 4 * 1024 * 1024
#: concurrent connections a holder serves; more are closed at once
MAX_CONNECTIONS = 64
#: seconds a new connection has to deliver its first request's header, all of it: one that
#: trickles its bytes in (each read within the I/O timeout) would otherwise hold a connection
#: slot, unauthenticated, for as long as it likes (64 of them shut every rank out)
FIRST_FRAME_S = 5.0
#: a torch.save archive is a zip file
_ZIP = b"PK\x03\x04"
_TOKEN_RE = re.compile(r"^[0-9a-f]{32,128}$")
_ADDRESS_RE = re.compile(r"^(?P<host>[A-Za-z0-9.:_-]{1,253}):(?P<port>[0-9]{1,5})$")


class HolderError(RuntimeError):
    """A holder refused a request, or could not be reached or understood; says which."""


class ProtocolError(HolderError):
    """Bytes that are not a well-formed frame of this protocol."""


class Op(enum.StrEnum):
    #: announce a snapshot (rank, step, size); ``ok`` when there is room, then ``data``
    PUSH = "push"
    DATA = "data"
    FETCH = "fetch"
    LIST = "list"
    OK = "ok"
    ERROR = "error"


# -- frames -----------------------------------------------------------------------------------


def send_frame(sock: socket.socket, header: dict[str, Any],
                payload: bytes | bytearray | memoryview = b"",
                crc: int | None = None) -> None:
    head = json.dumps(header).encode()
    if len(head) > MAX_HEADER:
        raise ValueError(f"a frame header of {len(head)} bytes exceeds {MAX_HEADER}")
    view = memoryview(payload).cast("B")
    crc = zlib.crc32(view) if crc is None else crc
    sock.sendall(_HEAD.pack(MAGIC, VERSION, len(head), len(view), crc) + head)
    for i in range(0, len(view), CHUNK):
        sock.sendall(view[i:i + CHUNK])


#: what a payload is read into: a bytearray, or past LAZY_BYTES on a fetch an anonymous
#: mapping whose pages exist only once data lands in them
Payload = bytearray | mmap.mmap
#: payloads from this size on are read into memory committed as it arrives (``lazy``)
LAZY_BYTES = 16 << 20


def _recv_exactly(sock: socket.socket, n: int, deadline: float | None = None) -> bytearray:
    buf = bytearray(n)
    _recv_into(sock, buf, deadline)
    return buf


def _recv_into(sock: socket.socket, buf: Payload, deadline: float | None = None) -> None:
    """Fill ``buf`` from ``sock``. Raises ProtocolError if the peer closes early."""
    n = len(buf)
    view = memoryview(buf)
    got = 0
    while got < n:
        _before(sock, deadline)
        k = sock.recv_into(view[got:], min(n - got, CHUNK))
        if k == 0:
            raise ProtocolError(f"the connection closed {got} bytes into a {n}-byte read")
        got += k


def _before(sock: socket.socket, deadline: float | None) -> None:
    """Bound the next read by ``deadline`` (monotonic; None: the socket's own timeout)."""
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the deadline for the frame passed")
        sock.settimeout(left)


def recv_head(sock: socket.socket, deadline: float | None = None
              ) -> tuple[dict[str, Any], int, int] | None:
    """A frame's header, payload length and crc; None if the peer closed between frames.
    ``deadline`` (monotonic): the whole header must have arrived by then.

    Raises:
        ProtocolError: not a frame of this protocol. TimeoutError: past the deadline.
    """
    _before(sock, deadline)
    first = sock.recv(_HEAD.size)
    if not first:
        return None
    raw = bytes(first) + bytes(_recv_exactly(sock, _HEAD.size - len(first), deadline))
    magic, version, head_len, payload_len, crc = _HEAD.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"not a snapshot-holder frame (magic {magic!r})")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version} is not {VERSION}")
    if head_len > MAX_HEADER:
        raise ProtocolError(f"a header of {head_len} bytes exceeds {MAX_HEADER}")
    try:
        header = json.loads(_recv_exactly(sock, head_len, deadline))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"the header is not JSON ({type(exc).__name__})") from None
    if not isinstance(header, dict):
        raise ProtocolError("the header is not a JSON object")
    return header, payload_len, crc


def recv_payload(sock: socket.socket, n: int, crc: int, lazy: bool = False) -> Payload:
    """A frame's payload of ``n`` bytes, checked against ``crc``.

    ``lazy``: ``n`` is the peer's claim, not yet earned (a fetch's reply): past
    ``LAZY_BYTES`` the buffer is an anonymous mapping, whose memory the kernel commits page by
    page as the bytes arrive, so a peer that claims a terabyte and sends little costs what it
    sent, not what it claimed (review M7); a claim the kernel cannot map at all is refused.

    Raises:
        ProtocolError: the peer closed early, the crc does not match, or the claim cannot be
            mapped here.
    """
    data: Payload
    if lazy and n >= LAZY_BYTES:
        try:
            data = mmap.mmap(-1, n)
        except (OSError, OverflowError, ValueError) as exc:
            raise ProtocolError(f"a payload of {n} bytes cannot be held here: {exc}") from None
    else:
        data = bytearray(n)
    _recv_into(sock, data)
    if zlib.crc32(data) != crc:
        raise ProtocolError(f"the payload's crc32 does not match ({n} bytes)")
    return data


def _linger(sock: socket.socket, seconds: float = 0.5) -> None:
    """Before closing on a peer that sent bytes we did not read: say we are done and take in
    what it still sends, briefly, so that the refusal reaches it instead of a reset."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(seconds)
        for _ in range(16):
            if not sock.recv(CHUNK // 16):
                return


def _int_field(header: dict[str, Any], name: str) -> int:
    value = header.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 40:
        raise HolderError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def _epoch_field(header: dict[str, Any]) -> int | None:
    """The request's ``epoch``; None when it says none (a peer older than epochs)."""
    return None if header.get("epoch") is None else _int_field(header, "epoch")


# -- the holder -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Admitted:
    """A push the holder made room for; its data comes next on the same connection."""

    rank: int
    step: int
    size: int
    epoch: int


@dataclass(frozen=True)
class HolderAddress:
    """Where a holder serves, as advertised under ``<job>/holders/<node>``."""

    node: str
    address: str
    id: str
    token: str

    def encode(self) -> bytes:
        return json.dumps({"address": self.address, "id": self.id,
                           "token": self.token}).encode()

    @classmethod
    def parse(cls, node: str, value: bytes) -> HolderAddress:
        """Raises HolderError: the value is not an advertisement."""
        try:
            body = json.loads(value)
            address, hid, token = body["address"], body["id"], body["token"]
        except (ValueError, KeyError, TypeError):
            raise HolderError(f"the holder advertised for {node} is unreadable") from None
        if not (isinstance(address, str) and _ADDRESS_RE.match(address)
                and isinstance(hid, str) and HOLDER_ID_RE.match(hid)
                and isinstance(token, str) and _TOKEN_RE.match(token)):
            raise HolderError(f"the holder advertised for {node} is malformed")
        return cls(node, address, hid, token)

    def endpoint(self) -> tuple[str, int]:
        m = _ADDRESS_RE.match(self.address)
        assert m is not None  # checked by parse, and by the holder that made it
        return m["host"], int(m["port"])


def node_address() -> str:
    """The address this node's workers bind to: the daemon's first configured address, else
    what the host name resolves to (gloo's default), else loopback."""
    configured = os.environ.get(env.NODE_ADDRESS)
    if configured:
        return configured
    with contextlib.suppress(OSError):
        return socket.gethostbyname(socket.gethostname())
    return "127.0.0.1"


def default_capacity() -> int:
    """Half of the machine's physical memory."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError):
        return 16 << 30


class SnapshotHolder:
    """Holds the newest ``keep`` snapshots of each rank, within ``capacity`` bytes, and serves
    them over TCP (see the module docstring). Started by the constructor; :meth:`close` stops
    it. ``node`` names where it runs (its copies are ``MemoryCopies(node, id, ...)``)."""

    def __init__(self, node: str, *, host: str = "127.0.0.1", keep: int = 2,
                 capacity: int | None = None, io_timeout: float = 30.0) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        capacity = default_capacity() if capacity is None else capacity
        if capacity < 0:
            raise ValueError(f"capacity must not be negative, got {capacity}")
        self.node, self.keep, self.capacity, self.io_timeout = node, keep, capacity, io_timeout
        self.id = secrets.token_hex(8)
        self.token = secrets.token_hex(16)
        self.refused = 0
        self._lock = threading.Lock()
        #: rank -> step -> (the archive, its crc, the epoch it was pushed under)
        self._copies: dict[int, dict[int, tuple[bytes | bytearray, int, int]]] = {}
        self._used = 0
        self._reserved = 0
        self._stop = threading.Event()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._conns: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._log = logs.get("understudy.worker", node=node, holder=self.id)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, 0), family=family)
        self._listener.settimeout(0.2)
        bound_host, port = self._listener.getsockname()[:2]
        self.address = f"{bound_host}:{port}"
        self._acceptor = threading.Thread(target=self._accept, name="snapshot-holder",
                                          daemon=True)
        self._acceptor.start()

    def advertised(self) -> HolderAddress:
        return HolderAddress(self.node, self.address, self.id, self.token)

    # -- in-process access ---------------------------------------------------------------------

    def held(self) -> dict[int, tuple[int, ...]]:
        """rank -> the steps held for it, oldest first."""
        with self._lock:
            return {r: tuple(sorted(c)) for r, c in self._copies.items() if c}

    def held_epochs(self) -> dict[int, dict[int, int]]:
        """rank -> step -> the epoch its copy was pushed under."""
        with self._lock:
            return {r: {s: e for s, (_, _, e) in sorted(c.items())}
                    for r, c in self._copies.items() if c}

    @property
    def used(self) -> int:
        """Bytes of the copies held."""
        return self._used

    @property
    def reserved(self) -> int:
        """Bytes admitted for pushes whose data has not arrived yet."""
        return self._reserved

    def get(self, rank: int, step: int, epoch: int | None = None) -> bytes | bytearray:
        """The copy of ``step`` of ``rank`` (``epoch``: only the one pushed under that epoch).

        Raises:
            HolderError: that step of that rank is not held here, or from another epoch.
        """
        return self._get(rank, step, epoch)[0]

    def _get(self, rank: int, step: int,
             epoch: int | None = None) -> tuple[bytes | bytearray, int, int]:
        with self._lock:
            copy = self._copies.get(rank, {}).get(step)
            if copy is None:
                held = sorted(self._copies.get(rank, {}))
                raise HolderError(f"step {step} of rank {rank} is not held on {self.node} "
                                  f"(held: {held})")
            if epoch is not None and copy[2] != epoch:
                raise HolderError(f"step {step} of rank {rank} is held on {self.node} from "
                                  f"epoch {copy[2]}, not epoch {epoch}")
            return copy

    def _release(self, size: int) -> None:
        with self._lock:
            self._reserved -= size

    def _kept_after(self, rank: int, step: int, epoch: int) -> list[int]:
        """The steps of ``rank`` kept once this push lands (the newest ``keep`` by epoch, then
        step). Raises HolderError: the push is from an older epoch than a copy held for the
        rank (its pusher was replaced), or older than every step kept. Under the lock."""
        copies = self._copies.get(rank, {})
        newest = max((e for _, _, e in copies.values()), default=epoch)
        if epoch < newest:
            raise HolderError(f"a push of step {step} of rank {rank} from epoch {epoch} is "
                              f"stale: {self.node} keeps rank {rank}'s copies from epoch "
                              f"{newest}")
        order = {s: (e, s) for s, (_, _, e) in copies.items()} | {step: (epoch, step)}
        kept = sorted(order, key=order.__getitem__)[-self.keep:]
        if step not in kept:
            raise HolderError(f"step {step} of rank {rank} is older than the {self.keep} "
                              f"steps held for it ({sorted(copies)})")
        return kept

    def _admit(self, rank: int, step: int, size: int, epoch: int = 0) -> None:
        """Reserve room for a push; raises HolderError if it cannot be kept."""
        with self._lock:
            kept = self._kept_after(rank, step, epoch)
            copies = self._copies.get(rank, {})
            freed = sum(len(d) for s, (d, _, _) in copies.items() if s not in kept or s == step)
            if self._used + self._reserved + size - freed > self.capacity:
                raise HolderError(f"{size} bytes do not fit: {self._used} of {self.capacity} "
                                  f"bytes are held on {self.node}")
            self._reserved += size

    def _store(self, rank: int, step: int, data: bytearray, crc: int,
               epoch: int = 0) -> dict[int, int]:
        """Keep an admitted push; returns step -> epoch of what is now held for ``rank``.
        Raises HolderError (the reservation is released): a push from a newer epoch landed
        while this one's data was on its way."""
        with self._lock:
            self._reserved -= len(data)
            kept = self._kept_after(rank, step, epoch)
            copies = self._copies.setdefault(rank, {})
            for s in [s for s in copies if s not in kept or s == step]:
                self._used -= len(copies.pop(s)[0])
            copies[step] = (data, crc, epoch)
            self._used += len(data)
            return {s: copies[s][2] for s in sorted(copies)}

    # -- serving -------------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                break  # the listener was closed
            if not self._slots.acquire(blocking=False):
                conn.close()
                continue
            conn.settimeout(self.io_timeout)
            t = threading.Thread(target=self._serve, args=(conn,), name="snapshot-holder-conn",
                                 daemon=True)
            with self._lock:
                self._conns.add(conn)
                self._threads.add(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        pending: _Admitted | None = None  # a push admitted, its data not arrived yet
        # The first request's header within FIRST_FRAME_S; once it carried the token, the
        # connection's reads are bounded by the I/O timeout alone.
        deadline: float | None = time.monotonic() + min(FIRST_FRAME_S, self.io_timeout)
        try:
            while not self._stop.is_set():
                try:
                    head = recv_head(conn, deadline)
                    if head is None:
                        return
                    pending = self._answer(conn, pending, *head)
                    if deadline is not None:
                        deadline = None
                        conn.settimeout(self.io_timeout)
                except ProtocolError as exc:
                    self._refuse(conn, exc)
                    _linger(conn)
                    return
        except OSError:
            pass  # the peer went away, or stalled past the timeout: its request is dropped
        finally:
            if pending is not None:
                self._release(pending.size)
            with self._lock:
                self._conns.discard(conn)
                self._threads.discard(threading.current_thread())
            conn.close()
            self._slots.release()

    def _answer(self, conn: socket.socket, pending: _Admitted | None,
                header: dict[str, Any], size: int, crc: int) -> _Admitted | None:
        """Carry out one request; returns the push now admitted, if any.

        Raises:
            ProtocolError: the stream cannot be trusted any more (the caller closes it).
        """
        token = header.get("token")
        if not isinstance(token, str) or not hmac.compare_digest(token, self.token):
            raise ProtocolError("wrong token")
        try:
            op = Op(str(header.get("op")))
        except ValueError:
            raise ProtocolError(f"unknown op {str(header.get('op'))[:40]!r}") from None
        if op is not Op.DATA and size:
            raise ProtocolError(f"a {op} request carries no payload")
        if op is Op.DATA:
            if pending is None or size != pending.size:
                said = None if pending is None else (pending.rank, pending.step, pending.size)
                raise ProtocolError(f"{size} bytes of data, but {said} was admitted")
            # admitted within the holder's budget at PUSH: read as it comes
            data = recv_payload(conn, size, crc)  # ProtocolError: released by the caller
            assert isinstance(data, bytearray)
            if not data.startswith(_ZIP):
                raise ProtocolError("the payload is not a torch.save archive")
            try:  # the reservation is used up either way
                held = self._store(pending.rank, pending.step, data, crc, pending.epoch)
            except HolderError as exc:  # the data was read whole: the stream is in step
                self._refuse(conn, exc)
                return None
            with contextlib.suppress(OSError):  # a peer gone already reads no reply
                send_frame(conn, {"op": Op.OK, "held": list(held),
                                  "epochs": list(held.values())})
            return None
        if pending is not None:
            raise ProtocolError(f"a {op} request while a push waits for its data")
        try:
            if op is Op.PUSH:
                admitted = _Admitted(_int_field(header, "rank"), _int_field(header, "step"),
                                     _int_field(header, "size"), _epoch_field(header) or 0)
                self._admit(admitted.rank, admitted.step, admitted.size, admitted.epoch)
                send_frame(conn, {"op": Op.OK})
                return admitted
            if op is Op.FETCH:
                rank, step = _int_field(header, "rank"), _int_field(header, "step")
                copy, stored_crc, epoch = self._get(rank, step, _epoch_field(header))
                # The crc stored with the push: the fetcher checks the bytes end to end.
                send_frame(conn, {"op": Op.OK, "rank": rank, "step": step, "epoch": epoch},
                           copy, crc=stored_crc)
            elif op is Op.LIST:
                send_frame(conn, {"op": Op.OK, "id": self.id, "used": self._used,
                                   "capacity": self.capacity,
                                   "held": {str(r): list(s) for r, s in self.held().items()}})
            else:
                raise HolderError(f"{op} is a reply, not a request")
        except HolderError as exc:  # a well-framed request refused: the stream is in step
            self._refuse(conn, exc)
        return None

    def _refuse(self, conn: socket.socket, exc: Exception) -> None:
        self.refused += 1
        self._log.warning(f"Snapshot holder refused a request: {exc}")
        with contextlib.suppress(OSError, ValueError):
            send_frame(conn, {"op": Op.ERROR, "error": str(exc)[:500]})

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving and drop every copy (bounded: ``timeout`` seconds for the threads)."""
        self._stop.set()
        self._listener.close()
        self._acceptor.join(timeout)
        with self._lock:
            conns, threads = list(self._conns), list(self._threads)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for t in threads:
            t.join(timeout)
        with self._lock:
            self._copies.clear()
            self._used = 0
