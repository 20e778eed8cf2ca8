"""Control plane end to end: real etcd, real understudyd processes, the real CLI."""

from __future__ import annotations

import dataclasses
import json
import signal
import socket
import time
import urllib.request
from pathlib import Path

import pytest

from tests.integration.scenarios import wait_log
from understudy.common.records import (
    Assignment,
    JobSpec,
    JobState,
    JobStatus,
    Migration,
    MigrationPhase,
)
from understudy.testing.embedded_etcd import EmbeddedEtcd
from understudy.testing.localcluster import LocalCluster

pytestmark = pytest.mark.slow


def _three(c: LocalCluster) -> None:
    c.add("node-a", "active")
    c.add("node-b", "active")
    c.add("node-s", "standby")
    c.wait_state("node-a", "active")
    c.wait_state("node-b", "active")
    c.wait_state("node-s", "standby")
    c.wait_for("a controller", lambda s: s.controller is not None)


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_registration_status_and_controller(cluster: LocalCluster) -> None:
    _three(cluster)
    out = cluster.cli("status", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    states = {n["name"]: n["state"] for n in data["nodes"]}
    assert states == {"node-a": "active", "node-b": "active", "node-s": "standby"}
    assert data["controller"] in states
    table = cluster.cli("status")
    assert table.returncode == 0 and "node-s" in table.stdout and "standby" in table.stdout
    assert _metric(cluster.daemons[data["controller"]].metrics_port,
                   "understudy_controller") == 1
    # The daemons that lost the election wait on a watch of the controller key, and write
    # nothing to etcd while it stands: a campaign's create-if-absent is a raft proposal even
    # when it fails (each non-controller sent one every 5 s: 51 writes a second at 256 nodes).
    others = [d for name, d in cluster.daemons.items() if name != data["controller"]]
    txns = 'understudy_etcd_requests_total{op="txn"}'
    before = [_metric(d.metrics_port, txns) for d in others]
    time.sleep(6.0)
    assert [_metric(d.metrics_port, txns) for d in others] == before


def test_kill9_is_seen_as_failed_within_ttl_plus_one_second(cluster: LocalCluster) -> None:
    _three(cluster)
    victim = next(n for n in ("node-a", "node-b") if n != cluster.status().controller)
    t0 = time.monotonic()
    cluster.daemons[victim].kill9()
    cluster.wait_state(victim, "failed", timeout=cluster.lease_ttl + 5)
    elapsed = time.monotonic() - t0
    assert elapsed <= cluster.lease_ttl + 1.0, f"failure seen after {elapsed:.2f}s"
    events = cluster.cli("events", "--json")
    kinds = [json.loads(line)["kind"] for line in events.stdout.splitlines()]
    assert "node-failed" in kinds


def test_controller_failover(cluster: LocalCluster) -> None:
    _three(cluster)
    old = cluster.status().controller
    assert old is not None
    t0 = time.monotonic()
    cluster.daemons[old].kill9()
    cluster.wait_for("a new controller", lambda s: s.controller not in (None, old),
                     timeout=cluster.lease_ttl + 5)
    assert time.monotonic() - t0 < cluster.lease_ttl + 2
    # The new controller does its job: the old one's node is declared failed.
    cluster.wait_state(old, "failed", timeout=cluster.lease_ttl + 5)


def test_a_failing_controller_round_is_contained(cluster: LocalCluster) -> None:
    # Every daemon's controller round raises once (a failpoint standing in for a planner bug);
    # no daemon dies of it, and the controller goes on deciding.
    armed = {"UNDERSTUDY_FAILPOINTS": "controller.round=raise"}
    for n, role in (("node-a", "active"), ("node-b", "active"), ("node-s", "standby")):
        cluster.add(n, role, env=armed)
    for n, role in (("node-a", "active"), ("node-b", "active"), ("node-s", "standby")):
        cluster.wait_state(n, role)
    cluster.wait_for("a controller", lambda s: s.controller is not None)
    leader = cluster.status().controller
    assert leader is not None
    # The round that raised may still be under way when the lease is won: wait for its log.
    wait_log(cluster.daemons[leader], "The controller's round failed", timeout=10)
    victim = next(n for n in ("node-a", "node-b") if n != leader)
    cluster.daemons[victim].kill9()
    cluster.wait_state(victim, "failed", timeout=cluster.lease_ttl + 5)
    assert all(d.alive() for n, d in cluster.daemons.items() if n != victim)
    assert _metric(cluster.daemons[leader].metrics_port, "understudy_errors_total") >= 1


def test_a_controller_whose_every_round_fails_resigns_and_another_leads(
        cluster: LocalCluster) -> None:
    # node-a's rounds all raise (a failpoint standing in for a bug, or an environment, of that
    # daemon alone): it must not keep the cluster without a working controller. After 5 in a
    # row it gives the key up and stands aside; another daemon leads and decides.
    a = cluster.add("node-a", "active",
                    env={"UNDERSTUDY_FAILPOINTS": "controller.round=1000*raise"})
    cluster.wait_state("node-a", "active")
    cluster.wait_for("node-a to lead", lambda s: s.controller == "node-a")
    cluster.add("node-b", "active")
    cluster.add("node-s", "standby")
    wait_log(a, "The controller's round failed", timeout=10)
    assert _metric(a.metrics_port, "understudy_controller_failed_rounds") >= 1
    cluster.wait_for("another controller", lambda s: s.controller not in (None, "node-a"),
                     timeout=60)
    resigned = [e for e in cluster.events() if e.kind == "controller-resigned"]
    assert [e.node for e in resigned] == ["node-a"], resigned
    assert "its last 5 rounds failed" in resigned[0].message
    assert a.alive()
    assert _metric(a.metrics_port, "understudy_controller") == 0
    assert _metric(a.metrics_port, "understudy_controller_failed_rounds") == 0
    # The new controller decides: the third node, killed, is declared failed.
    leader = cluster.status().controller
    victim = next(n for n in ("node-b", "node-s") if n != leader)
    cluster.daemons[victim].kill9()
    cluster.wait_state(victim, "failed", timeout=cluster.lease_ttl + 5)
    assert cluster.status().controller == leader  # node-a stood aside


def test_drain_undrain_cordon_via_cli(cluster: LocalCluster) -> None:
    _three(cluster)
    out = cluster.cli("drain", "node-b", "--deadline", "20", "--wait")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "node-b: drained" in out.stdout
    assert cluster.status().node("node-b").state == "drained"  # type: ignore[union-attr]
    again = cluster.cli("drain", "node-b")
    assert again.returncode == 0 and "already" in again.stdout
    out = cluster.cli("undrain", "node-b")
    assert out.returncode == 0, out.stderr
    cluster.wait_state("node-b", "active", timeout=10)
    assert cluster.cli("cordon", "node-a").returncode == 0
    cluster.wait_for("node-a cordoned", lambda s: s.node("node-a").cordoned)  # type: ignore
    assert cluster.status().node("node-a").state == "active"  # type: ignore[union-attr]
    assert cluster.cli("uncordon", "node-a").returncode == 0
    cluster.wait_for("node-a uncordoned", lambda s: not s.node("node-a").cordoned)  # type: ignore
    kinds = [json.loads(line)["kind"]
             for line in cluster.cli("events", "--json").stdout.splitlines()]
    assert {"node-draining", "node-drained", "node-undrained"} <= set(kinds)


def test_sigterm_drains_then_leaves_cleanly(cluster: LocalCluster) -> None:
    _three(cluster)
    d = cluster.daemons["node-a"]
    d.signal(signal.SIGTERM)
    assert d.wait(timeout=30) == 0
    node = cluster.status().node("node-a")
    assert node is not None and node.state == "drained" and not node.online
    assert node.drain is not None and node.drain.source == "sigterm"
    time.sleep(cluster.lease_ttl + 1)
    # A clean leave is not a failure.
    assert cluster.status().node("node-a").state == "drained"  # type: ignore[union-attr]


def test_etcd_restart_is_survived(cluster: LocalCluster, etcd: EmbeddedEtcd) -> None:
    _three(cluster)
    etcd.stop()
    time.sleep(1.0)
    etcd.start()
    cluster.wait_for("all nodes back in service", lambda s: [n.state for n in s.nodes] ==
                     ["active", "active", "standby"] and all(n.online for n in s.nodes),
                     timeout=20)
    for d in cluster.daemons.values():
        assert d.alive()
    # Still a working control plane: a drain goes through.
    assert cluster.cli("drain", "node-b", "--wait", "--deadline", "10").returncode == 0


def test_etcd_down_longer_than_the_lease_fences_nothing(cluster: LocalCluster,
                                                        etcd: EmbeddedEtcd) -> None:
    _three(cluster)
    etcd.stop()
    time.sleep(cluster.lease_ttl + 1.5)
    etcd.start()
    # etcd renews the leases it held when it restarts (a new leader refreshes every lease):
    # each daemon's next keep-alive on its old lease is acknowledged, which ends the outage.
    for d in cluster.daemons.values():
        wait_log(d, "etcd answers again after an outage", timeout=30)
    cluster.wait_for("all nodes in their roles", lambda s: [n.state for n in s.nodes] ==
                     ["active", "active", "standby"] and all(n.online for n in s.nodes),
                     timeout=30)
    for name, d in cluster.daemons.items():
        assert d.alive(), name
        assert d.log_text().count('"Node registered."') == 1, name
        assert _metric(d.metrics_port, "understudy_fences_total") == 0, name
        assert _metric(d.metrics_port, "understudy_etcd_outages_total") == 1, name
        assert _metric(d.metrics_port, "understudy_etcd_reachable") == 1, name
    kinds = [json.loads(line)["kind"] for line in cluster.cli("events", "--json").stdout
             .splitlines()]
    assert kinds.count("etcd-reachable") == 3 and "node-failed" not in kinds, kinds


def _revoke_lease(cluster: LocalCluster, etcd: EmbeddedEtcd, node: str) -> None:
    """Revoke ``node``'s lease at etcd, as an expiry would end it."""
    import asyncio

    from understudy.common import config
    from understudy.common.store import EtcdStore

    async def revoke() -> None:
        s = EtcdStore(config.load(overrides={"etcd.endpoints": etcd.endpoint}, environ={},
                                  require_node=False).etcd)
        try:
            kv = await s.get(f"{cluster.prefix}/nodes/{node}")
            assert kv is not None and kv.lease
            await s.revoke(kv.lease)
        finally:
            await s.close()

    asyncio.run(revoke())


def test_a_lease_gone_at_etcd_is_evidence_the_node_fences_and_rejoins(
        cluster: LocalCluster, etcd: EmbeddedEtcd) -> None:
    _three(cluster)
    _revoke_lease(cluster, etcd, "node-b")
    b = cluster.daemons["node-b"]
    wait_log(b, "Node lost its lease: etcd says the lease has expired", timeout=10)
    wait_log(b, '"Node registered."', timeout=30, times=2)
    cluster.wait_state("node-b", "active", timeout=30)
    assert _metric(b.metrics_port, "understudy_fences_total") == 1
    for name in ("node-a", "node-s"):
        assert "fenced itself" not in cluster.daemons[name].log_text(), name


def test_a_worker_decided_under_a_lease_the_node_lost_is_not_started(
        cluster: LocalCluster, etcd: EmbeddedEtcd) -> None:
    """Review L2: the daemon decided which workers to start under its lease and started them
    after awaits in which the lease could be lost, so a node that had fenced (and registered
    again, its workers re-examined) could still start a worker decided before. Here node-a's
    start of rank 0 is held at the failpoint ``daemon.spawn`` while etcd revokes its lease:
    the start is dropped, and whatever starts later is decided under the new lease."""
    import sys

    cluster.add("node-a", "active", env={"UNDERSTUDY_FAILPOINTS": "daemon.spawn=sleep(3)"})
    cluster.wait_state("node-a", "active")
    cluster.wait_for("a controller", lambda s: s.controller is not None)
    a = cluster.daemons["node-a"]
    probe = str(Path(__file__).parents[1] / "workers" / "probe.py")
    out = cluster.cli("run", "--job", "held", "--tp", "1", "--dp", "1", "--standby", "0", "--",
                      sys.executable, probe)
    assert out.returncode == 0, out.stderr
    wait_log(a, "failpoint daemon.spawn fired", timeout=30)
    _revoke_lease(cluster, etcd, "node-a")
    wait_log(a, "Node lost its lease", timeout=10)
    wait_log(a, "Not starting a worker: this node lost the lease it was decided under.",
             timeout=10)
    lines = a.log_text().splitlines()
    fenced = next(i for i, line in enumerate(lines) if "Node lost its lease" in line)
    refused = next(i for i, line in enumerate(lines) if "Not starting a worker" in line)
    assert not any("Started rank 0 of job held" in line for line in lines[fenced:refused])
    started = [i for i, line in enumerate(lines) if "Started rank 0 of job held" in line]
    registered = [i for i, line in enumerate(lines) if '"Node registered."' in line]
    assert all(i > registered[-1] for i in started), (started, registered)


def test_bad_values_are_ignored_and_counted(cluster: LocalCluster, etcd: EmbeddedEtcd) -> None:
    import asyncio

    from understudy.common import config
    from understudy.common.store import EtcdStore

    _three(cluster)
    p = cluster.prefix
    garbage = {
        f"{p}/registry/ghost": b"\xff\xfe not json",
        f"{p}/registry/node-x": json.dumps({"schema": "other/v9", "record": "registry"}).encode(),
        f"{p}/nodes/imposter": b'{"schema":"understudy/v1","record":"node","name":1}',
        f"{p}/drains/node-a": b"[1,2,3]",
        f"{p}/events/zzz": b"x" * (200 * 1024),
        f"{p}/registry/node-b": b'{"schema":"understudy/v1","record":"registry","name":"node-b"}',
        # Over the controller's key, without a lease: it deposes the controller, and would
        # never go by itself; a daemon takes the key over and leads.
        f"{p}/controller": b"\xff not a controller",
    }

    # Valid records that do not fit together (the security review's H4): an assignment with
    # more ranks than its job has, and a migration naming a rank past the job's world. A daemon
    # named in them used to stop on an index error, and crash again once restarted.
    now = time.time()
    ghost = JobSpec(name="ghost", argv=("true",), cwd="/", tp=1, dp=1, standby=0,
                    created_at=now)
    stray = dataclasses.replace(ghost, name="stray", dp=2)
    for spec, ranks in ((ghost, ("node-a", "node-a")), (stray, ("node-a", "node-b"))):
        garbage[f"{p}/jobs/{spec.name}/spec"] = spec.encode()
        garbage[f"{p}/jobs/{spec.name}/status"] = JobStatus(
            job=spec.name, state=JobState.RUNNING, reason="", updated_at=now).encode()
        garbage[f"{p}/jobs/{spec.name}/assignment"] = Assignment(
            job=spec.name, epoch=1, ranks=ranks, standbys=("node-s",), reason="",
            updated_at=now).encode()
    garbage[f"{p}/jobs/stray/migration"] = Migration(
        job="stray", id="e2-1", from_epoch=1, to_epoch=2, ranks=(5,), leavers=("node-b",),
        joiners=("node-s",), phase=MigrationPhase.PLANNED, reason="", created_at=now,
        deadline=now + 60, updated_at=now).encode()

    async def write() -> None:
        cfg = config.load(overrides={"etcd.endpoints": etcd.endpoint}, environ={},
                          require_node=False)
        s = EtcdStore(cfg.etcd)
        # At once: a job's records one by one could fit together for a moment.
        assert await s.txn(compare=[], success=[("put", k, v, None)
                                                for k, v in garbage.items()])
        await s.close()

    asyncio.run(write())
    time.sleep(2.0)
    for d in cluster.daemons.values():
        assert d.alive()
    status = cluster.status()
    assert status.node("node-a").state == "active"  # type: ignore[union-attr]
    cluster.wait_for("a controller again", lambda s: s.controller is not None, timeout=15)
    # node-b repaired its own registry entry; nobody failed, nobody drained.
    cluster.wait_for("node-b repaired", lambda s: s.node("node-b") is not None
                     and s.node("node-b").state == "active")  # type: ignore[union-attr]
    assert all(n.state in ("active", "standby") for n in cluster.status().nodes)
    total = sum(_metric(d.metrics_port, "understudy_bad_values_total")
                for d in cluster.daemons.values())
    assert total >= 3
    # The misfit jobs are bad values to the nodes they name: nothing started, nobody stopped.
    for node, job in (("node-a", "ghost"), ("node-a", "stray"), ("node-b", "stray"),
                      ("node-s", "stray")):
        wait_log(cluster.daemons[node], f"the records of job {job} do not fit together")
    for d in cluster.daemons.values():
        assert d.alive() and "Started rank" not in d.log_text()
        assert "Job reconcile failed" not in d.log_text()
    out = cluster.cli("status")
    assert out.returncode == 0 and "unreadable" in out.stdout


def test_cli_misuse_changes_nothing(cluster: LocalCluster, etcd: EmbeddedEtcd) -> None:
    _three(cluster)
    cluster.wait_settled()
    before = cluster.status().revision
    out = cluster.cli("drain", "no-such-node")
    assert out.returncode == 1 and out.stderr.count("\n") == 1
    assert "no node named 'no-such-node'" in out.stderr
    assert cluster.cli("cordon", "nope").returncode == 1
    bad = cluster.cli("drain")
    assert bad.returncode == 2
    neg = cluster.cli("drain", "node-a", "--deadline", "-3")
    assert neg.returncode == 2
    for endless in ("nan", "inf"):  # NaN passes "<= 0"; it once wrote "deadline":NaN
        out = cluster.cli("drain", "node-a", "--deadline", endless)
        assert out.returncode == 2 and "--deadline must be a positive number" in out.stderr
    assert cluster.cli("frobnicate").returncode == 2
    assert cluster.status().revision == before, "a refused command wrote to etcd"
    down = LocalCluster(etcd_endpoint="127.0.0.1:1", base_dir=cluster.base_dir)
    out = down.cli("status", "--timeout", "0.5")
    assert out.returncode == 1 and "etcd" in out.stderr and "Traceback" not in out.stderr


def test_bad_daemon_config_exits_2(tmp_path: Path, etcd: EmbeddedEtcd) -> None:
    import subprocess
    import sys

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "understudy.daemon.main", *args],
                              capture_output=True, text=True, timeout=30)

    cfg = tmp_path / "bad.toml"
    cfg.write_text('node = "n1"\netcd = "127.0.0.1:2379"\n[lease]\nttl = 3\n'
                   'keepalive_interval = 2.5\n')
    out = run("--config", str(cfg))
    assert out.returncode == 2 and "keepalive_interval" in out.stderr
    assert run("--node", "Bad_Name", "--etcd", etcd.endpoint).returncode == 2
    assert run("--node", "n1").returncode == 2
    cfg.write_text("this is not toml = = \n")
    assert run("--config", str(cfg)).returncode == 2
    ok = run("--node", "n1", "--etcd", etcd.endpoint, "--check-config")
    assert ok.returncode == 0, ok.stderr
    # A metrics address another process holds: one sentence and exit code 2, no traceback,
    # nothing registered.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = run("--node", "n1", "--etcd", etcd.endpoint, "--run-dir", str(tmp_path / "run"),
                   "--metrics-listen", f"127.0.0.1:{port}")
    assert busy.returncode == 2, busy.stderr
    assert f"cannot serve metrics on 127.0.0.1:{port}" in busy.stderr
    assert "Traceback" not in busy.stderr
    # An address other nodes cannot reach, or one that is not this host's: refused at start.
    wildcard = run("--node", "n1", "--etcd", etcd.endpoint, "--address", "0.0.0.0")
    assert wildcard.returncode == 2 and "names no host other nodes can reach" in \
        wildcard.stderr, wildcard.stderr
    foreign = run("--node", "n1", "--etcd", etcd.endpoint, "--run-dir", str(tmp_path / "run"),
                  "--address", "198.51.100.77")
    assert foreign.returncode == 2, foreign.stderr
    assert "'198.51.100.77' is not an address of this host" in foreign.stderr
    assert "Traceback" not in foreign.stderr
