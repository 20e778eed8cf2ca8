"""Clients of the snapshot holders (``worker/holder.py``, which describes the protocol): push
a rank's snapshot, fetch it back, list what a holder keeps, and find the job's holders through
the daemon (``<job>/holders/<node>``). Every call has a timeout and raises
:class:`~understudy.worker.holder.HolderError` naming the holder."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from typing import Any

from understudy.common.daemon_client import DaemonClient, DaemonError
from understudy.common.snapshot_tiers import MemoryCopies
from understudy.worker.holder import (
    MAX_FETCH,
    HolderAddress,
    HolderError,
    Op,
    Payload,
    ProtocolError,
    SnapshotHolder,
    recv_head,
    recv_payload,
    send_frame,
)


class _Connection:
    """A client connection to one holder; every call raises HolderError, naming the holder."""

    def __init__(self, holder: HolderAddress, timeout: float) -> None:
        self.holder, self.timeout = holder, timeout
        try:
            self.sock = socket.create_connection(holder.endpoint(), timeout=min(timeout, 5.0))
        except OSError as exc:
            raise HolderError(f"holder on {holder.node} ({holder.address}) is unreachable: "
                              f"{exc}") from exc
        self.sock.settimeout(timeout)

    def __enter__(self) -> _Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def request(self, header: dict[str, Any], payload: bytes | memoryview = b""
                ) -> tuple[dict[str, Any], Payload]:
        where = f"holder on {self.holder.node} ({self.holder.address})"
        try:
            send_frame(self.sock, {**header, "token": self.holder.token}, payload)
            head = recv_head(self.sock)
            if head is None:
                raise HolderError("it closed the connection without a reply")
            reply, size, crc = head
            if size > MAX_FETCH:
                raise ProtocolError(f"a reply of {size} bytes exceeds {MAX_FETCH}")
            data = recv_payload(self.sock, size, crc, lazy=True)
        except HolderError as exc:
            raise HolderError(f"{where}: {exc}") from exc
        except OSError as exc:
            raise HolderError(f"{where} is unreachable: {exc}") from exc
        if reply.get("op") != Op.OK:
            raise HolderError(f"{where} refused: {reply.get('error', reply)}")
        return reply, data


def _request(holder: HolderAddress, header: dict[str, Any], *,
             timeout: float) -> tuple[dict[str, Any], Payload]:
    with _Connection(holder, timeout) as conn:
        return conn.request(header)


def push(holder: HolderAddress, rank: int, step: int, data: bytes | memoryview, *,
         epoch: int | None = None, timeout: float = 60.0) -> MemoryCopies:
    """Give ``holder`` this rank's snapshot of ``step``, taken under ``epoch``; returns what it
    holds for the rank (with the epoch of each copy when the push named one). The holder admits
    the push before the bytes are sent: a refused one costs no transfer.

    Raises:
        HolderError: refused (full, older than what it keeps, from an epoch older than the
            rank's copies there), unreachable, or garbled.
    """
    size = memoryview(data).nbytes
    header: dict[str, Any] = {"op": Op.PUSH, "rank": rank, "step": step, "size": size}
    if epoch is not None:
        header["epoch"] = epoch
    with _Connection(holder, timeout) as conn:
        conn.request(header)
        reply, _ = conn.request({"op": Op.DATA}, data)
    held: Any = reply.get("held")
    epochs: Any = reply.get("epochs")
    if not _ints(held):
        raise HolderError(f"holder on {holder.node} answered a push with {reply!r}")
    if epoch is None:
        return MemoryCopies(holder.node, holder.id, tuple(held))
    if not _ints(epochs) or len(epochs) != len(held):
        raise HolderError(f"holder on {holder.node} does not say which epoch its copies are "
                          f"from (answered {reply!r})")
    return MemoryCopies(holder.node, holder.id, tuple(held), tuple(epochs))


def _ints(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(x, int) and not isinstance(x, bool) for x in value)


def fetch(holder: HolderAddress, rank: int, step: int, *, epoch: int | None = None,
          timeout: float = 60.0) -> Payload:
    """This rank's snapshot of ``step`` from ``holder``, checked against the push's crc;
    ``epoch``: only the copy pushed under that epoch.

    Raises:
        HolderError: not held there (or from another epoch), unreachable, or garbled.
    """
    header: dict[str, Any] = {"op": Op.FETCH, "rank": rank, "step": step}
    if epoch is not None:
        header["epoch"] = epoch
    reply, data = _request(holder, header, timeout=timeout)
    if reply.get("rank") != rank or reply.get("step") != step:
        raise HolderError(f"holder on {holder.node} answered for rank {reply.get('rank')} "
                          f"step {reply.get('step')}, not rank {rank} step {step}")
    if epoch is not None and reply.get("epoch") != epoch:
        raise HolderError(f"holder on {holder.node} answered with a copy from epoch "
                          f"{reply.get('epoch')}, not epoch {epoch}")
    return data


def held(holder: HolderAddress, *, timeout: float = 10.0) -> dict[int, tuple[int, ...]]:
    """rank -> steps ``holder`` holds. Raises HolderError."""
    reply, _ = _request(holder, {"op": Op.LIST}, timeout=timeout)
    raw = reply.get("held")
    if not isinstance(raw, dict):
        raise HolderError(f"holder on {holder.node} answered a list with {reply!r}")
    return {int(r): tuple(s) for r, s in raw.items()}


class HolderDirectory:
    """The job's holders, as advertised under ``<job>/holders/<node>``, read through this
    node's daemon on a connection of its own (opened on first use, by the thread that uses
    it; one thread at a time). ``epoch``: the worker's current epoch, for the hello."""

    def __init__(self, job: str, epoch: Callable[[], int], timeout: float = 10.0) -> None:
        self.job, self.epoch, self.timeout = job, epoch, timeout
        self._client: DaemonClient | None = None

    def _call(self, fn: Callable[[DaemonClient], Any]) -> Any:
        try:
            if self._client is None:
                self._client = DaemonClient(self.job, epoch=self.epoch(), timeout=self.timeout)
            return fn(self._client)
        except DaemonError as exc:
            self.close()
            raise HolderError(f"cannot ask the daemon about snapshot holders: {exc}") from exc

    def standbys(self) -> tuple[str, ...]:
        """The job's standby nodes, in the assignment's order."""
        info = self._call(lambda c: c.job()) or {}
        standbys = (info.get("assignment") or {}).get("standbys") or ()
        return tuple(n for n in standbys if isinstance(n, str))

    def lookup(self, node: str) -> HolderAddress:
        """Raises HolderError: no holder advertised for ``node``, or an unreadable one."""
        try:
            value = self._call(lambda c: c.get(f"holders/{node}"))
        except HolderError as exc:
            raise HolderError(f"no snapshot holder is advertised for {node}") from exc
        return HolderAddress.parse(node, value)

    def advertise(self, holder: SnapshotHolder) -> None:
        """Raises HolderError: the daemon did not take it."""
        self._call(lambda c: c.set(f"holders/{holder.node}", holder.advertised().encode()))

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def push_to_any(directory: HolderDirectory | Callable[[], list[HolderAddress]], rank: int,
                step: int, data: bytes | memoryview | Callable[[], bytes | memoryview], *,
                epoch: int | None = None, timeout: float = 60.0) -> MemoryCopies:
    """Push to the rank's holder: the job's standbys in turn, starting at ``rank`` modulo
    their number (so the ranks spread over the pool), the first that takes it (``epoch``: the
    epoch the snapshot was taken under, see :func:`push`). ``data`` may be a function making
    the bytes: called once, and only if there is a holder to try.

    Raises:
        HolderError: none took it; says why for each.
    """
    errors = []
    payload = data if not callable(data) else None
    for holder in _candidates(directory, rank):
        try:
            if isinstance(holder, HolderError):
                raise holder
            if payload is None:
                assert callable(data)
                payload = data()
            return push(holder, rank, step, payload, epoch=epoch, timeout=timeout)
        except HolderError as exc:
            errors.append(str(exc))
    raise HolderError("; ".join(errors) or "the job has no standby to hold snapshots")


def holder_order(nodes: tuple[str, ...], rank: int) -> tuple[str, ...]:
    """The standby nodes ``rank`` tries, in turn: from ``rank`` modulo their number on, so
    that the ranks' copies spread over the pool."""
    start = rank % len(nodes) if nodes else 0
    return nodes[start:] + nodes[:start]


def _candidates(directory: HolderDirectory | Callable[[], list[HolderAddress]],
                rank: int) -> Iterator[HolderAddress | HolderError]:
    if not isinstance(directory, HolderDirectory):
        yield from directory()
        return
    for node in holder_order(directory.standbys(), rank):
        try:
            yield directory.lookup(node)
        except HolderError as exc:
            yield exc
