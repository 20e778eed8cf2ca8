"""Launching a job: `understudy run` -> controller placement (epoch, CAS) -> daemons spawn
their ranks -> each rank's exit is recorded -> the job ends done or failed with the cause."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.scenarios import wait_log, worker_pid
from understudy.common import config
from understudy.common.store import EtcdStore
from understudy.testing.embedded_etcd import EmbeddedEtcd
from understudy.testing.localcluster import LocalCluster

pytestmark = pytest.mark.slow
PROBE = str(Path(__file__).parents[1] / "workers" / "probe.py")


@pytest.fixture
def cluster(etcd: EmbeddedEtcd, tmp_path: Path) -> Iterator[LocalCluster]:
    c = LocalCluster(etcd_endpoint=etcd.endpoint, base_dir=tmp_path / "cluster")
    try:
        c.add("node-a", "active", extra=["--slots", "2"])
        c.add("node-b", "active", extra=["--slots", "2"])
        c.add("node-s", "standby")
        for n, s in (("node-a", "active"), ("node-b", "active"), ("node-s", "standby")):
            c.wait_state(n, s)
        c.wait_for("a controller", lambda s: s.controller is not None)
        yield c
    finally:
        c.stop_all(timeout=5, drain=False)


def _kv(etcd: EmbeddedEtcd, key: str) -> bytes | None:
    async def read() -> bytes | None:
        s = EtcdStore(config.load(overrides={"etcd.endpoints": etcd.endpoint}, environ={},
                                  require_node=False).etcd)
        kv = await s.get(key)
        await s.close()
        return None if kv is None else kv.value

    return asyncio.run(read())


def _written_since(etcd: EmbeddedEtcd, prefix: str, revision: int) -> list[str]:
    """The keys under ``prefix`` written after ``revision``."""
    async def read() -> list[str]:
        s = EtcdStore(config.load(overrides={"etcd.endpoints": etcd.endpoint}, environ={},
                                  require_node=False).etcd)
        kvs, _ = await s.get_prefix(prefix)
        await s.close()
        return sorted(kv.key for kv in kvs if kv.mod_revision > revision)

    return asyncio.run(read())


def test_job_runs_on_the_assigned_nodes_and_finishes(cluster: LocalCluster,
                                                     etcd: EmbeddedEtcd) -> None:
    out = cluster.cli("run", "--job", "j1", "--tp", "2", "--dp", "2", "--standby", "1", "--",
                      sys.executable, PROBE)
    assert out.returncode == 0, out.stderr
    assert "rank 0 on node-a" in out.stdout and "rank 3 on node-b" in out.stdout
    cluster.wait_for("j1 done", lambda s: s.job("j1") is not None
                     and s.job("j1").state == "done", timeout=30)  # type: ignore[union-attr]
    for rank, node in enumerate(["node-a", "node-a", "node-b", "node-b"]):
        coords = _kv(etcd, f"{cluster.prefix}/kv/j1/probe/rank{rank}")
        assert coords == f"4,2,2,{rank % 2},{rank // 2},{node}".encode()
        # torch's CPU allocator on huge pages, the daemon's default (daemon/jobs.huge_pages)
        assert _kv(etcd, f"{cluster.prefix}/kv/j1/probe/thp{rank}") == b"1"
    status = json.loads(cluster.cli("status", "--json").stdout)
    (job,) = status["jobs"]
    assert job["epoch"] == 1 and job["standbys"] == ["node-s"]
    kinds = [json.loads(line)["kind"] for line in cluster.cli("events", "--json").stdout
             .splitlines()]
    assert "job-started" in kinds and "job-done" in kinds


def test_a_failing_rank_fails_the_job_with_its_cause(cluster: LocalCluster) -> None:
    out = cluster.cli("run", "--job", "j2", "--tp", "1", "--dp", "2", "--env",
                      "PROBE_FAIL_RANK=1", "--", sys.executable, PROBE)
    assert out.returncode == 0, out.stderr
    cluster.wait_for("j2 failed", lambda s: s.job("j2") is not None
                     and s.job("j2").state == "failed", timeout=30)  # type: ignore[union-attr]
    job = cluster.status().job("j2")
    assert job is not None and job.status is not None
    assert "rank 1 failed" in job.status.reason
    assert "RuntimeError: probe rank 1 failed on purpose" in job.status.reason


def test_submissions_that_cannot_be_satisfied_change_nothing(cluster: LocalCluster,
                                                             etcd: EmbeddedEtcd) -> None:
    cluster.wait_settled()
    before = cluster.status().revision
    too_big = cluster.cli("run", "--job", "big", "--tp", "4", "--dp", "2", "--", "true")
    assert too_big.returncode == 1 and "needs 8 slots" in too_big.stderr
    no_standby = cluster.cli("run", "--job", "sb", "--tp", "1", "--dp", "1", "--standby", "2",
                             "--", "true")
    assert no_standby.returncode == 1 and "standby" in no_standby.stderr
    bad_name = cluster.cli("run", "--job", "Bad_Name", "--tp", "1", "--dp", "1", "--", "true")
    assert bad_name.returncode == 1 and "job name" in bad_name.stderr
    no_cmd = cluster.cli("run", "--job", "x", "--tp", "1", "--dp", "1")
    assert no_cmd.returncode == 2
    # Nothing written by the refused commands: no job, and no event of one. The daemons' own
    # records may change meanwhile (CI once saw the revision move by one in the seconds these
    # four commands took on a loaded machine).
    written = _written_since(etcd, cluster.prefix, before)
    p = cluster.prefix
    assert not [k for k in written if k.startswith((f"{p}/jobs/", f"{p}/drains/", f"{p}/kv/",
                                                    f"{p}/logs/"))], written
    assert not [e for e in cluster.events() if e.kind.startswith("job")], cluster.events()
    ok = cluster.cli("run", "--job", "dup", "--tp", "1", "--dp", "1", "--env", "PROBE_SLEEP=5",
                     "--", sys.executable, PROBE)
    assert ok.returncode == 0, ok.stderr
    again = cluster.cli("run", "--job", "dup", "--tp", "1", "--dp", "1", "--", "true")
    assert again.returncode == 1 and "already exists" in again.stderr
    # A resize that cannot be: one sentence, exit 1, nothing written.
    ok = cluster.cli("run", "--job", "rs", "--tp", "1", "--dp", "2", "--reshape", "--env",
                     "PROBE_SLEEP=60", "--", sys.executable, PROBE)
    assert ok.returncode == 0 and "may reshape" in ok.stdout, ok.stderr
    for argv, told in ((("nope", "--dp", "1"), "no job named 'nope'"),
                       (("dup", "--dp", "1"), "was not run with --reshape"),
                       (("rs", "--dp", "3"), "1 to 2 data-parallel replicas"),
                       (("rs", "--dp", "0"), "1 to 2 data-parallel replicas")):
        refused = cluster.cli("resize", *argv)
        assert refused.returncode == 1 and told in refused.stderr, refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1
    assert cluster.cli("resize", "rs").returncode == 2  # --dp is required
    for job in ("nope", "dup", "rs"):
        assert _kv(etcd, f"{cluster.prefix}/jobs/{job}/resize") is None
    # The only standby node is held in reserve by a running job: it is not free for another
    # (the planner would never place that job; the CLI counted the node as free).
    held = cluster.cli("run", "--job", "held", "--tp", "1", "--dp", "1", "--standby", "1",
                       "--env", "PROBE_SLEEP=60", "--", sys.executable, PROBE)
    assert held.returncode == 0, held.stderr
    cluster.wait_for("held's standby", lambda s: s.job("held") is not None and s.job(
        "held").assignment is not None and s.job("held").assignment.standbys == ("node-s",))
    cluster.wait_for("dup to end and free its slot", lambda s: s.job("dup") is not None and
                     s.job("dup").state == "done", timeout=60)  # type: ignore[union-attr]
    taken = cluster.cli("run", "--job", "sb2", "--tp", "1", "--dp", "1", "--standby", "1",
                        "--", "true")
    assert (taken.returncode, taken.stderr) == (1, (
        "understudy: cannot place job 'sb2': it needs 1 standby nodes and 0 are free (1 more "
        "held in reserve by other jobs)\n")), taken.stderr
    assert _kv(etcd, f"{cluster.prefix}/jobs/sb2/spec") is None


def test_workers_see_their_job_and_a_stale_epoch_is_refused(cluster: LocalCluster,
                                                             etcd: EmbeddedEtcd) -> None:
    from understudy.common.daemon_client import DaemonClient, DaemonError

    out = cluster.cli("run", "--job", "j3", "--tp", "1", "--dp", "1", "--env", "PROBE_SLEEP=30",
                      "--env", "THP_MEM_ALLOC_ENABLE=0", "--", sys.executable, PROBE)
    assert out.returncode == 0, out.stderr
    sock = str(cluster.daemons["node-a"].run_dir / "understudyd.sock")
    cluster.wait_for("j3 running", lambda s: s.job("j3") is not None
                     and s.job("j3").state == "running")  # type: ignore[union-attr]
    deadline = time.monotonic() + 10
    info = None
    while time.monotonic() < deadline:
        with DaemonClient("j3/probe", epoch=1, path=sock, timeout=5) as c:
            info = c.job()
        if info is not None:
            break
        time.sleep(0.1)
    assert info is not None and info["assignment"]["epoch"] == 1
    assert info["status"]["state"] == "running" and info["migration"] is None
    # The job's own allocator setting wins over the daemon's default (the probe writes it once
    # it started, which may come after the job's view above).
    deadline = time.monotonic() + 10
    while (thp := _kv(etcd, f"{cluster.prefix}/kv/j3/probe/thp0")) is None and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    assert thp == b"0"
    with pytest.raises(DaemonError, match="epoch 0 refused: job j3 is at epoch 1"):
        DaemonClient("j3/tp/v1", epoch=0, path=sock, timeout=5)


def test_a_worker_hears_of_its_job_changing_by_a_long_poll(cluster: LocalCluster) -> None:
    """The job's view is pushed: a long poll holding the current token answers when the job
    appears (not before, not at its timeout), and a client that follows its job answers from
    the view that poll keeps, the same as a direct question. Bad requests are refused and
    leave the connection usable."""
    import threading

    from understudy.common.daemon_client import DaemonClient, DaemonError

    sock = str(cluster.daemons["node-a"].run_dir / "understudyd.sock")
    with DaemonClient("j5/control", epoch=0, path=sock, timeout=5) as c:
        info, token = c.job_changed(None, 0.0)
        assert info is None and token
        with pytest.raises(DaemonError, match="unless must be a token"):
            c._call("job", unless=5, timeout=1)
        with pytest.raises(DaemonError, match="timeout must be 0 to 60 seconds"):
            c._call("job", wait=1, unless=token, timeout=3600)
        assert c.job_changed(token, 0.2) == (None, token)  # nothing changed: the timeout
        answered: list[tuple[float, Any]] = []

        def poll() -> None:
            answered.append((time.monotonic(), c.job_changed(token, 30.0)))

        waiter = threading.Thread(target=poll)
        waiter.start()
        time.sleep(1.0)
        assert not answered, "the long poll answered with nothing changed"
        submitted = time.monotonic()
        out = cluster.cli("run", "--job", "j5", "--tp", "1", "--dp", "1", "--env",
                          "PROBE_SLEEP=30", "--", sys.executable, PROBE)
        assert out.returncode == 0, out.stderr
        waiter.join(30)
        assert answered, "the long poll did not answer when the job appeared"
        at, (info, new_token) = answered[0]
        assert info is not None and info["assignment"]["epoch"] == 1 and new_token != token
        assert at - submitted < 20, "answered at its timeout, not at the change"
    with DaemonClient("j5/control", epoch=1, path=sock, timeout=5) as follower:
        follower.follow_job(lambda: 1, wait=1.0)
        deadline = time.monotonic() + 10
        while follower._view is not None and not follower._view.current()[0]:
            assert time.monotonic() < deadline, "the view never became fresh"
            time.sleep(0.05)
        with DaemonClient("j5/control", epoch=1, path=sock, timeout=5) as direct:
            cluster.wait_for("j5 running", lambda s: s.job("j5") is not None
                             and s.job("j5").state == "running")  # type: ignore[union-attr]
            deadline = time.monotonic() + 10
            while follower.job() != direct.job():
                assert time.monotonic() < deadline, "the followed view never caught up"
                time.sleep(0.05)
            assert follower.job()["status"]["state"] == "running"  # type: ignore[index]


def test_a_standby_reports_its_warmth_and_a_silent_one_is_replaced(cluster: LocalCluster,
                                                                    tmp_path: Path) -> None:
    train = str(Path(__file__).parents[2] / "examples" / "plain_torch" / "train.py")
    out = cluster.cli("run", "--job", "warm", "--tp", "2", "--dp", "2", "--standby", "1",
                      "--env=OMP_NUM_THREADS=1", "--", sys.executable, train, "--steps",
                      "100000", "--step-sleep", "0.1", "--adam", "functional")
    assert out.returncode == 0, out.stderr

    def warmth(s: Any) -> Any:
        node = s.node("node-s")
        return node.warmth.get("warm") if node is not None else None

    cluster.wait_for("the standby to be warm", lambda s: warmth(s) is not None, timeout=120)
    w = warmth(cluster.status())
    assert w["mode"] == "imports" and w["since"] > 0, w
    table = cluster.cli("status").stdout
    assert "warm: warm: imports for" in table, table
    s = cluster.daemons["node-s"]
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{s.metrics_port}/metrics",
                                     timeout=5).read().decode()
    assert 'understudy_standby_warm_since_timestamp_seconds{job="warm",mode="imports"}' \
        in metrics
    # A standby that stops answering (frozen: alive, silent) is replaced by a fresh one.
    first = worker_pid(s, "warm.standby")
    os.kill(first, signal.SIGSTOP)
    wait_log(s, "The standby worker of job warm stopped answering", timeout=60)
    cluster.wait_for("a fresh standby", lambda st: worker_pid(s, "warm.standby") != first,
                     timeout=30)
    cluster.wait_for("the fresh standby to be warm", lambda st: warmth(st) is not None and
                     warmth(st)["since"] > w["since"], timeout=120)
    with contextlib.suppress(ProcessLookupError):
        os.kill(first, 0)
        raise AssertionError("the frozen standby is still there")


def test_a_job_stopped_from_the_cli_finishes_its_step_saves_and_frees_its_nodes(
        cluster: LocalCluster, etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    from tests.integration.test_migration import ONE_THREAD, _job_args

    out = tmp_path / "out"
    env = [f"--env={k}={v}" for k, v in ONE_THREAD.items()]
    run = cluster.cli("run", "--job", "long", "--tp", "2", "--dp", "2", "--standby", "1", *env,
                      "--", sys.executable, *_job_args(out, 0.05, extra=("--steps", "5000")))
    assert run.returncode == 0, run.stderr
    cluster.wait_for("node-s warm for the job", lambda s: (n := s.node("node-s")) is not None
                     and "long" in n.warmth, timeout=60)

    def listed() -> dict[str, Any]:
        res = cluster.cli("jobs", "-o", "json")
        assert res.returncode == 0, res.stderr
        (row,) = json.loads(res.stdout)
        return row  # type: ignore[no-any-return]

    cluster.wait_for("steps reported", lambda s: (listed()["steps"] or 0) > 0, timeout=60)
    row = listed()
    assert row["state"] == "running" and row["nodes"] == ["node-a", "node-b"]
    assert row["standbys"] == ["node-s"] and row["epoch"] == 1 and row["mode"] == "live"
    table = cluster.cli("jobs").stdout
    assert table.split()[:9] == ["NAME", "STATE", "EPOCH", "LAYOUT", "NODES", "STANDBYS",
                                 "STEPS", "AGE", "MODE"] and "tp2xdp2" in table
    # Bad input changes nothing: a running job is not deleted, unknown jobs are named.
    for args, says in ((("delete", "long"), "is running: stop it first"),
                       (("stop", "nope"), "no job named 'nope'"),
                       (("delete", "nope"), "no job named 'nope'")):
        res = cluster.cli(*args)
        assert res.returncode == 1 and says in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1
    assert cluster.cli("stop", "long", "--grace", "0").returncode == 2

    stop = cluster.cli("stop", "long", "--grace", "60", "-o", "json", timeout=120)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    said = json.loads(stop.stdout)
    assert said["state"] == "stopped" and said["clean"], said
    # Every rank ended at the step they agreed on, its on_finish (the example's save) run.
    steps = {json.loads((out / f"rank{r}.json").read_text())["step"] for r in range(4)}
    (step,) = steps
    assert 0 < step < 5000
    assert listed()["steps"] == step  # rank 0's last report
    # The nodes go back: the standby's worker ends (the daemons stop it), node-s stands by.
    wait_log(cluster.daemons["node-s"], "worker long.standby (pid", timeout=30)
    assert cluster.status().node("node-s").state == "standby"  # type: ignore[union-attr]
    again = cluster.cli("stop", "long")
    assert again.returncode == 1 and "is stopped: there is nothing to stop" in again.stderr

    deleted = cluster.cli("delete", "long", "-o", "json")
    assert deleted.returncode == 0 and json.loads(deleted.stdout)["deleted"], deleted.stderr
    assert cluster.cli("jobs").stdout.strip() == "no jobs"
    assert _kv(etcd, f"{cluster.prefix}/jobs/long/spec") is None
    assert _kv(etcd, f"{cluster.prefix}/kv/long/progress/0") is None


def test_a_stop_the_ranks_cannot_finish_within_its_grace_names_them_and_exits_1(
        cluster: LocalCluster, etcd: EmbeddedEtcd) -> None:
    # The probe is no worker-API job: it takes no part in the step vote, so it never agrees to
    # stop; it sleeps on. At the grace's end the job is stopped as it is, its ranks named.
    out = cluster.cli("run", "--job", "stuck", "--tp", "1", "--dp", "2", "--env",
                      "PROBE_SLEEP=300", "--", sys.executable, PROBE)
    assert out.returncode == 0, out.stderr
    for rank in (0, 1):
        cluster.wait_for(f"rank {rank} up", lambda s, r=rank: _kv(
            etcd, f"{cluster.prefix}/kv/stuck/probe/pid{r}") is not None, timeout=30)
    pids = [int(_kv(etcd, f"{cluster.prefix}/kv/stuck/probe/pid{r}") or b"0") for r in (0, 1)]
    stop = cluster.cli("stop", "stuck", "--grace", "2", timeout=60)
    assert stop.returncode == 1, stop.stdout + stop.stderr
    assert "rank(s) 0, 1 did not finish within the grace of 2 s" in stop.stdout, stop.stdout
    job = cluster.status().job("stuck")
    assert job is not None and job.state == "stopped"
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in pids):  # the daemons stop what is left
        assert time.monotonic() < deadline, "the stuck ranks were not stopped"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
