"""The etcd store contract, against a real etcd server."""

from __future__ import annotations

import asyncio
import socket
import urllib.request
from pathlib import Path

import pytest

from understudy.common import config
from understudy.common import store as store_module
from understudy.common.errors import StoreError
from understudy.common.store import RESYNC, EtcdStore, WatchEvent
from understudy.testing.embedded_etcd import EmbeddedEtcd, free_port


def _store(endpoints: str, **etcd: object) -> EtcdStore:
    cfg = config.load(overrides={"etcd.endpoints": endpoints, **{f"etcd.{k}": v for k, v in
                                                                  etcd.items()}},
                      environ={}, require_node=False)
    return EtcdStore(cfg.etcd)


def test_cas_create_update_and_lost_race(etcd: EmbeddedEtcd) -> None:
    async def run() -> None:
        s = _store(etcd.endpoint)
        assert await s.cas("/t/a", b"1", 0)
        assert not await s.cas("/t/a", b"2", 0), "create-if-absent must lose on an existing key"
        kv = await s.get("/t/a")
        assert kv is not None and kv.value == b"1"
        assert await s.cas("/t/a", b"2", kv.mod_revision)
        assert not await s.cas("/t/a", b"3", kv.mod_revision), "stale revision must lose"
        got = await s.get("/t/a")
        assert got is not None and got.value == b"2"
        assert not await s.delete("/t/a", kv.mod_revision)
        assert await s.delete("/t/a", got.mod_revision)
        assert await s.get("/t/a") is None
        await s.close()

    asyncio.run(run())


def test_lease_binds_keys_and_expired_keepalive_returns_zero(etcd: EmbeddedEtcd) -> None:
    async def run() -> None:
        s = _store(etcd.endpoint)
        lease = await s.grant(1)
        await s.put("/t/alive", b"x", lease=lease)
        assert await s.keepalive(lease) >= 1
        await s.revoke(lease)
        assert await s.get("/t/alive") is None
        assert await s.keepalive(lease) == 0
        await s.close()

    asyncio.run(run())


