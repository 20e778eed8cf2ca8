"""Per-rank logs: a worker's output in a file of its own, capped and rotated, and read back by
``understudy logs`` through etcd from the daemon that holds it. Real parts: pipes, child
processes started by the supervisor, files, a real etcd; the daemon's half runs in the test's
process (``daemon/ranklogs.py``, ``daemon/logserver.py``), the CLI's half too (``cli/logs.py``).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from understudy.cli import logs as cli_logs
from understudy.cli import main as cli_main
from understudy.cli.cluster import read_cluster
from understudy.common import config
from understudy.common.config import Config
from understudy.common.errors import ConfigError, RecordError
from understudy.common.keys import Keys
from understudy.common.ranklogs import (
    CHUNK_BYTES,
    MAX_SERVING,
    LogChunk,
    LogFile,
    LogRequest,
)
from understudy.common.records import JobSpec, JobState, JobStatus
from understudy.common.store import EtcdStore
from understudy.daemon.logserver import LogServer
from understudy.daemon.metrics import Metrics
from understudy.daemon.ranklogs import RankLogs, RotatingFile, segments
from understudy.daemon.supervisor import Supervisor
from understudy.testing.embedded_etcd import EmbeddedEtcd

KEYS = Keys("/understudy")


def test_a_file_is_capped_and_rotated_keeping_the_newest_bytes(tmp_path: Path) -> None:
    path = tmp_path / "job" / "rank0.1-10.log"
    written = b"".join(f"line {i}\n".encode() for i in range(3000))
    f = RotatingFile(path, max_bytes=4096, files=3)
    for i in range(0, len(written), 1000):
        f.write(written[i:i + 1000])
    f.close()
    parts = segments(path, 3)
    assert [p.name for p in parts] == ["rank0.1-10.log.2", "rank0.1-10.log.1", "rank0.1-10.log"]
    assert all(p.stat().st_size <= 4096 for p in parts)
    kept = b"".join(p.read_bytes() for p in parts)
    assert written.endswith(kept) and len(kept) > 2 * 4096
    # Reopened (a daemon restarted), it appends and goes on counting the file's size.
    again = RotatingFile(path, max_bytes=4096, files=3)
    assert again.size == path.stat().st_size
    again.close()
    one = RotatingFile(tmp_path / "one.log", max_bytes=4096, files=1)
    one.write(b"x" * 10000)
    one.close()
    assert [p.name for p in segments(tmp_path / "one.log", 1)] == ["one.log"]
    assert (tmp_path / "one.log").stat().st_size == 10000 - 2 * 4096


@pytest.mark.parametrize("field,value", [
    ("job", "../../etc"), ("job", "a/b"), ("node", "../x"), ("id", "not-hex!"),
    ("rank", -1), ("pid", 0), ("offset", -5), ("lease", 0)])
def test_a_request_that_could_leave_the_log_directory_does_not_decode(field: str,
                                                                     value: Any) -> None:
    good = LogRequest(id="0123abcd", job="mig", rank=1, node="node-a", epoch=2, pid=99,
                      lease=7, follow=False, requested_at=1.0).encode()
    assert LogRequest.decode(good).job == "mig"
    body = {**json.loads(good), field: value}
    with pytest.raises(RecordError):
        LogRequest.decode(json.dumps(body).encode())


@pytest.mark.parametrize("value", [
    b"", b"garbage", b"{}\nabc", b'{"schema":"understudy/v1","record":"log-chunk"}\n',
    LogChunk("0123abcd", 0, b"abc").encode() + b"more than the size says",
    LogChunk("0123abcd", 0, b"abc").encode().replace(b'"seq":0', b'"seq":-1'),
    LogFile(job="j", rank=0, node="n", epoch=1, pid=2, started_at=0, path="/p").encode()])
def test_a_chunk_that_is_not_one_does_not_decode(value: bytes) -> None:
    with pytest.raises(RecordError):
        LogChunk.decode(value)


def test_a_chunk_carries_any_bytes() -> None:
    data = bytes(range(256)) * (CHUNK_BYTES // 256)
    chunk = LogChunk.decode(LogChunk("0123abcd", 3, data, final=True).encode())
    assert (chunk.data, chunk.seq, chunk.final, chunk.error) == (data, 3, True, "")


def test_the_log_directory_and_its_cap_are_configured(tmp_path: Path) -> None:
    base = {"etcd.endpoints": "127.0.0.1:2379", "node": "n", "run_dir": str(tmp_path)}
    cfg = config.load(overrides=base, environ={})
    assert cfg.rank_log_dir == tmp_path / "logs"
    assert (cfg.rank_logs.max_bytes, cfg.rank_logs.files) == (64 * 1024 * 1024, 3)
    cfg = config.load(overrides=base, environ={"UNDERSTUDY_RANK_LOG_DIR": "/var/log/u"})
    assert cfg.rank_log_dir == Path("/var/log/u")
    toml = tmp_path / "u.toml"
    toml.write_text('[rank_logs]\nmax_bytes = 1048576\nfiles = 5\n')
    cfg = config.load(toml, overrides=base, environ={})
    assert (cfg.rank_logs.max_bytes, cfg.rank_logs.files) == (1048576, 5)
    with pytest.raises(ConfigError, match=r"rank_logs\.max_bytes"):
        config.load(overrides={**base, "rank_logs.max_bytes": 100}, environ={})


# -- the daemon's half and the CLI's, against a real etcd ---------------------------------------


class _Node:
    """A daemon's rank-log half in this process: a supervisor starting real children whose
    output the node's RankLogs writes, and its LogServer answering through etcd."""

    def __init__(self, cfg: Config, store: EtcdStore) -> None:
        self.cfg, self.store = cfg, store
        self.stop = asyncio.Event()
        self.metrics = Metrics()
        self.ranklogs = RankLogs(cfg, store, self.stop)
        self.server = LogServer(self.ranklogs, store, self.metrics, self.stop)
        self.supervisor = Supervisor(cfg.run_dir, on_exit=lambda c: self.ranklogs.ended(c.pid))

    async def start(self, job: str, rank: int | None, epoch: int, code: str,
                    env: dict[str, str] | None = None) -> int:
        r, w = self.ranklogs.pipe()
        try:
            pid = await self.supervisor.spawn(f"{job}.r{rank}" if rank is not None
                                              else f"{job}.standby",
                                              [sys.executable, "-c", code], env=env,
                                              output=w)
        finally:
            os.close(w)
        await self.ranklogs.attach(r, pid, job, rank, epoch)
        return pid

    async def wait(self, name: str) -> None:
        deadline = time.monotonic() + 20
        while self.supervisor.children[name].state == "running":
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)

    def bad_values(self) -> float:
        return self.metrics.bad_values.labels(collection="log-requests")._value.get()


