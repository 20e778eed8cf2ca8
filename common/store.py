"""The one place that talks to etcd: a thin async layer over aetcd.

Contract (tests/integration/test_store.py checks it against a real etcd):
- every call is bounded by ``EtcdConfig.timeout`` and raises :class:`StoreError` on failure;
- writes that depend on what was read are compare-and-swap on the key's mod revision and return
  ``False`` when the race is lost (losing is normal, not an error);
- a keep-alive on an expired lease returns TTL 0 (etcd says so; it does not raise);
- a watch resumes from the revision after the last event it delivered when its stream breaks,
  and yields :data:`RESYNC` when that revision was compacted, so the caller re-lists.

With several endpoints, a connection failure moves the client to the next endpoint. TLS with
client certificates and etcd users/roles are supported (aetcd itself only opens plaintext
channels, so the secure channel is opened here).

Certificates are read again when their files change (looked at, by a stat of each, at most
every :data:`TLS_CHECK_S` seconds, at the next call): a CA, certificate and key that load
together replace the old ones and the connection is opened again with them, so rotating them
takes no restart (and no drain). A new set that does not load (a certificate written but its
key not yet) is logged once and the old one kept, until the files change again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

# grpc's C core prints its own error lines to stderr (TLS failures, reconnects); the daemon and
# the CLI report those failures themselves, in one sentence. Must be set before grpc loads.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

import aetcd
import aetcd.exceptions as aexc
import aetcd.watcher
import grpc
from aetcd import rpc
from aetcd.utils import prefix_range_end

from understudy.common import logs
from understudy.common.backoff import Backoff
from understudy.common.config import EtcdConfig
from understudy.common.errors import StoreError

_MAX_MESSAGE = 8 * 1024 * 1024
#: Keys one page of a range read asks for. A page whose values pass ``_MAX_MESSAGE`` is asked for
#: again at half the count, down to one key (etcd caps a request, so one value, at 1.5 MiB unless
#: ``--max-request-bytes`` says otherwise).
_PAGE_KEYS = 1000
#: Times a paged read starts again when etcd compacted its revision between two pages.
_COMPACTED_RETRIES = 3


@dataclass(frozen=True)
class KV:
    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int


@dataclass(frozen=True)
class WatchEvent:
    kind: str  # "put" or "delete"
    kv: KV


class _Resync:
    def __repr__(self) -> str:
        return "RESYNC"


#: Yielded by :meth:`EtcdStore.watch_prefix` when events were lost to compaction: re-list.
RESYNC = _Resync()


class _Client(aetcd.Client):
    """aetcd's client with an optional TLS channel (client certificate and CA), and one
    long-lived keep-alive stream (:meth:`keep_alive`)."""

    def __init__(self, *args: Any, credentials: grpc.ChannelCredentials | None = None,
                 **kwargs: Any) -> None:
        self._credentials = credentials
        self._lease_stream: Any = None
        self._lease_lock = asyncio.Lock()
        super().__init__(*args, **kwargs)

    async def keep_alive(self, lease_id: int) -> int:
        """Refresh ``lease_id`` over this client's one LeaseKeepAlive stream, opened at the
        first call and kept open, as etcd's own clients do (aetcd's ``refresh_lease`` opens a
        stream per keep-alive: 0.70 ms of this process's CPU a keep-alive against 0.24 on one
        stream, measured against a real etcd). Returns the TTL etcd granted, 0 if the lease
        has expired.

        One request, then its reply, one call at a time. A call that fails or is cut short
        (its caller's timeout) closes the stream, and the next call opens a new one: a reply
        that comes late is never read as the answer to a later request. A stream that ends
        without a reply is an error, not an expired lease (that takes etcd's word, TTL 0)."""
        await self.connect()
        async with self._lease_lock:
            stream = self._lease_stream
            if stream is None or stream.done():
                stream = self._lease_stream = self.leasestub.LeaseKeepAlive(
                    metadata=self.metadata)
            answered = False
            try:
                await stream.write(rpc.LeaseKeepAliveRequest(ID=lease_id))
                reply = await stream.read()
                if reply is grpc.aio.EOF:
                    raise aexc.ClientError("etcd closed the keep-alive stream without an "
                                           "answer")
                answered_for = int(reply.ID)
                if answered_for != lease_id:
                    raise aexc.ClientError(f"etcd answered a keep-alive of lease {lease_id} "
                                           f"for lease {answered_for}")
                answered = True
                return max(0, int(reply.TTL))
            except grpc.aio.AioRpcError as exc:
                aexc._handle_exception(exc)
                raise  # not reached: _handle_exception always raises
            except (grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
                raise aexc.ClientError(f"the keep-alive stream broke: {exc}") from exc
            finally:
                if not answered:
                    self._lease_stream = None
                    stream.cancel()

    async def connect(self) -> None:
        if self._credentials is None:
            await super().connect()
            return
        if self._connected.is_set():
            return
        target = f"{self._host}:{self._port}"
        self.channel = rpc.secure_channel(target, self._credentials,
                                          options=list(self._options.items()))
        try:
            if self._username is not None:
                self.auth_stub = rpc.AuthStub(self.channel)
                resp = await self.auth_stub.Authenticate(
                    rpc.AuthenticateRequest(name=self._username, password=self._password),
                    timeout=self._timeout,
                )
                self.metadata = (("token", resp.token),)
        except grpc.aio.AioRpcError as exc:
            await self.channel.close()
            self._init_channel_attrs()
            raise aexc._EXCEPTIONS_BY_CODE.get(exc.code(), aexc.ClientError)(
                exc.details()
            ) from exc
        self.kvstub = rpc.KVStub(self.channel)
        self.clusterstub = rpc.ClusterStub(self.channel)
        self.leasestub = rpc.LeaseStub(self.channel)
        self.maintenancestub = rpc.MaintenanceStub(self.channel)
        self._watcher = aetcd.watcher.Watcher(
            rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata
        )
        self._connected.set()

    async def range_page(self, start: bytes, end: bytes, limit: int, revision: int,
                         keys_only: bool) -> Any:
        """One page of a range read: at most ``limit`` keys from ``start`` on, as of
        ``revision`` (0: the newest). aetcd's own reads take neither a limit nor a revision."""
        await self.connect()
        request = rpc.RangeRequest(key=start, range_end=end, limit=limit, revision=revision,
                                   keys_only=keys_only)
        try:
            return await self.kvstub.Range(request, timeout=self._timeout,
                                           metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            details = exc.details() or ""
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details:
                raise _PageTooLarge(details) from exc
            if exc.code() == grpc.StatusCode.OUT_OF_RANGE and "compacted" in details:
                raise _Compacted(details) from exc
            aexc._handle_exception(exc)
            raise  # not reached: _handle_exception always raises


class _PageTooLarge(Exception):
    """A page's reply passed the client's message cap."""


class _Compacted(Exception):
    """The revision a paged read started at was compacted before its last page."""


def _kv(raw: Any) -> KV:
    return KV(
        key=raw.key.decode("utf-8", "replace"),
        value=bytes(raw.value),
        mod_revision=raw.mod_revision,
        create_revision=raw.create_revision,
        lease=raw.lease,
    )


def prefix_end(prefix: str) -> bytes:
    return aetcd.utils.prefix_range_end(prefix.encode())


#: Seconds between two looks at the TLS files' stat (at the next call after it).
TLS_CHECK_S = 10.0

_TlsSignature = tuple[tuple[int, int, int] | None, ...]


class EtcdStore:
    """An etcd client for one process. Not shared across processes (grpc is not fork-safe)."""

    def __init__(self, cfg: EtcdConfig, on_request: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self._endpoint_index = 0
        self._client: _Client | None = None
        self._on_request = on_request or (lambda op: None)
        self._tls_seen = self._tls_signature()
        self._tls_refused: _TlsSignature | None = None
        self._tls_checked = time.monotonic()
        self._credentials = self._load_credentials(cfg)
        self._closing: set[asyncio.Task[None]] = set()

    @staticmethod
    def _load_credentials(cfg: EtcdConfig) -> grpc.ChannelCredentials | None:
        """The channel credentials of ``cfg``'s TLS files, which must load together (the key
        is the certificate's, the CA is a certificate): grpc would only find out at the
        handshake, as a refused connection."""
        if not cfg.tls:
            return None
        try:
            ca = cfg.ca.read_bytes() if cfg.ca else None
            cert = cfg.cert.read_bytes() if cfg.cert else None
            key = cfg.key.read_bytes() if cfg.key else None
            check = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            if ca is not None:
                check.load_verify_locations(cadata=ca.decode("ascii", "replace"))
            if cfg.cert and cfg.key:
                check.load_cert_chain(cfg.cert, cfg.key)
        except ssl.SSLError as exc:
            raise StoreError(f"the etcd TLS files do not load together ({exc.reason or exc}): "
                             "check that etcd.key is etcd.cert's key and etcd.ca a "
                             "certificate") from exc
        except OSError as exc:
            raise StoreError(f"cannot read etcd TLS file {exc.filename!r}: {exc.strerror}") from exc
        return grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=cert
        )

    def _tls_signature(self) -> _TlsSignature:
        """What identifies the TLS files' current contents without reading them: device,
        inode and change time of each (a rename over the file, or a write into it, changes
        it)."""
        out: list[tuple[int, int, int] | None] = []
        for path in (self.cfg.ca, self.cfg.cert, self.cfg.key):
            try:
                st = os.stat(path) if path is not None else None
            except OSError:
                st = None
            out.append(None if st is None else (st.st_dev, st.st_ino, st.st_ctime_ns))
        return tuple(out)

    async def _reload_if_rotated(self) -> None:
        """Load the TLS files again if they changed since they were loaded (looked at every
        :data:`TLS_CHECK_S` at most), and connect with them from the next call."""
        if not self.cfg.tls or time.monotonic() - self._tls_checked < TLS_CHECK_S:
            return
        self._tls_checked = time.monotonic()
        seen = self._tls_signature()
        if seen == self._tls_seen or seen == self._tls_refused:
            return
        log = logs.get(component="etcd")
        try:
            credentials = self._load_credentials(self.cfg)
        except StoreError as exc:
            self._tls_refused = seen
            log.warning(f"The etcd TLS files changed but do not load: {exc}. Keeping the ones "
                        "loaded before.")
            return
        self._tls_seen, self._tls_refused, self._credentials = seen, None, credentials
        log.info("The etcd TLS files changed: connecting with the new ones.")
        await self.reset()

    @property
    def endpoint(self) -> str:
        return str(self.cfg.endpoints[self._endpoint_index])

    def _new_client(self) -> _Client:
        ep = self.cfg.endpoints[self._endpoint_index]
        return _Client(
            host=ep.host,
            port=ep.port,
            username=self.cfg.user,
            password=self.cfg.password,
            timeout=max(1, int(self.cfg.timeout + 0.999)),
            credentials=self._credentials,
            options={
                "grpc.max_receive_message_length": _MAX_MESSAGE,
                # Detect a dead server under a call that waits (a watch: partitions send no
                # reset); a unary call has its own deadline. Within etcd's default keep-alive
                # policy (--grpc-keepalive-min-time 5 s, no pings without a call): a client
                # that pinged every 2 s, with or without calls, was sent GOAWAY
                # "too_many_pings" once idle for some 8 s, and its next call failed with
                # "Stream removed" (a benchmark's harness, waiting on log lines for a minute).
                "grpc.keepalive_time_ms": 5000,
                "grpc.keepalive_timeout_ms": 1000,
                "grpc.keepalive_permit_without_calls": 0,
                "grpc.initial_reconnect_backoff_ms": 100,
                "grpc.max_reconnect_backoff_ms": 1000,
            },
        )

    async def _get_client(self) -> _Client:
        if self._client is None:
            client = self._new_client()
            try:
                await asyncio.wait_for(client.connect(), self.cfg.timeout)
            except (aexc.ClientError, TimeoutError, grpc.aio.AioRpcError) as exc:
                with contextlib.suppress(Exception):
                    await client.close()
                self._rotate()
                raise StoreError(f"cannot connect to etcd at {self.endpoint}: {exc}") from exc
            self._client = client
        return self._client

    def _rotate(self) -> None:
        if len(self.cfg.endpoints) > 1:
            self._endpoint_index = (self._endpoint_index + 1) % len(self.cfg.endpoints)

    async def reset(self) -> None:
        """Drop the connection; the next call reconnects (to the next endpoint, if any).

        The old channel is closed in the background: closing a channel to a partitioned server
        can block, and aetcd's watcher swallows cancellation, so ``wait_for`` would hang too.
        """
        client, self._client = self._client, None
        if client is not None:
            closing = asyncio.create_task(_close_quietly(client), name="etcd-close")
            closing.add_done_callback(lambda t: t.cancelled() or t.exception())
            self._closing.add(closing)
            self._closing = {t for t in self._closing if not t.done()}

    async def close(self) -> None:
        await self.reset()
        if self._closing:
            await asyncio.wait(self._closing, timeout=self.cfg.timeout)
        for t in self._closing:
            t.cancel()
        self._closing.clear()

    async def _call(self, op: str, fn: Callable[[_Client], Any], timeout: float | None = None
                    ) -> Any:
        # A member that refuses the connection never saw the request: the next one is asked at
        # once (a CLI run, a fresh store, must not fail because the first endpoint is down).
        for _ in range(len(self.cfg.endpoints) - 1):
            try:
                return await self._call_once(op, fn, timeout)
            except _Refused:
                continue
        try:
            return await self._call_once(op, fn, timeout)
        except _Refused as exc:
            raise StoreError(str(exc)) from exc.__cause__

    async def _call_once(self, op: str, fn: Callable[[_Client], Any],
                         timeout: float | None) -> Any:
        self._on_request(op)
        await self._reload_if_rotated()
        client = await self._get_client()
        try:
            return await asyncio.wait_for(fn(client), timeout or self.cfg.timeout)
        except aexc.UnauthenticatedError as exc:
            # The auth token expired (etcd's simple tokens last minutes): log in again next call.
            await self.reset()
            raise StoreError(f"etcd {op} was refused: {exc}") from exc
        except (aexc.ConnectionFailedError, aexc.ConnectionTimeoutError, TimeoutError) as exc:
            failed_at = self.endpoint
            self._rotate()
            await self.reset()
            hint = (" (with TLS: check etcd.ca, and that etcd trusts the client certificate)"
                    if self.cfg.tls and "TSI_" in str(exc) else "")
            message = f"etcd {op} failed at {failed_at}: {exc or 'timed out'}{hint}"
            if isinstance(exc, aexc.ConnectionFailedError):
                raise _Refused(message) from exc
            raise StoreError(message) from exc
        except (aexc.ClientError, grpc.aio.AioRpcError) as exc:
            raise StoreError(f"etcd {op} failed: {exc}") from exc
        except asyncio.CancelledError:
            _reraise_if_we_are_cancelled()
            # grpc cancels calls on a channel that was closed under them (reset()): that is a
            # failed request, not a request to stop this task.
            raise StoreError(f"etcd {op} was cut off by a closed connection") from None

    # -- reads ------------------------------------------------------------------------------

    async def get(self, key: str) -> KV | None:
        res = await self._call("get", lambda c: c.get(key.encode()))
        return None if res is None else _kv(res)

    async def get_prefix(self, prefix: str) -> tuple[list[KV], int]:
        """All keys under ``prefix`` and the store revision they were read at.

        Read in pages, every page at the first one's revision: one consistent snapshot of any
        size, where one range would fail once its reply passed the 8 MiB message cap (the
        security review's H7: some 9 MB of values under ``kv/`` stopped every controller
        round)."""
        raws, revision = await self._paged(prefix, keys_only=False)
        return [_kv(kv) for kv in raws], revision

    async def keys(self, prefix: str) -> list[str]:
        """The keys under ``prefix``, without their values (paged as :meth:`get_prefix`)."""
        raws, _ = await self._paged(prefix, keys_only=True)
        return [kv.key.decode() for kv in raws]

    async def _paged(self, prefix: str, keys_only: bool) -> tuple[list[Any], int]:
        end = prefix_end(prefix)
        for _ in range(_COMPACTED_RETRIES):
            try:
                return await self._pages(prefix.encode(), end, keys_only)
            except _Compacted:
                continue  # etcd compacted the snapshot's revision between two pages: again
        raise StoreError(f"etcd range {prefix!r}: its revision was compacted before the last "
                         f"page was read, {_COMPACTED_RETRIES} times in a row")

    async def _pages(self, start: bytes, end: bytes, keys_only: bool) -> tuple[list[Any], int]:
        out: list[Any] = []
        revision = 0  # the first page's: every later page reads the same snapshot
        limit = _PAGE_KEYS
        while True:
            try:
                res = await self._range_page(start, end, limit, revision, keys_only)
            except _PageTooLarge as exc:
                if limit == 1:
                    raise StoreError(f"etcd range: one value is larger than the client's "
                                     f"{_MAX_MESSAGE} B message cap: {exc}") from exc
                limit = max(1, limit // 2)
                continue
            revision = revision or res.header.revision
            out.extend(res.kvs)
            if not res.more or not res.kvs:
                return out, revision
            start = res.kvs[-1].key + b"\x00"  # the next key after the page's last

    async def _range_page(self, start: bytes, end: bytes, limit: int, revision: int,
                          keys_only: bool) -> Any:
        return await self._call(
            "range", lambda c: c.range_page(start, end, limit, revision, keys_only))

    async def current_revision(self) -> int:
        """The store's revision now (a read of an empty range: no values cross the wire)."""
        # Inside the cluster prefix: a role limited to the prefix may read nothing else.
        _, rev = await self.get_prefix(f"{self.cfg.prefix}/\x00revision-probe")
        return rev

    # -- writes -----------------------------------------------------------------------------

    async def put(self, key: str, value: bytes, lease: int | None = None) -> int:
        res = await self._call("put", lambda c: c.put(key.encode(), value, lease=lease))
        revision: int = res.header.revision
        return revision

    async def cas(self, key: str, value: bytes, mod_revision: int, lease: int | None = None
                  ) -> bool:
        """Write ``key`` only if its mod revision is still ``mod_revision`` (0: only if absent)."""
        return await self.txn(
            compare=[("mod", key, mod_revision)], success=[("put", key, value, lease)]
        )

    async def delete(self, key: str, mod_revision: int | None = None) -> bool:
        """Delete ``key``; with ``mod_revision``, only if it is unchanged. True if deleted."""
        if mod_revision is None:
            res = await self._call("delete", lambda c: c.delete(key.encode()))
            return res is not None
        return await self.txn(compare=[("mod", key, mod_revision)], success=[("delete", key)])

    async def delete_prefix(self, prefix: str) -> None:
        await self._call("delete", lambda c: c.delete_prefix(prefix.encode()))

    async def txn(self, compare: list[tuple[Any, ...]], success: list[tuple[Any, ...]],
                  failure: list[tuple[Any, ...]] | None = None) -> bool:
        """One etcd transaction. Compares: ``("mod"|"create"|"version", key, n)`` or
        ``("value", key, bytes)``; ops: ``("put", key, value, lease)``, ``("delete", key)`` or
        ``("delete-prefix", prefix)``. Returns whether the compares held."""

        def build(c: _Client) -> Any:
            t = c.transactions
            cmp = []
            for kind, key, n in compare:
                target = {"mod": t.mod, "create": t.create, "version": t.version,
                          "value": t.value}[kind](key.encode())
                cmp.append(target == n)

            def ops(items: list[tuple[Any, ...]] | None) -> list[Any]:
                out = []
                for item in items or []:
                    if item[0] == "put":
                        out.append(t.put(item[1].encode(), item[2], lease=item[3]))
                    elif item[0] == "delete":
                        out.append(t.delete(item[1].encode()))
                    elif item[0] == "delete-prefix":
                        prefix = item[1].encode()
                        out.append(t.delete(prefix, range_end=prefix_range_end(prefix)))
                    else:
                        raise ValueError(f"unknown transaction op {item[0]!r}")
                return out

            return c.transaction(compare=cmp, success=ops(success), failure=ops(failure))

        succeeded, _ = await self._call("txn", build)
        return bool(succeeded)

    # -- leases -----------------------------------------------------------------------------

    async def grant(self, ttl: int) -> int:
        lease = await self._call("lease_grant", lambda c: c.lease(ttl))
        lease_id: int = lease.id
        return lease_id

    async def keepalive(self, lease_id: int) -> int:
        """Refresh a lease; returns the TTL etcd granted, 0 if the lease has expired."""
        ttl: int = await self._call("lease_keepalive", lambda c: c.keep_alive(lease_id))
        return ttl

    async def revoke(self, lease_id: int) -> None:
        await self._call("lease_revoke", lambda c: c.revoke_lease(lease_id))

    # -- watches ----------------------------------------------------------------------------

    async def watch_prefix(
        self, prefix: str, start_revision: int, stop: asyncio.Event, retry_delay: float = 0.2
    ) -> AsyncGenerator[WatchEvent | _Resync, None]:
        """Events under ``prefix`` from ``start_revision`` on, until ``stop`` is set.

        A broken stream is resumed from the revision after the last delivered event; if that
        revision was compacted, :data:`RESYNC` is yielded and the watch restarts at the current
        revision (the caller must re-list to catch up). Never raises for etcd being down: it
        tries again within ``retry_delay`` seconds, then later (jittered, up to a second), so
        that a fleet's watches do not all come back to etcd in the same instant.
        """
        next_rev = start_revision
        backoff = Backoff(first=retry_delay, cap=max(retry_delay, 1.0))
        while not stop.is_set():
            watch = None
            try:
                self._on_request("watch")
                client = await self._get_client()
                watch = await asyncio.wait_for(
                    client.watch_prefix(prefix.encode(), start_revision=next_rev),
                    self.cfg.timeout,
                )
                backoff.reset()
                # aetcd's cancel() ends its iterator cleanly: cancel when stop is set.
                canceller = asyncio.create_task(_cancel_when(stop, watch), name="watch-cancel")
                try:
                    async for ev in watch:
                        kv = _kv(ev.kv)
                        next_rev = kv.mod_revision + 1
                        yield WatchEvent("put" if ev.kind == "PUT" else "delete", kv)
                        if stop.is_set():
                            break
                finally:
                    canceller.cancel()
                if not stop.is_set():
                    raise StoreError("the watch stream ended")
            except aexc.RevisionCompactedError as exc:
                next_rev = 0
                with contextlib.suppress(Exception):
                    next_rev = await self.current_revision() + 1
                del exc
                yield RESYNC
            except (aexc.ClientError, StoreError, TimeoutError, grpc.aio.AioRpcError,
                    asyncio.CancelledError) as exc:
                if isinstance(exc, asyncio.CancelledError):
                    _reraise_if_we_are_cancelled()
                await self.reset()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), backoff.next())
            finally:
                if watch is not None:
                    await bounded(watch.cancel(), self.cfg.timeout)


def _reraise_if_we_are_cancelled() -> None:
    task = asyncio.current_task()
    if task is None or task.cancelling():
        raise asyncio.CancelledError


async def _cancel_when(stop: asyncio.Event, watch: Any) -> None:
    await stop.wait()
    with contextlib.suppress(Exception):
        await watch.cancel()


async def _close_quietly(client: _Client) -> None:
    with contextlib.suppress(Exception):
        await client.close()


async def bounded(coro: Any, timeout: float) -> None:
    """Run ``coro`` for at most ``timeout`` seconds without ever blocking past that, even if it
    ignores cancellation (it is cancelled and left to finish on its own)."""
    task = asyncio.ensure_future(coro)
    # Retrieved whenever it ends: failures of cleanup calls are not interesting.
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    done, _ = await asyncio.wait({task}, timeout=timeout)
    if not done:
        task.cancel()


class _Refused(StoreError):
    """No connection could be made: the request never reached etcd (safe to send elsewhere)."""


async def wait_any(events: tuple[asyncio.Event, ...], timeout: float) -> None:
    """Return when any of ``events`` is set or ``timeout`` seconds have passed."""
    waiters = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