def _keepalive_streams(etcd: EmbeddedEtcd) -> float:
    """LeaseKeepAlive streams etcd has opened so far (its ``grpc_server_started_total``)."""
    with urllib.request.urlopen(etcd.metrics_url, timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("grpc_server_started_total{") and \
                    'grpc_method="LeaseKeepAlive"' in line:
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_keepalives_share_one_stream_and_a_frozen_or_restarted_etcd_replaces_it(
        etcd: EmbeddedEtcd) -> None:
    """One LeaseKeepAlive stream carries every keep-alive, each answered for its own lease; a
    keep-alive cut short by a frozen etcd fails (StoreError) and the reply that comes late is
    never taken for a later request's; a restart breaks the stream and a new one takes over;
    an expired lease still reads TTL 0 on a stream that is open."""
    async def run() -> None:
        s = _store(etcd.endpoint, timeout=1.0)
        short, long = await s.grant(5), await s.grant(60)
        opened = _keepalive_streams(etcd)
        for _ in range(10):
            assert 1 <= await s.keepalive(short) <= 5
            assert 5 < await s.keepalive(long) <= 60
        assert _keepalive_streams(etcd) - opened == 1

        etcd.pause()
        try:
            with pytest.raises(StoreError):
                await s.keepalive(short)
        finally:
            etcd.resume()
        for _ in range(3):  # the late reply (TTL <= 5) is not this request's answer
            assert 5 < await s.keepalive(long) <= 60

        await asyncio.to_thread(etcd.stop)
        await asyncio.to_thread(etcd.start)
        for _ in range(50):
            try:
                assert 5 < await s.keepalive(long) <= 60
                break
            except StoreError:
                await asyncio.sleep(0.1)
        else:
            raise AssertionError("no keep-alive got through after the restart")
        await s.revoke(short)
        assert await s.keepalive(short) == 0
        assert 5 < await s.keepalive(long) <= 60
        await s.close()

    asyncio.run(run())


def test_watch_resumes_after_etcd_restart(etcd: EmbeddedEtcd) -> None:
    async def run() -> None:
        s = _store(etcd.endpoint)
        w = _store(etcd.endpoint)
        _, rev = await s.get_prefix("/t/")
        stop = asyncio.Event()
        seen: list[str] = []

        async def consume() -> None:
            async for ev in w.watch_prefix("/t/", rev + 1, stop, retry_delay=0.05):
                assert isinstance(ev, WatchEvent)
                seen.append(ev.kv.key)
                if len(seen) == 3:
                    stop.set()

        task = asyncio.create_task(consume())
        await s.put("/t/1", b"a")
        while not seen:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(etcd.stop)
        await asyncio.sleep(0.3)
        await asyncio.to_thread(etcd.start)
        for _ in range(50):
            try:
                await s.put("/t/2", b"b")
                break
            except StoreError:
                await asyncio.sleep(0.1)
        await s.put("/t/3", b"c")
        await asyncio.wait_for(task, 15)
        assert seen == ["/t/1", "/t/2", "/t/3"], "no event lost or repeated across the restart"
        await s.close()
        await w.close()

    asyncio.run(run())


def test_watch_reports_resync_after_compaction(etcd: EmbeddedEtcd) -> None:
    async def run() -> None:
        s = _store(etcd.endpoint)
        _, rev = await s.get_prefix("/t/")
        for i in range(5):
            await s.put(f"/t/{i}", b"x")
        client = await s._get_client()
        _, now = await s.get_prefix("/t/")
        await client.compact(now)
        stop = asyncio.Event()
        async for ev in s.watch_prefix("/t/", rev + 1, stop):
            assert ev is RESYNC
            stop.set()
        await s.close()

    asyncio.run(run())


def test_unreachable_etcd_is_a_store_error_within_the_timeout() -> None:
    async def run() -> None:
        s = _store("127.0.0.1:1", timeout=0.3)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(StoreError):
            await s.get("/t/x")
        assert loop.time() - t0 < 2.0
        await s.close()

    asyncio.run(run())


def test_embedded_etcd_picks_new_ports_when_one_is_taken_before_it_binds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The port picked for the peer listener is taken by another process before etcd binds it
    # (a real socket holds it): etcd exits with "address already in use", and the start is
    # tried again on fresh picks.
    from understudy.testing import embedded_etcd

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        picks = iter([embedded_etcd.free_port(), taken.getsockname()[1]])
        real = embedded_etcd.free_port
        monkeypatch.setattr(embedded_etcd, "free_port",
                            lambda host="127.0.0.1": next(picks, None) or real(host))
        e = EmbeddedEtcd(data_dir=tmp_path / "etcd").start()
        try:
            assert e.healthy() and e.peer_port != taken.getsockname()[1]
            assert "address already in use" in (tmp_path / "etcd" / "etcd.log").read_text()
        finally:
            e.cleanup()


def test_a_refused_endpoint_is_skipped_within_the_same_call(etcd: EmbeddedEtcd) -> None:
    # The first endpoint listed is down (nothing listens): a fresh store, as every CLI run
    # makes, still answers at once from the next one instead of failing its first request.
    # A port of free_port's pool: no other process is given it meanwhile (a port the kernel
    # picked and let go could be bound again by a daemon of a parallel test).
    dead = f"127.0.0.1:{free_port()}"

    async def run() -> None:
        st = _store(f"{dead},{etcd.endpoint}")
        try:
            await st.put("/t/k", b"v")
            kv = await st.get("/t/k")
            assert kv is not None and kv.value == b"v"
        finally:
            await st.close()
        lone = _store(dead)
        try:
            with pytest.raises(StoreError, match=f"failed at {dead}"):
                await lone.get("/t/k")
        finally:
            await lone.close()

    asyncio.run(run())


def test_a_prefix_past_the_message_cap_is_read_whole_in_pages(etcd: EmbeddedEtcd) -> None:
    # The security review's H7: 13 values of 700 KiB under one prefix, 9.1 MB in all, made a
    # single range fail at the client's 8 MiB cap ("Received message larger than max"), and
    # with it every controller round.
    value = bytes(range(256)) * (700 * 4)

    async def run() -> None:
        s = _store(etcd.endpoint)
        try:
            for i in range(13):
                await s.put(f"/t/big/{i:02d}", value)
            client = await s._get_client()
            with pytest.raises(Exception, match="larger than max"):
                await client.get_prefix(b"/t/big/")  # one range, as before
            kvs, rev = await s.get_prefix("/t/big/")
            assert [kv.key for kv in kvs] == [f"/t/big/{i:02d}" for i in range(13)]
            assert all(kv.value == value for kv in kvs)
            assert rev == await s.current_revision()
            assert await s.keys("/t/big/") == [kv.key for kv in kvs]
        finally:
            await s.close()

    asyncio.run(run())


class _WritesBetweenPages(EtcdStore):
    """A store that, once its first page is read, writes into the range (and compacts the
    store, when ``compact``), as another client could between two pages."""

    def __init__(self, *args: object, compact: bool = False, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.compact = compact
        self.pages = 0

    async def _range_page(self, *args: object, **kwargs: object) -> object:
        page = await super()._range_page(*args, **kwargs)  # type: ignore[arg-type]
        self.pages += 1
        if self.pages == 1:
            await self.put("/t/s/k3", b"changed")
            await self.put("/t/s/k9", b"new")
            if self.compact:
                await (await self._get_client()).compact(await self.current_revision())
        return page


def test_a_paged_read_is_one_snapshot_and_starts_again_if_it_was_compacted(
        etcd: EmbeddedEtcd, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_module, "_PAGE_KEYS", 2)
    cfg = config.load(overrides={"etcd.endpoints": etcd.endpoint}, environ={},
                      require_node=False).etcd

    async def run() -> None:
        s = EtcdStore(cfg)
        try:
            for i in range(5):
                await s.put(f"/t/s/k{i}", b"old")
            _, before = await s.get_prefix("/t/s/")
            # Written after the first of three pages: not in the snapshot the read returns.
            mid = _WritesBetweenPages(cfg)
            kvs, rev = await mid.get_prefix("/t/s/")
            assert rev == before and mid.pages == 3
            assert [(kv.key, kv.value) for kv in kvs] == [(f"/t/s/k{i}", b"old") for i in range(5)]
            await mid.close()
            # Compacted past the snapshot's revision after its first page: read again, whole,
            # at the new revision.
            compacting = _WritesBetweenPages(cfg, compact=True)
            kvs, rev = await compacting.get_prefix("/t/s/")
            assert rev == await s.current_revision()
            assert {kv.key: kv.value for kv in kvs} == {
                **{f"/t/s/k{i}": b"old" for i in range(5)}, "/t/s/k3": b"changed",
                "/t/s/k9": b"new"}
            await compacting.close()
        finally:
            await s.close()

    asyncio.run(run())