@asynccontextmanager
async def _cluster(etcd: EmbeddedEtcd, tmp_path: Path, world: int = 2,
                   **over: Any) -> AsyncIterator[tuple[_Node, EtcdStore]]:
    cfg = config.load(overrides={"etcd.endpoints": etcd.endpoint, "node": "node-a",
                                 "run_dir": str(tmp_path / "run"), **over}, environ={})
    store, cli_store = EtcdStore(cfg.etcd), EtcdStore(cfg.etcd)
    node = _Node(cfg, store)
    spec = JobSpec(name="mig", argv=("x",), cwd="/", tp=1, dp=world, standby=0, created_at=0)
    await store.put(KEYS.job_spec("mig"), spec.encode())
    await store.put(KEYS.job_status("mig"), JobStatus(job="mig", state=JobState.RUNNING,
                                                      reason="", updated_at=0).encode())
    lease = await store.grant(30)
    await store.put(KEYS.node("node-a"), b"{}", lease=lease)  # online, as far as the CLI asks
    tasks = [asyncio.create_task(node.ranklogs.run()), asyncio.create_task(node.server.run())]
    try:
        yield node, cli_store
    finally:
        await node.supervisor.close(1.0)
        await node.ranklogs.close()
        node.stop.set()
        await asyncio.wait(tasks, timeout=5)
        await store.close()
        await cli_store.close()


async def _show(store: EtcdStore, rank: int | None, follow: bool = False
                ) -> tuple[int, bytes, list[str]]:
    out, err = io.BytesIO(), []
    code = await asyncio.wait_for(cli_logs.show(store, KEYS, "mig", rank, follow, out,
                                                err.append), 30)
    return code, out.getvalue(), err


async def _indexed(store: EtcdStore, rank: int, count: int = 1) -> None:
    deadline = time.monotonic() + 10
    while len((await store.get_prefix(f"{KEYS.log_files_of('mig')}{rank}/"))[0]) < count:
        assert time.monotonic() < deadline, "the file was never indexed"
        await asyncio.sleep(0.02)


PRINTS = ("import sys\n"
          "print('hello from rank', flush=True)\n"
          "print('a warning', file=sys.stderr, flush=True)\n"
          "sys.stdout.write('no newline at the end')\n")


