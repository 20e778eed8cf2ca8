"""The daemon's local socket fences writes by epoch on every request, not only at hello: a
connection whose epoch the job's assignment moved past can no longer write a snapshot report
or a holder advertisement, even while the daemon's own view still lags behind etcd. And it
serves only the daemon's own process tree (or a configured group): a process that does not
descend from the daemon is refused. A real etcd (the shared fixture), a real Unix socket, real
processes, the workers' own client; no daemon around it."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.unit.test_runtime import solo  # noqa: F401
from tests.unit.test_snapshots import _runtime
from understudy.common import config, env
from understudy.common.daemon_client import DaemonClient, DaemonError
from understudy.common.keys import Keys
from understudy.common.layout import Layout
from understudy.common.records import Assignment, Migration, MigrationPhase
from understudy.common.snapshot_tiers import SnapshotReport
from understudy.common.store import EtcdStore
from understudy.daemon.localsock import LocalServer, fenced
from understudy.daemon.peers import Peer, ancestors, read_peer, refusal, worker_of
from understudy.groups.groupset import GroupSet
from understudy.testing.embedded_etcd import EmbeddedEtcd
from understudy.worker import migration
from understudy.worker.api import JobContext
from understudy.worker.snapshots import Snapshotter, _reporter, complete_copies

T = TypeVar("T")
KEYS = Keys("/t")


class _Daemon:
    """A LocalServer on its own event loop thread, with a view of each job's epoch that the
    test moves by hand (as the daemon's reconcile would, late)."""

    def __init__(self, endpoint: str, path: Path) -> None:
        cfg = config.load(overrides={"etcd.endpoints": endpoint}, environ={},
                          require_node=False)
        self.path = path
        self.view: dict[str, int] = {}
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-daemon",
                                       daemon=True)
        self.thread.start()
        self.store = EtcdStore(cfg.etcd)
        #: pid -> job of the processes this test starts as the daemon's workers
        self.workers: dict[int, str] = {}
        self.server = LocalServer(path, self.store, KEYS, "node-a", epoch_check=self._check,
                                  worker_job=self.workers.get)
        self.run(self.server.start())

    def _check(self, namespace: str, epoch: int) -> str | None:
        job = namespace.split("/", 1)[0]
        current = self.view.get(job)
        return f"job {job} is at epoch {current}" if current is not None and \
            epoch < current else None

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def assign(self, job: str, epoch: int, *, view: bool = True) -> None:
        """Write the job's assignment at ``epoch`` to etcd, and (``view``) let the daemon's
        view catch up."""
        a = Assignment(job=job, epoch=epoch, ranks=("node-a",), standbys=(), reason="",
                       updated_at=0.0)
        self.run(self.store.put(KEYS.job_assignment(job), a.encode()))
        if view:
            self.view[job] = epoch

    def value(self, key: str) -> bytes | None:
        kv = self.run(self.store.get(KEYS.kv_root + key))
        return None if kv is None else kv.value

    def close(self) -> None:
        self.run(self.server.close())
        self.run(self.store.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture
def daemon(etcd: EmbeddedEtcd, tmp_path: Path) -> Iterator[_Daemon]:
    d = _Daemon(etcd.endpoint, tmp_path / "understudyd.sock")
    try:
        yield d
    finally:
        d.close()


def _client(d: _Daemon, namespace: str, epoch: int) -> DaemonClient:
    return DaemonClient(namespace, epoch=epoch, path=str(d.path), timeout=5)


def test_only_the_namespaces_live_ranks_read_to_decide_what_to_load_are_fenced() -> None:
    assert fenced("j") and fenced("j/snapshots")
    assert not fenced("j/tp0/v3") and not fenced("j/migration/e5-1") and \
        not fenced("j/control") and not fenced("j/snapshots/x")


def test_a_connection_whose_epoch_the_job_moved_past_can_no_longer_write(
        daemon: _Daemon) -> None:
    daemon.assign("j", 4)
    reports, holders = _client(daemon, "j/snapshots", 4), _client(daemon, "j", 4)
    group, migration = _client(daemon, "j/tp0/v1", 4), _client(daemon, "j/migration/e5-1", 4)
    try:
        reports.set("0", b"step 40")
        assert reports.add("n", 1) == 1
        # The job moves to epoch 5 in etcd, and this daemon has not read it yet (its view
        # lags, as right after a partition heals): the write's own transaction refuses it.
        daemon.assign("j", 5, view=False)
        writes = [lambda: reports.set("0", b"step 60"), lambda: reports.add("n", 1),
                  lambda: reports.compare_set("0", b"step 40", b"step 60"),
                  lambda: reports.delete("0"), lambda: holders.set("holders/s1", b"x")]
        for write in writes:
            with pytest.raises(DaemonError, match="a write of epoch 4 refused: job j is at "
                                                  "epoch 5"):
                write()
        # Reads stay allowed, and nothing changed.
        assert reports.get("0") == b"step 40" and reports.check(["n"])
        assert daemon.value("j/snapshots/0") == b"step 40" and daemon.value("j/holders/s1") \
            is None
        # Once the daemon's view has it, it refuses without asking etcd.
        daemon.view["j"] = 5
        with pytest.raises(DaemonError, match="a write of epoch 4 refused: job j is at "
                                              "epoch 5"):
            reports.set("0", b"step 60")
        # A rank of epoch 5, and a joiner or standby ahead of the assignment, write.
        with _client(daemon, "j/snapshots", 5) as live, _client(daemon, "j", 6) as ahead:
            live.set("0", b"step 60")
            assert live.add("n", 2) == 3
            assert live.compare_set("0", b"step 60", b"step 80") == b"step 80"
            assert live.delete("n") and not live.check(["n"])
            ahead.set("holders/s1", b"h")
        assert daemon.value("j/snapshots/0") == b"step 80"
        # Bootstrap stores and migration reports keep the connection's writes: a kept group
        # and a leaver's late "transferred" need them (the hello's check still holds).
        group.set("addr", b"10.0.0.1:1")
        migration.set("transferred/1", b"ok")
        with pytest.raises(DaemonError, match="epoch 4 refused: job j is at epoch 5"):
            _client(daemon, "j/snapshots", 4)
    finally:
        for c in (reports, holders, group, migration):
            c.close()


def test_a_write_etcd_did_not_answer_may_be_retried_and_a_refused_one_may_not(
        etcd: EmbeddedEtcd, daemon: _Daemon) -> None:
    daemon.assign("j", 4)
    stale = _client(daemon, "j/snapshots", 4)
    daemon.assign("j", 5)
    current = _client(daemon, "j/snapshots", 5)
    try:
        with pytest.raises(DaemonError, match="refused") as refused:
            stale.set("0", b"x")
        assert not refused.value.retryable
        etcd.stop()
        try:
            with pytest.raises(DaemonError, match="etcd unavailable") as outage:
                current.set("0", b"x")
            assert outage.value.retryable
        finally:
            etcd.start()
        # The same request, retried as its error allows: the daemon's channel to etcd may still
        # be in its reconnect backoff (up to 1 s) for a moment after etcd is back.
        deadline = time.monotonic() + 15.0
        while True:
            try:
                current.set("0", b"x")
                break
            except DaemonError as exc:
                assert exc.retryable, exc
                assert time.monotonic() < deadline, f"etcd is back but the write still fails: {exc}"
                time.sleep(0.1)
        assert daemon.value("j/snapshots/0") == b"x"
    finally:
        stale.close()
        current.close()


def test_a_job_the_daemon_does_not_know_takes_writes_only_while_it_has_no_assignment(
        daemon: _Daemon) -> None:
    with _client(daemon, "k/snapshots", 0) as c:
        c.set("0", b"a")
        daemon.assign("k", 1, view=False)
        with pytest.raises(DaemonError, match="job k is at epoch 1"):
            c.set("0", b"b")
    assert daemon.value("k/snapshots/0") == b"a"


def test_a_replaced_rank_writes_on_but_its_reports_are_refused_and_it_deletes_nothing(
        daemon: _Daemon, solo: JobContext, tmp_path: Path,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.CHILD_SOCKET, str(daemon.path))
    daemon.assign("j", 4)
    snap = tmp_path / "snap"
    runtime = _runtime(solo)
    snapshots = Snapshotter(snap, rank=0, every=3, keep=1, report=_reporter("j", 0),
                            epoch=lambda: 4)
    runtime.after_commit.append(snapshots.after_commit)
    runtime.run(3)
    snapshots.close()
    taken = SnapshotReport((3,), epoch=4, storage_epochs=(4,))
    assert SnapshotReport.parse(daemon.value("j/snapshots/0") or b"") == taken
    daemon.assign("j", 5)  # the controller replaced it; it does not know yet
    runtime.run(6)
    snapshots.close()
    # It wrote step 6 (nobody reads it: no counted report names it) and pruned nothing.
    assert complete_copies(snap, 0) == [(3, 4), (6, 4)]
    assert SnapshotReport.parse(daemon.value("j/snapshots/0") or b"") == taken


# --- who may connect (daemon/peers.py) --------------------------------------------------------


def test_the_peer_decision_admits_descendants_and_the_group_only() -> None:
    worker = Peer(pid=200, uid=0, gid=0, groups=())
    assert refusal(worker, (150, 100, 1), daemon_pid=100, group=None) is None  # a grandchild
    assert refusal(Peer(100, 0, 0, ()), (1,), daemon_pid=100, group=None) is None  # itself
    root = Peer(pid=300, uid=0, gid=0, groups=(4, 24))
    assert refusal(root, (1,), daemon_pid=100, group=None) == (
        "process 300 (uid 0, gid 0) is not a worker of this daemon (pid 100); besides its "
        "workers it admits no other process (socket_group is not set)")
    assert refusal(root, (1,), daemon_pid=100, group=24) is None      # supplementary group
    assert refusal(Peer(300, 1000, 77, ()), (1,), daemon_pid=100, group=77) is None
    assert refusal(root, (1,), daemon_pid=100, group=77) == (
        "process 300 (uid 0, gid 0) is not a worker of this daemon (pid 100); besides its "
        "workers it admits members of group 77")
    assert refusal(root, (), daemon_pid=100, group=None) is not None  # gone: no ancestry


def test_the_worker_a_peer_descends_from_is_the_daemons_child_in_its_ancestry() -> None:
    assert worker_of(Peer(200, 0, 0, ()), (100, 1), daemon_pid=100) == 200  # the worker
    assert worker_of(Peer(250, 0, 0, ()), (200, 100, 1), daemon_pid=100) == 200  # its loader
    assert worker_of(Peer(100, 0, 0, ()), (1,), daemon_pid=100) is None  # the daemon
    assert worker_of(Peer(300, 0, 0, ()), (1,), daemon_pid=100) is None  # a group member


_FOREIGN = """
import json, sys
from understudy.common.daemon_client import DaemonClient, DaemonError
out = {}
for ns in sys.argv[2:]:
    try:
        with DaemonClient(ns, epoch=1, path=sys.argv[1], timeout=5) as c:
            c.set("k", b"v")
        out[ns] = "admitted"
    except DaemonError as exc:
        out[ns] = str(exc)
print(json.dumps(out))
"""


def test_a_worker_uses_its_own_jobs_namespaces_only(daemon: _Daemon) -> None:
    """Review H3: any process the daemon admitted could act for any job (abort another job's
    migration, re-point its holders). A worker of job j now reaches j's namespaces only; a
    process below the daemon that is no worker it runs is refused."""
    child = subprocess.Popen([sys.executable, "-c", _FOREIGN, str(daemon.path), "j/migration/m1",
                              "j", "other/migration/m1", "other", "jx/control"],
                             stdout=subprocess.PIPE, text=True)
    daemon.workers[child.pid] = "j"
    out, _ = child.communicate(timeout=60)
    got = json.loads(out)
    assert got["j/migration/m1"] == got["j"] == "admitted"
    for ns in ("other/migration/m1", "other", "jx/control"):
        assert got[ns] == f"a worker of job 'j' may not use namespace {ns!r}", got
    assert daemon.value("other/migration/m1/k") is None and daemon.value("j/k") == b"v"
    stranger = subprocess.run([sys.executable, "-c", _FOREIGN, str(daemon.path), "j"],
                              capture_output=True, text=True, timeout=60)
    assert json.loads(stranger.stdout)["j"].endswith("is no worker this daemon runs now")


def test_the_kernel_reports_a_peers_credentials_and_ancestry() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        peer = read_peer(a)
    assert (peer.pid, peer.uid, peer.gid) == (os.getpid(), os.geteuid(), os.getegid())
    assert set(peer.groups) == set(os.getgroups())
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert ancestors(child.pid)[0] == os.getpid()
        assert os.getppid() in ancestors(os.getpid())
    finally:
        child.kill()
        child.wait(10)
    assert ancestors(child.pid) == ()


_ORPHAN = """
import json, os, sys, time
parent = os.getpid()
if os.fork():
    os._exit(0)  # the child is orphaned and re-parented: no longer below the test process
deadline = time.monotonic() + 10
while os.getppid() == parent and time.monotonic() < deadline:
    time.sleep(0.01)
from understudy.common.daemon_client import DaemonClient, DaemonError
results = []
for _ in range(2):
    try:
        DaemonClient("j/snapshots", epoch=1, path=sys.argv[1], timeout=5).close()
        results.append("admitted")
    except DaemonError as exc:
        results.append(str(exc))
with open(sys.argv[2] + ".tmp", "w") as f:
    json.dump({"pid": os.getpid(), "results": results}, f)
os.rename(sys.argv[2] + ".tmp", sys.argv[2])
"""


def test_a_process_that_does_not_descend_from_the_daemon_is_refused(
        daemon: _Daemon, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The daemon is this test process (its server runs on a thread here): a client in it, and
    a process it starts, are admitted; a process orphaned on purpose is refused (twice, with
    one warning), whatever its uid."""
    with _client(daemon, "j/snapshots", 1) as c:
        c.ping()
    child = subprocess.Popen([sys.executable, "-c", _ORPHAN.replace("os.fork()", "False"),
                              str(daemon.path), str(tmp_path / "child.json")])
    daemon.workers[child.pid] = "j"  # a worker of job j, as the supervisor would know it
    assert child.wait(60) == 0
    assert json.loads((tmp_path / "child.json").read_text())["results"] == ["admitted"] * 2
    out = tmp_path / "orphan.json"
    subprocess.run([sys.executable, "-c", _ORPHAN, str(daemon.path), str(out)], timeout=60,
                   check=True)
    deadline = time.monotonic() + 30
    while not out.exists():
        assert time.monotonic() < deadline, "the orphan never reported"
        time.sleep(0.05)
    orphan = json.loads(out.read_text())
    assert orphan["results"] == [
        f"process {orphan['pid']} (uid {os.geteuid()}, gid {os.getegid()}) is not a worker of "
        f"this daemon (pid {os.getpid()}); besides its workers it admits no other process "
        f"(socket_group is not set)"] * 2
    logged = capsys.readouterr()
    warnings = [line for line in (logged.out + logged.err).splitlines()
                if "Refused a connection to the workers' socket" in line]
    assert len(warnings) == 1 and str(orphan["pid"]) in warnings[0], warnings
    assert daemon.value("j/snapshots/x") is None


def test_a_plan_reaches_a_waiting_standby_and_a_following_rank_once_the_daemon_reads_it(
        daemon: _Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    """A standby waits for its plan on the daemon's long poll, and a rank that follows the
    job's view reads a recovery from it at every check: neither waits out a polling period
    (the throttle is set to a minute here, which only a broken view falls back to)."""
    monkeypatch.setattr(migration, "RECOVERY_POLL_S", 60.0)
    view: dict[str, Any] = {"info": {"assignment": None, "status": None, "migration": None,
                                     "stop": None}, "published": asyncio.Event()}

    def publish(migration_record: Migration) -> None:
        def swap() -> None:
            view["info"] = {**view["info"], "migration": json.loads(migration_record.encode())}
            published, view["published"] = view["published"], asyncio.Event()
            published.set()
        daemon.loop.call_soon_threadsafe(swap)

    daemon.server.job_info = lambda job: view["info"] if job == "j" else None
    daemon.server.next_view = lambda: view["published"]
    standby, rank = _client(daemon, "j", 0), _client(daemon, "j", 1)
    stop = threading.Event()
    found: list[tuple[migration.Plan, int] | None] = []
    waiter = threading.Thread(target=lambda: found.append(
        migration.wait_for_plan(standby, "node-s1", stop)))
    try:
        changed = threading.Event()  # what wakes the rank's waits on collectives
        rank.follow_job(lambda: 1, on_change=changed.set)
        _until(lambda: rank.following)
        hook = migration.MigrationHook(rank, GroupSet("j", "r0-node-a", epoch=1), job="j",
                                       rank=0, node="node-a", layout=Layout(2, 1, 1),
                                       nodes=("node-a", "node-b"))
        assert hook.recovery() is None
        waiter.start()
        time.sleep(0.3)
        assert not found, "the standby was not chosen yet"
        assert not changed.is_set(), "the first view is no change"
        publish(Migration(job="j", id="e2-1", from_epoch=1, to_epoch=2, ranks=(1,),
                          leavers=("node-b",), joiners=("node-s1",), donors=(0,),
                          kind="recovery", phase=MigrationPhase.PLANNED, reason="rank 1 died",
                          created_at=1.0, deadline=100.0, updated_at=1.0))
        waiter.join(5)
        assert found and found[0] is not None
        plan, taken = found[0]
        assert (plan.id, taken) == ("e2-1", 1)
        _until(lambda: (rank.job() or {}).get("migration") is not None)
        _until(changed.is_set)
        seen = hook.recovery()
        assert seen is not None and seen.id == "e2-1" and seen.donor_of == {1: 0}
        # Stopped while nothing names it: the standby's wait ends within its long poll.
        other: list[tuple[migration.Plan, int] | None] = []
        waiting = threading.Thread(target=lambda: other.append(
            migration.wait_for_plan(standby, "node-s2", stop)))
        waiting.start()
        time.sleep(0.2)
        stop.set()
        waiting.join(migration.PLAN_WAIT_S + 2)
        assert other == [None]
    finally:
        stop.set()
        waiter.join(5) if waiter.is_alive() else None
        standby.close()
        rank.close()


def _until(done: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "not in time"
        time.sleep(0.01)


def test_junk_nested_past_the_parsers_depth_is_answered_and_the_connection_serves_on(
        daemon: _Daemon) -> None:
    """Review L3: JSON nested deeper than the parser goes raised a RecursionError out of the
    connection's handler: no answer, an event-loop error logged."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(str(daemon.path))
        f = sock.makefile("rwb")
        for line in (b'{"id": 1, "op": "hello", "namespace": "j", "epoch": 0}',
                     b"[" * 100_000 + b"]" * 100_000,
                     b'{"id": 3, "op": "ping"}'):
            f.write(line + b"\n")
            f.flush()
        replies = [json.loads(f.readline()) for _ in range(3)]
    assert [r["ok"] for r in replies] == [True, False, True], replies
    assert replies[1]["error"] == "the request nests too deeply"
    assert oct(daemon.path.stat().st_mode & 0o777) == "0o660"


def test_connections_past_the_cap_are_told_so_and_closed(daemon: _Daemon) -> None:
    daemon.server.max_connections = 2
    with _client(daemon, "j", 0), _client(daemon, "j", 0), \
            pytest.raises(DaemonError, match="serving 2 connections already"):
        _client(daemon, "j", 0)
    with _client(daemon, "j", 0) as c:  # below the cap again
        c.ping()


class _NeverDone:
    """A collective whose peer never comes: no future, a wait that blocks until ``done``."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def get_future(self) -> None:
        raise RuntimeError("no future")

    def wait(self) -> bool:
        self.done.wait(60)
        return True


def test_a_wait_past_its_threshold_is_reported_through_the_daemon_and_withdrawn_at_its_end(
        daemon: _Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    """worker/stuck.py: a rank blocked in a collective past ``after`` says so in
    ``<job>/stuck/<rank>`` (what it waits in, for how long, at which step), again while it
    waits, and deletes the report once the wait is over."""
    from understudy.common.records import StuckReport
    from understudy.groups import abortable
    from understudy.worker.stuck import StuckReporter

    monkeypatch.setenv(env.CHILD_SOCKET, str(daemon.path))
    work = _NeverDone()
    waiter = threading.Thread(target=abortable.wait, args=(work,),
                              kwargs={"what": "the DP gradient all-reduce", "timeout": 30})
    reporter = StuckReporter("j", lambda: (2, 1), lambda: 40, after=0.3, look=0.05, every=0.1)
    try:
        assert daemon.value("j/stuck/2") is None
        waiter.start()
        deadline = time.monotonic() + 10
        while (raw := daemon.value("j/stuck/2")) is None:
            assert time.monotonic() < deadline, "no report"
            time.sleep(0.05)
        first = StuckReport.decode(raw)
        assert (first.job, first.rank, first.epoch, first.step, first.after) == ("j", 2, 1, 40, 0.3)
        assert first.what == "the DP gradient all-reduce" and first.waited >= 0.3
        while StuckReport.decode(daemon.value("j/stuck/2") or raw).waited <= first.waited:
            assert time.monotonic() < deadline, "not reported again"
            time.sleep(0.05)
        work.done.set()
        waiter.join(10)
        while daemon.value("j/stuck/2") is not None:
            assert time.monotonic() < deadline, "the report outlived the wait"
            time.sleep(0.05)
    finally:
        work.done.set()
        reporter.close()
