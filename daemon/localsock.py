"""The daemon's local Unix socket: how workers reach etcd without a client of their own.

Protocol: one JSON object per line each way. A request is ``{"id": n, "op": OP, ...}``; the
reply is ``{"id": n, "ok": true, ...}`` or ``{"id": n, "ok": false, "error": sentence}`` (plus
``"retry": true`` when etcd did not answer: the same request may succeed later). The
first request on a connection must be ``hello`` with a ``namespace`` (for process-group
bootstrap: ``<job>/<group>/v<version>``) and an ``epoch``; every key then lives under
``<prefix>/kv/<namespace>/``. A hello whose epoch the daemon refuses (``epoch_check``) closes the
connection: a process of an old epoch cannot reach the job's store. Values are base64.

**Who may connect** (``daemon/peers.py``): the daemon's own workers and their children, and
members of the configured ``socket_group``, as the kernel reports the connecting process
(``SO_PEERCRED``). Anyone else gets one line, ``{"id": <its first request's id>, "ok": false,
"error": sentence}``, and the connection is closed; the daemon logs one warning per refused
process.

The key-value operations are those a ``torch.distributed.Store`` needs: set, get (waiting up to
a timeout), add, compare_set, check, delete, num_keys.

**Writes fenced by epoch.** A connection outlives epoch changes, and a rank replaced by the
controller (its lease expired while its node was cut off from etcd only) may keep one open. In
the namespaces whose keys a live rank reads to decide what to load (:func:`fenced`: the job's own
namespace, where standbys advertise their snapshot holders, and ``<job>/snapshots``, the ranks'
snapshot reports), every write (set, add, compare_set, delete) is checked again: against the
daemon's view (``epoch_check``), then in etcd itself, in the transaction that writes: it
compares the job's assignment key with the revision whose epoch was read, so a write lands only
while the assignment is not past the connection's epoch, even when this daemon's view lags
behind etcd (right after a partition heals). A refused write gets an error naming both epochs;
the connection serves on, and reads stay allowed.

Other namespaces are not fenced per write, and must not be: a process group's bootstrap store
(``<job>/<group>/v<n>``) is kept across epochs by the groups a recovery does not rebuild, and
torch may write to it after the epoch moved (NCCL's lazy communicators, its watchdog); a
migration's reports (``<job>/migration/<id>``) are written under the migration's ``from_epoch``
by its survivors and leaver, and the leaver's ``transferred`` may land after the joiner's
``switched`` let the controller commit the new epoch. Those keep the hello's check only.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, NoReturn

from understudy.common import logs
from understudy.common.errors import RecordError, StoreError
from understudy.common.keys import Keys
from understudy.common.records import Assignment
from understudy.common.snapshot_tiers import HOLDER_ID_RE
from understudy.common.sockproto import MAX_LINE, WRITES, Op, decode_value, encode_value, frame
from understudy.common.store import EtcdStore, WatchEvent
from understudy.common.worker_report import WorkerReport
from understudy.daemon.peers import PeerGate

NAMESPACE_RE = re.compile(r"^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$")
MAX_WAIT = 600.0
#: how long a refused connection may take to send its first request, answered with the refusal
REFUSAL_READ_S = 2.0
#: connections served at once; past it a new one is answered "busy" and closed (each can hold a
#: megabyte of buffer and a long poll: a runaway client must not take the daemon's memory)
MAX_CONNECTIONS = 4096


#: a job's namespaces (``<job>/<name>``) whose writes are fenced, beside ``<job>`` itself
FENCED_SUBSPACES = frozenset({"snapshots"})
#: how often a fenced or compare-and-swap write is tried against concurrent changes
_CAS_TRIES = 100


def fenced(namespace: str) -> bool:
    """Whether every write in ``namespace`` is checked against the job's epoch (see the module
    docstring): ``<job>`` (snapshot holders' advertisements) and ``<job>/snapshots``."""
    parts = namespace.split("/")
    return len(parts) == 1 or (len(parts) == 2 and parts[1] in FENCED_SUBSPACES)


class RequestError(ValueError):
    """The worker sent a request the service cannot carry out; the reply says why."""


#: the compares that make a write land only while the job's epoch allows it
Fence = Callable[[], Awaitable[list[tuple[Any, ...]]]]


EpochCheck = Callable[[str, int], str | None]
JobInfo = Callable[[str], dict[str, Any] | None]
#: an event set the next time the jobs' view may have changed
NextView = Callable[[], asyncio.Event]
#: the longest a worker may wait for its job's view to change, in seconds
MAX_JOB_WAIT_S = 60.0
#: (job, warmth or None for a sign of life) from a standby worker's connection
StandbyReport = Callable[[str, dict[str, Any] | None], None]


def _accept_all(namespace: str, epoch: int) -> str | None:
    return None


def _no_jobs(job: str) -> dict[str, Any] | None:
    return None


def job_token(info: dict[str, Any] | None) -> str:
    """A short digest of a job's view: a worker that holds it asks to hear only of changes."""
    text = json.dumps(info, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def _ignore_standby(job: str, warmth: dict[str, Any] | None) -> None:
    return None


#: takes a job's rank's report (``Op.METRICS``)
WorkerReportSink = Callable[[str, WorkerReport], None]


def _ignore_report(job: str, report: WorkerReport) -> None:
    return None


#: the job of the daemon's child with this pid, while it runs (None: no such child)
WorkerJob = Callable[[int], str | None]


def _no_workers(pid: int) -> str | None:
    return None


def _warmth(req: dict[str, Any]) -> dict[str, Any]:
    mode, roles, detail = req.get("mode"), req.get("roles", []), req.get("detail", "")
    if not isinstance(mode, str) or not 0 < len(mode) <= 40:
        raise RequestError("warmth needs a mode: a string of 1-40 characters")
    if not isinstance(roles, list) or len(roles) > 64 or \
            not all(isinstance(r, str) and len(r) <= 40 for r in roles):
        raise RequestError("warmth roles must be a list of at most 64 short strings")
    if not isinstance(detail, str) or len(detail) > 400:
        raise RequestError("warmth detail must be a string of at most 400 characters")
    out: dict[str, Any] = {"mode": mode, "roles": list(roles), "detail": detail}
    rank = req.get("rank")
    if rank is not None:
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < 1 << 20:
            raise RequestError("warmth rank must be a non-negative integer")
        out["rank"] = rank
    holder = req.get("holder")
    if holder is not None:
        if not isinstance(holder, str) or not HOLDER_ID_RE.match(holder):
            raise RequestError("warmth holder must be a holder id (8-64 hex digits)")
        out["holder"] = holder
    return out


class LocalServer:
    """The socket's server. ``socket_group``: the id of the group whose members may connect
    besides the daemon's descendants (None: none); the socket file gets it."""

    def __init__(self, path: Path, store: EtcdStore, keys: Keys, node: str,
                 epoch_check: EpochCheck = _accept_all, job_info: JobInfo = _no_jobs,
                 standby_report: StandbyReport = _ignore_standby,
                 next_view: NextView | None = None, socket_group: int | None = None,
                 worker_report: WorkerReportSink = _ignore_report,
                 worker_job: WorkerJob = _no_workers) -> None:
        self.path, self.store, self.keys = path, store, keys
        self.worker_job = worker_job
        self.max_connections = MAX_CONNECTIONS
        self._foreign: set[tuple[str, str]] = set()  # (job, namespace) refused and logged
        self.epoch_check = epoch_check
        self.job_info = job_info
        quiet = asyncio.Event()  # no jobs' view: nothing ever changes
        self.next_view: NextView = next_view or (lambda: quiet)
        self.standby_report = standby_report
        self.worker_report = worker_report
        self.log = logs.get(node=node)
        self.socket_group = socket_group
        self.gate = PeerGate(socket_group, self.log)
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        # Bound under a name of its own, given its group and mode, and only then renamed into
        # place: no client ever finds the socket with the umask's mode (review L3). The mode is
        # a first gate only: every connection's process is checked (PeerGate).
        # A name no longer than the socket's own: a Unix socket's path has 107 bytes at most.
        staging = self.path.with_name(f".u{os.getpid()}"[:max(2, len(self.path.name))])
        with contextlib.suppress(FileNotFoundError):
            staging.unlink()
        self._server = await asyncio.start_unix_server(self._serve, path=str(staging),
                                                       limit=MAX_LINE)
        if self.socket_group is not None:
            os.chown(staging, -1, self.socket_group)
        staging.chmod(0o660)
        os.replace(staging, self.path)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for t in list(self._conns):
                t.cancel()
            if self._conns:
                await asyncio.wait(self._conns, timeout=2)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 2)
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        if len(self._conns) > self.max_connections:
            try:
                await self._refuse(reader, writer, f"the daemon is serving {self.max_connections} "
                                   "connections already; try again")
            finally:
                self._conns.discard(task)
            return
        refused, worker = self.gate.admit(writer.get_extra_info("socket"))
        # A worker (or a process below it) acts for its own job only (review H3).
        bound = self.worker_job(worker) if worker is not None else None
        if refused is None and worker is not None and bound is None:
            refused = (f"process {worker}, which this connection comes from, is no worker this "
                       "daemon runs now")
        if refused is not None:
            try:
                await self._refuse(reader, writer, refused)
            finally:
                self._conns.discard(task)
            return
        namespace: str | None = None
        epoch = 0  # the hello's
        standby_of: str | None = None  # the job, once this connection reported warmth
        try:
            while True:
                try:
                    line = await reader.readline()
                except (ValueError, ConnectionError):
                    break  # over-long line or peer gone
                if not line:
                    break
                rid: Any = None
                try:
                    req = json.loads(line)
                    if not isinstance(req, dict):
                        raise RequestError("a request must be a JSON object")
                    rid = req.get("id")
                    op = Op(str(req.get("op")))
                    if op == Op.HELLO:
                        namespace, epoch = self._hello(req, bound)
                        reply: dict[str, Any] = {}
                    elif namespace is None:
                        raise RequestError("the first request must be hello")
                    elif op == Op.WARMTH:
                        standby_of = namespace.split("/", 1)[0]
                        self.standby_report(standby_of, _warmth(req))
                        reply = {}
                    elif op == Op.METRICS:
                        self.worker_report(namespace.split("/", 1)[0], WorkerReport.parse(req))
                        reply = {}
                    elif op == Op.JOB:
                        reply = await self._job(namespace.split("/", 1)[0], req)
                    else:
                        fence = self._fence(namespace, epoch) \
                            if op in WRITES and fenced(namespace) else None
                        reply = await self._handle(op, req, self.keys.kv(namespace), fence)
                    if standby_of is not None and op != Op.WARMTH:
                        self.standby_report(standby_of, None)
                    out = {"id": rid, "ok": True, **reply}
                except (RequestError, ValueError, RecursionError) as exc:
                    # RecursionError: JSON nested past the parser's depth (review L3)
                    what = "the request nests too deeply" if isinstance(exc, RecursionError) \
                        else str(exc)
                    out = {"id": rid, "ok": False, "error": what}
                    if namespace is None:
                        writer.write(frame(out))
                        break
                except StoreError as exc:
                    # "retry": the request was fine, etcd did not answer (an outage).
                    out = {"id": rid, "ok": False, "error": f"etcd unavailable: {exc}",
                           "retry": True}
                except Exception as exc:  # a bug: this request fails, the connection serves on
                    self.log.exception("A request on the workers' socket failed.",
                                       namespace=namespace)
                    out = {"id": rid, "ok": False,
                           "error": f"the daemon failed this request: {type(exc).__name__}"}
                writer.write(frame(out))
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._conns.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1)

    async def _refuse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      why: str) -> None:
        """Answer a refused process's first request (or, if it sends none soon, the
        connection) with ``why``, and close. Nothing it sends is acted on."""
        rid: Any = None
        with contextlib.suppress(Exception):  # whatever it sent, it gets the same answer
            line = await asyncio.wait_for(reader.readline(), REFUSAL_READ_S)
            req = json.loads(line)
            rid = req.get("id") if isinstance(req, dict) else None
        try:
            writer.write(frame({"id": rid, "ok": False, "error": why}))
            await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1)

    async def _job(self, job: str, req: dict[str, Any]) -> dict[str, Any]:
        """The job's view and its token; with ``unless`` (a token) and ``timeout`` (seconds),
        answer only once the view's token differs from ``unless``, or when ``timeout`` is over
        (a long poll: a worker hears of a plan as soon as this daemon reads it, and asks
        nothing in between)."""
        unless, wait = req.get("unless"), req.get("timeout", 0)
        if unless is not None and (not isinstance(unless, str) or len(unless) > 64):
            raise RequestError("job: unless must be a token (a string of at most 64 characters)")
        if not isinstance(wait, int | float) or isinstance(wait, bool) \
                or not 0 <= wait <= MAX_JOB_WAIT_S:
            raise RequestError(f"job: timeout must be 0 to {MAX_JOB_WAIT_S:g} seconds")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + float(wait)
        while True:
            changed = self.next_view()  # taken before the read: no change slips in between
            info = self.job_info(job)
            token = job_token(info)
            remaining = deadline - loop.time()
            if unless is None or token != unless or remaining <= 0:
                return {"job": info, "token": token}
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), remaining)

    def _hello(self, req: dict[str, Any], job: str | None) -> tuple[str, int]:
        """The connection's namespace and epoch. ``job``: the job of the worker it comes
        from, whose namespaces alone it may use (None: not a worker's, bound to no job)."""
        ns, epoch = req.get("namespace"), req.get("epoch", 0)
        if not isinstance(ns, str) or not NAMESPACE_RE.match(ns) or len(ns) > 200 \
                or any(part in (".", "..") for part in ns.split("/")):
            raise RequestError(f"namespace {ns!r} is not a valid path of names")
        if job is not None and ns.split("/", 1)[0] != job:
            if (job, ns) not in self._foreign:  # one warning each, however often it asks
                if len(self._foreign) >= 1024:
                    self._foreign.clear()
                self._foreign.add((job, ns))
                self.log.warning("Refused a worker's request for another job's namespace.",
                                 job=job, namespace=ns)
            raise RequestError(f"a worker of job {job!r} may not use namespace {ns!r}")
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise RequestError(f"epoch {epoch!r} is not a non-negative integer")
        refusal = self.epoch_check(ns, epoch)
        if refusal:
            self.log.warning("Refused a worker of a stale epoch.", namespace=ns, epoch=epoch,
                             reason=refusal)
            raise RequestError(f"epoch {epoch} refused: {refusal}")
        return ns, epoch

    def _fence(self, namespace: str, epoch: int) -> Fence:
        """For a write in a fenced namespace: refuse it at once if this daemon's view says the
        job moved past ``epoch``; else return what makes its transaction land only while the
        job's assignment in etcd is the one read now, at ``epoch`` or earlier.

        Raises:
            RequestError: the epoch is fenced out (or the assignment unreadable).
        """
        job = namespace.split("/", 1)[0]
        refusal = self.epoch_check(namespace, epoch)
        if refusal:
            self._refused_write(namespace, epoch, refusal)
        key = self.keys.job_assignment(job)

        async def compare() -> list[tuple[Any, ...]]:
            kv = await self.store.get(key)
            if kv is None:
                return [("mod", key, 0)]  # no such job yet: only while it stays so
            try:
                current = Assignment.decode(kv.value).epoch
            except RecordError as exc:
                self._refused_write(namespace, epoch, f"job {job}'s assignment is unreadable: "
                                                      f"{exc}")
            if current > epoch:
                self._refused_write(namespace, epoch, f"job {job} is at epoch {current}")
            return [("mod", key, kv.mod_revision)]

        return compare

    def _refused_write(self, namespace: str, epoch: int, why: str) -> NoReturn:
        self.log.warning("Refused a write of a stale epoch.", namespace=namespace, epoch=epoch,
                         reason=why)
        raise RequestError(f"a write of epoch {epoch} refused: {why}")

    async def _handle(self, op: Op, req: dict[str, Any], base: str,
                      fence: Fence | None = None) -> dict[str, Any]:
        """Carry out one key-value request under ``base``; a write with a ``fence`` lands only
        in a transaction with its compares (re-read after each lost race)."""
        if op == Op.PING:
            return {}
        if op == Op.NUM_KEYS:
            kvs, _ = await self.store.get_prefix(base)
            return {"count": len(kvs)}
        if op == Op.CHECK:
            keys = _keys_arg(req)
            found = [await self.store.get(base + k) is not None for k in keys]
            return {"present": all(found)}
        key = base + _key_arg(req)
        if op == Op.SET:
            data = _bytes_arg(req, "value")
            if fence is None:
                await self.store.put(key, data)
                return {}
            for _ in range(_CAS_TRIES):
                if await self.store.txn(compare=await fence(),
                                        success=[("put", key, data, None)]):
                    return {}
            raise StoreError("a write kept losing its race with changes of the job's assignment")
        if op == Op.GET:
            value = await self._get_waiting(key, _timeout_arg(req))
            if value is None:
                raise RequestError(f"key {req['key']!r} did not appear within the timeout")
            return {"value": encode_value(value)}
        if op == Op.DELETE:
            if fence is None:
                return {"deleted": await self.store.delete(key)}
            return {"deleted": await self._fenced_delete(key, fence)}
        if op == Op.ADD:
            return {"value": await self._add(key, req.get("amount"), fence)}
        if op == Op.COMPARE_SET:
            value = await self._compare_set(key, _bytes_arg(req, "expected"),
                                            _bytes_arg(req, "desired"), fence)
            return {"value": encode_value(value)}
        raise RequestError(f"unknown op {op!r}")

    async def _cas(self, key: str, value: bytes, mod_revision: int,
                   fence: Fence | None) -> bool:
        if fence is None:
            return await self.store.cas(key, value, mod_revision)
        return await self.store.txn(compare=[("mod", key, mod_revision), *await fence()],
                                    success=[("put", key, value, None)])

    async def _fenced_delete(self, key: str, fence: Fence) -> bool:
        for _ in range(_CAS_TRIES):
            compare = await fence()
            kv = await self.store.get(key)
            if kv is None:
                return False
            if await self.store.txn(compare=[("mod", key, kv.mod_revision), *compare],
                                    success=[("delete", key)]):
                return True
        raise StoreError("delete kept losing its race with changes of the job's assignment")

    async def _add(self, key: str, amount: Any, fence: Fence | None = None) -> int:
        if not isinstance(amount, int) or isinstance(amount, bool):
            raise RequestError(f"add needs an integer amount, got {amount!r}")
        for _ in range(_CAS_TRIES):
            kv = await self.store.get(key)
            try:
                current = int(kv.value) if kv else 0
            except ValueError:
                raise RequestError(f"key {key!r} does not hold an integer") from None
            if await self._cas(key, str(current + amount).encode(),
                               kv.mod_revision if kv else 0, fence):
                return current + amount
        raise StoreError("add kept losing its compare-and-swap race")

    async def _compare_set(self, key: str, expected: bytes, desired: bytes,
                           fence: Fence | None = None) -> bytes:
        """torch Store semantics: set ``desired`` if the value is ``expected`` (empty:
        absent); return the value now stored, or ``expected`` for an absent key."""
        for _ in range(_CAS_TRIES):
            kv = await self.store.get(key)
            matches = kv.value == expected if kv is not None else expected == b""
            if not matches:
                return expected if kv is None else kv.value
            if await self._cas(key, desired, kv.mod_revision if kv else 0, fence):
                return desired
        raise StoreError("compare_set kept losing its compare-and-swap race")

    async def _get_waiting(self, key: str, timeout: float) -> bytes | None:
        kvs, rev = await self.store.get_prefix(key)
        for kv in kvs:
            if kv.key == key:
                return kv.value
        if timeout <= 0:
            return None
        done = asyncio.Event()
        found: list[bytes] = []

        async def watch() -> None:
            async for ev in self.store.watch_prefix(key, rev + 1, done):
                if isinstance(ev, WatchEvent) and ev.kv.key == key and ev.kind == "put":
                    found.append(ev.kv.value)
                    done.set()

        task = asyncio.create_task(watch(), name=f"kv-wait {key}")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), timeout)
        done.set()
        await asyncio.wait({task}, timeout=2)
        return found[0] if found else None


def _key_arg(req: dict[str, Any]) -> str:
    key = req.get("key")
    if not isinstance(key, str) or not key or len(key) > 1024 or "\x00" in key:
        raise RequestError(f"key {key!r} must be a non-empty string of at most 1024 characters")
    return key


def _keys_arg(req: dict[str, Any]) -> list[str]:
    keys = req.get("keys")
    if not isinstance(keys, list) or not keys:
        raise RequestError("keys must be a non-empty list")
    return [_key_arg({"key": k}) for k in keys]


def _bytes_arg(req: dict[str, Any], name: str) -> bytes:
    raw = req.get(name)
    if not isinstance(raw, str):
        raise RequestError(f"{name} must be a base64 string")
    try:
        return decode_value(raw)
    except ValueError:
        raise RequestError(f"{name} is not valid base64") from None


def _timeout_arg(req: dict[str, Any]) -> float:
    t = req.get("timeout", 0)
    if not isinstance(t, int | float) or isinstance(t, bool) or not 0 <= t <= MAX_WAIT:
        raise RequestError(f"timeout must be between 0 and {MAX_WAIT} seconds, got {t!r}")
    return float(t)