def test_a_ranks_output_is_in_its_own_file_and_logs_shows_it(etcd: EmbeddedEtcd,
                                                             tmp_path: Path) -> None:
    async def run() -> None:
        async with _cluster(etcd, tmp_path) as (node, cli):
            pid = await node.start("mig", 1, 1, PRINTS)
            await node.wait("mig.r1")
            await _indexed(cli, 1)
            path = tmp_path / "run" / "logs" / "mig" / f"rank1.1-{pid}.log"
            content = path.read_bytes()
            assert content == b"hello from rank\na warning\nno newline at the end"
            code, out, err = await _show(cli, 1)
            assert (code, out, err) == (0, content, [])
            code, out, err = await _show(cli, None)  # every rank, each line with its rank
            assert code == 0 and err == []
            assert out == (b"[rank 1] hello from rank\n[rank 1] a warning\n"
                           b"[rank 1] no newline at the end\n")
            # The answer went with the CLI's lease: nothing of it is left in etcd.
            assert (await cli.get_prefix("/understudy/logs/requests/"))[0] == []
            assert (await cli.get_prefix("/understudy/logs/chunks/"))[0] == []
            status = await read_cluster(cli, KEYS)
            job = status.job("mig")
            assert job is not None and [f.path for f in job.logs] == [str(path)]
            assert job.as_json()["logs"]["files"][0]["node"] == "node-a"
    asyncio.run(run())


def test_follow_shows_everything_in_order_until_the_job_is_over(etcd: EmbeddedEtcd,
                                                                tmp_path: Path) -> None:
    # 3 MiB: more than the window of unread chunks holds, so the daemon waits for the reader.
    code = ("import sys, time\n"
            "print('first', flush=True)\n"
            "time.sleep(0.5)\n"
            "for i in range(30000):\n"
            "    sys.stdout.write(f'{i:09d} ' + 'x' * 90 + '\\n')\n"
            "sys.stdout.flush()\n"
            "time.sleep(0.3)\n"
            "print('last', flush=True)\n")

    async def run() -> None:
        async with _cluster(etcd, tmp_path) as (node, cli):
            await node.start("mig", 0, 1, code)
            await _indexed(cli, 0)

            async def job_done() -> None:  # as the controller says once every rank ended
                await node.wait("mig.r0")
                await asyncio.sleep(0.5)
                await cli.put(KEYS.job_status("mig"), JobStatus(
                    job="mig", state=JobState.DONE, reason="", updated_at=0).encode())

            done = asyncio.create_task(job_done())
            code_, out, err = await _show(cli, 0, follow=True)
            assert done.done(), "following ended before the job did"
            assert code_ == 0 and err == []
            lines = out.split(b"\n")
            assert lines[0] == b"first" and lines[-2] == b"last" and lines[-1] == b""
            assert [int(line[:9]) for line in lines[1:-2]] == list(range(30000))
    asyncio.run(run())


def test_followers_of_every_rank_of_a_node_do_not_starve_another_request(
        etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    world = MAX_SERVING + 2
    go = tmp_path / "go"
    quiet = ("import os, sys, time\n"
             "print('up', os.environ['R'], flush=True)\n"
             f"while not os.path.exists({str(go)!r}): time.sleep(0.05)\n"
             "print('bye', flush=True)\n")

    async def run() -> None:
        async with _cluster(etcd, tmp_path, world=world) as (node, cli):
            for r in range(world):
                await node.start("mig", r, 1, quiet, env={"R": str(r)})
            for r in range(world):
                await _indexed(cli, r)
            following = asyncio.create_task(_show(cli, None, follow=True))
            await asyncio.sleep(1.0)  # every rank's follower is up, each at its file's end
            assert not following.done()
            code, out, err = await _show(cli, world - 1)  # answered all the same
            assert (code, out, err) == (0, f"up {world - 1}\n".encode(), [])
            go.touch()
            for r in range(world):
                await node.wait(f"mig.r{r}")
            await cli.put(KEYS.job_status("mig"), JobStatus(
                job="mig", state=JobState.DONE, reason="", updated_at=0).encode())
            code, out, err = await following
            assert code == 0 and err == []
            lines = out.decode().splitlines()
            for r in range(world):
                assert [x for x in lines if x.startswith(f"[rank {r}] ")] == [
                    f"[rank {r}] up {r}", f"[rank {r}] bye"]
    asyncio.run(run())


def test_a_promoted_standby_goes_on_in_the_ranks_file_and_both_processes_are_shown(
        etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    async def run() -> None:
        async with _cluster(etcd, tmp_path) as (node, cli):
            old = await node.start("mig", 1, 1, "print('old process', flush=True)")
            await node.wait("mig.r1")
            promoted = tmp_path / "promoted"
            standby = await node.start("mig", None, 1, (
                "import os, time\nprint('warming', flush=True)\n"
                f"while not os.path.exists({str(promoted)!r}): time.sleep(0.02)\n"
                "print('training as rank 1', flush=True)\n"))
            await asyncio.sleep(0.3)
            node.supervisor.rename("mig.standby", "mig.r1")
            node.ranklogs.retarget(standby, "mig", 1, 2)
            promoted.touch()
            await node.wait("mig.r1")
            await _indexed(cli, 1, count=2)
            d = tmp_path / "run" / "logs" / "mig"
            assert (d / f"standby.{standby}.log").read_bytes() == b"warming\n"
            assert (d / f"rank1.2-{standby}.log").read_bytes() == b"training as rank 1\n"
            code, out, err = await _show(cli, 1)
            assert code == 0 and err == []
            assert out.decode().splitlines() == [
                f"==> rank 1 from epoch 1: process {old} on node-a, {d}/rank1.1-{old}.log <==",
                "old process",
                f"==> rank 1 from epoch 2: process {standby} on node-a, "
                f"{d}/rank1.2-{standby}.log <==",
                "training as rank 1"]
    asyncio.run(run())


def test_garbage_and_foreign_requests_are_counted_and_ignored(etcd: EmbeddedEtcd,
                                                              tmp_path: Path) -> None:
    async def run() -> None:
        async with _cluster(etcd, tmp_path) as (node, cli):
            pid = await node.start("mig", 0, 1, "print('still served', flush=True)")
            await node.wait("mig.r0")
            await _indexed(cli, 0)
            good = LogRequest(id="0123abcd", job="mig", rank=0, node="node-a", epoch=1,
                              pid=pid, lease=1, follow=False, requested_at=0)
            bad = {"garbage": b"\xff\x00not json",
                   "0123abce": good.encode().replace(b'"job":"mig"', b'"job":"../mig"'),
                   "0123abcf": good.encode().replace(b'"node":"node-a"', b'"node":"node-b"'),
                   "0123abd0": b'{"schema":"understudy/v1","record":"log-request"}'}
            for name, value in bad.items():
                await cli.put(KEYS.log_request("node-a", name), value)
            deadline = time.monotonic() + 10
            while node.bad_values() < len(bad):
                assert time.monotonic() < deadline, node.bad_values()
                await asyncio.sleep(0.02)
            code, out, err = await _show(cli, 0)
            assert (code, out, err) == (0, b"still served\n", [])
            assert node.bad_values() == len(bad)
            for name in bad:
                await cli.delete(KEYS.log_request("node-a", name))
    asyncio.run(run())


def test_a_file_whose_node_is_offline_is_one_sentence_and_exit_1(
        etcd: EmbeddedEtcd, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli_logs, "SILENCE_S", 0.2)

    async def run() -> None:
        async with _cluster(etcd, tmp_path) as (_, cli):
            gone = LogFile(job="mig", rank=1, node="node-x", epoch=1, pid=5, started_at=0,
                           path="/var/lib/understudy/logs/mig/rank1.1-5.log")
            await cli.put(KEYS.log_file("mig", 1, 1, "node-x", 5), gone.encode())
            code, out, err = await _show(cli, 1)
            assert (code, out) == (1, b"")
            assert err == ["node node-x is offline: the log of rank 1 (process 5 on node-x) "
                           "cannot be shown"]
    asyncio.run(run())


@pytest.mark.parametrize("argv,message", [
    (["logs", "nope"], "no job named 'nope' in this cluster (known: mig)"),
    (["logs", "mig", "--rank", "2"], "job 'mig' has ranks 0 to 1; there is no rank 2"),
    (["logs", "mig", "--rank", "-1"], "job 'mig' has ranks 0 to 1; there is no rank -1")])
def test_an_unknown_job_or_rank_is_one_sentence_exit_1_and_nothing_written(
        etcd: EmbeddedEtcd, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        argv: list[str], message: str) -> None:
    async def setup() -> int:
        async with _cluster(etcd, tmp_path) as (_, cli):
            return await cli.current_revision()

    rev = asyncio.run(setup())
    capsys.readouterr()
    assert cli_main.main(["--etcd", etcd.endpoint, *argv]) == 1
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", f"understudy: {message}\n")

    async def after() -> int:
        store = EtcdStore(config.load(overrides={"etcd.endpoints": etcd.endpoint},
                                      environ={}, require_node=False).etcd)
        try:
            return await store.current_revision()
        finally:
            await store.close()
    assert asyncio.run(after()) == rev


def test_logs_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["logs"], ["logs", "mig", "--rank", "one"]):
        with pytest.raises(SystemExit) as exc:
            cli_main.build_parser().parse_args(argv)
        assert exc.value.code == 2
