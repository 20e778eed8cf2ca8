"""Recovery from unexpected failures end to end: a TP=2 x DP=2 job under real daemons loses a
rank's process (kill -9) or a whole node (daemon and workers killed, or frozen with no TCP
reset); a standby takes each lost rank with the state of a data-parallel replica, the failed
step is redone, and the final state is compared bit for bit with an uninterrupted run."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.integration.bitwise import assert_bitwise_equal
from tests.integration.scenarios import (
    events,
    local,
    start,
    wait_gone,
    wait_log,
    wait_standbys,
    worker_pid,
)
from tests.integration.test_migration import (
    STEPS,
    _finish,
    _run_job,
    standalone_run,
)
from understudy.cli.cluster import ClusterStatus
from understudy.testing.embedded_etcd import EmbeddedEtcd
from understudy.testing.localcluster import DaemonProcess, LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


STANDBYS = ("node-s1", "node-s2")


@contextlib.contextmanager
def training(etcd: EmbeddedEtcd, tmp_path: Path, active: dict[str, int],
             standbys: tuple[str, ...], armed: dict[str, dict[str, str]] | None = None,
             leader: str | None = None, **job: Any) -> Iterator[tuple[LocalCluster, Path]]:
    """A cluster (``armed``: extra daemon environments; ``leader``: as ``start``) running the
    plain job (``job``: as ``_run_job``) with every standby worker up; yields it and the job's
    output directory."""
    c = start(etcd, tmp_path / "cluster", active, standbys, env=armed, leader=leader)
    try:
        out = tmp_path / "out"
        _run_job(c, out, **job)
        wait_standbys(c, standbys)
        yield c, out
    finally:
        c.stop_all(timeout=5, drain=False)


def _wait_steps(d: DaemonProcess, rank: int, steps: int) -> None:
    """Until ``rank`` on ``d`` committed ``steps`` steps (the runtime says so every 50)."""
    wait_log(d, f"{steps} steps committed on rank {rank}", timeout=120)


def _recovery_done(c: LocalCluster) -> dict:
    c.wait_for("the recovery to finish", lambda s: any(
        e["kind"] == "migration-done" for e in events(c)), timeout=120)
    return next(e for e in events(c) if e["kind"] == "migration-done")


def test_a_killed_rank_is_replaced_from_its_replica_and_the_result_is_bitwise_identical(
        etcd: EmbeddedEtcd, reference: Path, tmp_path: Path) -> None:
    # The donor (rank 3, node-b) builds its rebuilt DP group 3 s late (a failpoint, which
    # holds its first build at the start as well): the state crosses while it comes up.
    late = {"node-b": {"UNDERSTUDY_FAILPOINTS": "group.build.dp-1=2*sleep(3)"}}
    with training(etcd, tmp_path, {"node-a": 2, "node-b": 2}, ("node-s1",), armed=late,
                  standby=1) as (c, out):
        a = c.daemons["node-a"]
        _wait_steps(a, 1, 50)
        os.kill(worker_pid(a, "mig.r1"), signal.SIGKILL)
        done = _recovery_done(c)
        planned = next(e for e in events(c) if e["kind"] == "migration-planned")
        assert "recovery: rank 1 -> node-s1 (state from rank 3)" in planned["message"]
        job = _finish(c)
        assert job.assignment.epoch == 2
        assert job.assignment.ranks == ("node-a", "node-s1", "node-b", "node-b")
        # Nobody else restarted; rank 0 (rank 1's TP partner) and ranks 2, 3 trained on.
        assert a.log_text().count("Started rank 0 of job mig") == 1
        assert c.daemons["node-b"].log_text().count("Started rank 3 of job mig") == 1
        assert done["details"]["id"] == planned["details"]["id"]
        summary = json.loads((out / "rank1.json").read_text())
        assert summary["step"] == STEPS
        assert_bitwise_equal(reference, out, world=4)
        donor = c.daemons["node-b"].log_text()
        gave = donor.index("Gave rank 1's joiner the state of step")
        built = [m.start() for m in re.finditer(r'"group": "dp-1".*Built a group version', donor)]
        assert len(built) == 2 and gave < built[1], "the state waited for the DP group"


def test_a_node_lost_as_the_job_starts_is_replaced_and_the_result_is_bitwise_identical(
        etcd: EmbeddedEtcd, reference: Path, tmp_path: Path) -> None:
    # Both of node-b's ranks die as they start, before they join any group: node-a's ranks wait
    # in their first group builds for peers that never come. They must not wait out the group
    # timeout and fail (the job lost, with nothing committed yet): once the recovery is planned
    # they take part in it from step 0, donors of the state they built.
    armed = {"node-b": {"UNDERSTUDY_FAILPOINTS": "rank.first-groups=exit(9)"}}
    with training(etcd, tmp_path, {"node-a": 2, "node-b": 2}, STANDBYS, armed=armed,
                  standby=2) as (c, out):
        _recovery_done(c)
        job = _finish(c)
        assert job.assignment is not None
        assert sorted(job.assignment.ranks[2:]) == ["node-s1", "node-s2"]
        a = c.daemons["node-a"].log_text()
        assert a.count("Started rank 0 of job mig") == a.count("Started rank 1 of job mig") == 1
        assert a.count("taking part in it from step 0") == 2, a[-3000:]
        assert "was not built within" not in a
        assert_bitwise_equal(reference, out, world=4)


def test_a_crashed_node_is_found_by_its_closed_probe_port_and_replaced(
        etcd: EmbeddedEtcd, reference: Path, tmp_path: Path) -> None:
    # node-a leads: the controller's own node is not probed (its loss is the TTL's, and an
    # election's), and this test is about a node the controller probes. At the end, node-s2
    # dies as its rank finishes, before it reports the exit (a failpoint).
    armed = {"node-s2": {"UNDERSTUDY_FAILPOINTS": "daemon.rank-exit.clean=exit(9)"}}
    with training(etcd, tmp_path, {"node-a": 2, "node-b": 2}, STANDBYS, armed=armed,
                  leader="node-a") as (c, out):
        _wait_steps(c.daemons["node-b"], 2, 50)
        ranks = [worker_pid(c.daemons["node-b"], f"mig.r{r}") for r in (2, 3)]
        c.daemons["node-b"].kill9()  # the daemon and both its ranks, at once
        wait_gone(ranks, timeout=2)  # the ranks die with their daemon (worker.lifeline)
        _recovery_done(c)
        evs = events(c)
        kinds = [e["kind"] for e in evs]
        # Detected by the controller's probe (its port refuses), not the lease's TTL: the
        # controller revoked the lease, the node failed, then its ranks were recovered.
        assert kinds.index("node-unreachable") < kinds.index("node-failed") < \
            kinds.index("migration-planned"), kinds
        failed = next(e for e in evs if e["kind"] == "node-failed")
        assert "probe port refuses" in failed["message"], failed
        planned = next(e for e in evs if e["kind"] == "migration-planned")
        assert "rank 2 -> node-s1 (state from rank 0)" in planned["message"]
        assert "rank 3 -> node-s2 (state from rank 1)" in planned["message"]
        # node-s2 lost as the job ends: its rank had finished (the others did), so nothing is
        # recovered, and the job is done, saying which rank went unreported.
        job = _finish(c)
        assert job.assignment.epoch == 2
        assert job.assignment.ranks == ("node-a", "node-a", "node-s1", "node-s2")
        assert "rank(s) 3 went before reporting their exit: node node-s2 holding rank 3 is " \
            "gone" in job.status.reason, job.status
        assert c.daemons["node-s2"].wait(timeout=10) == 9
        assert sum(e["kind"] == "migration-planned" for e in events(c)) == 1
        assert c.daemons["node-a"].log_text().count("Started rank 0 of job mig") == 1
        assert_bitwise_equal(reference, out, world=4)


def test_a_frozen_node_is_replaced_fences_itself_on_waking_and_rejoins_clean(
        etcd: EmbeddedEtcd, reference: Path, tmp_path: Path) -> None:
    # SIGSTOP of the daemon and its ranks: no process dies, no connection is reset. The
    # survivors wait in their collectives until the controller finds the node silent (its
    # probes go unanswered), revokes its lease and plans the recovery.
    c = start(etcd, tmp_path / "cluster", {"node-a": 2, "node-b": 2}, ("node-s1", "node-s2"),
              leader="node-a")
    b = c.daemons["node-b"]
    frozen: list[int] = []
    try:
        out = tmp_path / "out"
        _run_job(c, out)
        wait_standbys(c, ("node-s1", "node-s2"))
        _wait_steps(b, 2, 50)
        # Every process of the node: the ranks lead their own sessions, outside the daemon's.
        frozen = [b.pid, *(p.pid for p in psutil.Process(b.pid).children(recursive=True))]
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        _recovery_done(c)
        failed = next(e for e in events(c) if e["kind"] == "node-failed")
        assert "answered no probe" in failed["message"], failed
        a_log = c.daemons["node-a"].log_text()
        assert "told to abort" in a_log  # released by the daemon's word, not a timeout
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
        # On waking it finds its lease gone and comes back as a new incarnation with no rank;
        # its old ranks are killed (by the fence's check, or first by its job runner seeing
        # them replaced: whichever runs first on waking), and the job, at epoch 2, never
        # hears from them.
        c.wait_for("node-b fenced", lambda s: any(
            e["kind"] == "node-fenced" and e["node"] == "node-b" for e in events(c)),
            timeout=60)
        deadline = time.monotonic() + 30
        while any(_running(p) for p in frozen[1:]):
            assert time.monotonic() < deadline, "node-b's old ranks still run"
            time.sleep(0.1)
        c.wait_state("node-b", "active", timeout=30)
        job = _finish(c)
        assert job.assignment.epoch == 2
        assert job.assignment.ranks == ("node-a", "node-a", "node-s1", "node-s2")
        assert_bitwise_equal(reference, out, world=4)
    finally:
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        c.stop_all(timeout=5, drain=False)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_an_exhausted_pool_pauses_the_job_until_a_standby_joins(
        etcd: EmbeddedEtcd, reference: Path, tmp_path: Path) -> None:
    with training(etcd, tmp_path, {"node-a": 2, "node-b": 2}, ("node-s1",),
                  standby=1) as (c, out):
        _wait_steps(c.daemons["node-a"], 1, 50)
        os.kill(worker_pid(c.daemons["node-a"], "mig.r1"), signal.SIGKILL)
        _recovery_done(c)
        # The pool is empty now: the next loss pauses the job (nothing fails, nothing hangs).
        _wait_steps(c.daemons["node-b"], 2, 100)
        os.kill(worker_pid(c.daemons["node-b"], "mig.r2"), signal.SIGKILL)
        c.wait_for("the job to pause", lambda s: any(
            e["kind"] == "job-paused" for e in events(c)), timeout=60)
        paused = next(e for e in events(c) if e["kind"] == "job-paused")
        assert "waiting for a standby" in paused["message"]
        time.sleep(3)
        job = c.status().job("mig")
        assert job is not None and job.state == "running" and job.assignment.epoch == 2
        assert job.paused and job.shown_state == "running (paused)"
        # Capacity returns: a new standby node joins the pool and takes rank 2.
        c.add("node-s3", "standby")
        c.wait_for("the job to resume", lambda s: (j := s.job("mig")) is not None
                   and j.status is not None and not j.paused, timeout=60)
        job = _finish(c)
        kinds = [e["kind"] for e in events(c)]
        assert "standbys-added" in kinds and "job-resumed" in kinds, kinds
        assert job.assignment.epoch == 3
        assert job.assignment.ranks == ("node-a", "node-s1", "node-s3", "node-b")
        assert_bitwise_equal(reference, out, world=4)


def test_a_job_without_a_pool_pauses_on_two_losses_and_resumes_once_two_standbys_joined(
        etcd: EmbeddedEtcd, reference: Path, tmp_path: Path) -> None:
    # --standby 0 and no standby node at all; ranks 0 (node-a) and 3 (node-b) killed together.
    # The job is not failed: it pauses with its survivors' state in memory, no rank is started
    # again at the old epoch, and it resumes once as many standbys as it lost have joined, one
    # at a time, although its --standby count is 0.
    with training(etcd, tmp_path, {"node-a": 2, "node-b": 2}, (), standby=0) as (c, out):
        a, b = c.daemons["node-a"], c.daemons["node-b"]
        _wait_steps(a, 0, 50)
        survivors = {r: worker_pid(d, f"mig.r{r}") for r, d in ((1, a), (2, b))}
        os.kill(worker_pid(a, "mig.r0"), signal.SIGKILL)
        os.kill(worker_pid(b, "mig.r3"), signal.SIGKILL)

        def paused(s: ClusterStatus, needed: str) -> bool:
            job = s.job("mig")
            return job is not None and job.status is not None and job.paused and \
                needed in job.status.reason
        c.wait_for("the job to pause for two standbys", lambda s: paused(s, "0 free, 2 needed"),
                   timeout=60)
        job = c.status().job("mig")
        assert job is not None and job.state == "running" and job.assignment.epoch == 1
        c.add("node-s1", "standby")
        c.wait_for("one standby in the pool", lambda s: paused(s, "1 free, 2 needed"),
                   timeout=60)
        assert {r: worker_pid(d, f"mig.r{r}") for r, d in ((1, a), (2, b))} == survivors
        c.add("node-s2", "standby")
        job = _finish(c)
        assert job.assignment.epoch == 2
        assert job.assignment.ranks == ("node-s1", "node-a", "node-b", "node-s2")
        kinds = [e["kind"] for e in events(c)]
        assert "job-failed" not in kinds and "job-resumed" in kinds, kinds
        # Each rank was started once on its node: never again at epoch 1 once it was killed.
        assert a.log_text().count("Started rank 0 of job mig") == 1
        assert b.log_text().count("Started rank 3 of job mig") == 1
        assert_bitwise_equal(reference, out, world=4)


@pytest.mark.parametrize("victim", ["stayer", "leaver"])
def test_a_rank_crashing_during_a_drain_aborts_it_recovers_then_the_drain_completes(
        etcd: EmbeddedEtcd, reference: Path, tmp_path: Path,
        victim: str) -> None:
    # The drain's joiners (node-s1, node-s2) hold phase 1 open for 5 s once their groups are
    # up (a failpoint; each fresh standby process again), so that a rank dies with phase 1
    # under way: rank 0, a stayer, or rank 2, one of the drained node's leavers. Slow steps
    # leave the retried drain time to finish before the job. (The ranks train and the
    # standbys are up once `training` yields: the drain comes at once.)
    # When the stayer dies, its donor (rank 2, node-b) reports its transfer 3 s late: the
    # joiner takes over, the controller commits the recovery and plans the drain again before
    # the other survivors heard the transfer went well. They must take their recovery for done,
    # not for replaced by the drain (which left them waiting for a recovery that never came).
    node, child, rank = ("node-a", "mig.r0", 0) if victim == "stayer" else ("node-b", "mig.r2", 2)
    hold = {"UNDERSTUDY_FAILPOINTS": "joiner.prepared=sleep(5)"}
    armed = {"node-s1": hold, "node-s2": hold}
    if victim == "stayer":
        armed["node-b"] = {"UNDERSTUDY_FAILPOINTS": "donor.transferred=sleep(3)"}
    with training(etcd, tmp_path, {"node-a": 2, "node-b": 2}, (*STANDBYS, "node-s3"),
                  armed=armed, standby=3, step_sleep=0.4) as (c, out):
        a = c.daemons["node-a"]
        assert c.cli("drain", "node-b", "--deadline", "240").returncode == 0
        wait_log(c.daemons["node-s1"], "failpoint joiner.prepared fired", timeout=60)
        wait_log(a, "Phase 1 of migration", timeout=30)
        os.kill(worker_pid(c.daemons[node], child), signal.SIGKILL)  # in phase 1
        c.wait_for("the drain to be called off", lambda s: any(
            e["kind"] == "migration-aborted" for e in events(c)), timeout=60)
        aborted = next(e for e in events(c) if e["kind"] == "migration-aborted")
        assert f"rank {rank} failed" in aborted["message"], aborted
        # Recovery (epoch 2), then the drain again (epoch 3), before the job may run out.
        c.wait_for("the drain to complete", lambda s: s.job("mig").assignment.epoch == 3,
                   timeout=180)
        if victim == "stayer":
            assert "failpoint donor.transferred fired" in c.daemons["node-b"].log_text()
        job = _finish(c)
        planned = [e["message"] for e in events(c) if e["kind"] == "migration-planned"]
        assert any(f"recovery: rank {rank} ->" in m for m in planned), planned
        # Recovery (epoch 2), then the drain again (epoch 3): node-b holds nothing.
        assert job.assignment.epoch == 3
        assert "node-b" not in job.assignment.ranks
        assert_bitwise_equal(reference, out, world=4)


def test_a_sandbox_warmed_standby_is_promoted_with_its_model_built(
        etcd: EmbeddedEtcd, reference: Path, tmp_path: Path) -> None:
    # With a recording directory, ranks 0 and 1 (one per role type) record their first two
    # iterations; each standby builds the job as one role type's rank on replay groups and
    # runs shadow iterations before anything fails. node-s1 warms as rank 0.
    c = start(etcd, tmp_path / "cluster", {"node-a": 2, "node-b": 2}, ("node-s1", "node-s2"))
    try:
        out = tmp_path / "out"
        _run_job(c, out, env={"UNDERSTUDY_RECORDINGS": str(tmp_path / "recordings")})
        s1 = c.daemons["node-s1"]
        wait_log(s1, "Standby is warm (replay) as rank 0", timeout=120)
        wait_log(c.daemons["node-s2"], "Standby is warm (replay) as rank 1", timeout=120)
        status = c.cli("status").stdout
        assert "warm: mig: replay" in status, status
        warmth = json.loads(c.cli("status", "--json").stdout)["nodes"]
        s1_warmth = next(n for n in warmth if n["name"] == "node-s1")["warmth"]["mig"]
        assert s1_warmth["mode"] == "replay" and s1_warmth["roles"] == ["stage-only.tp-0-of-2"]
        _wait_steps(c.daemons["node-a"], 0, 50)
        # Each worker holds one of its node's slots (GPUs), as torchrun's LOCAL_RANK.
        a_local = {local(worker_pid(c.daemons["node-a"], f"mig.r{r}")) for r in (0, 1)}
        assert a_local == {("0", "2"), ("1", "2")}
        standby = worker_pid(s1, "mig.standby")
        assert local(standby) == ("0", "1")
        os.kill(worker_pid(c.daemons["node-a"], "mig.r0"), signal.SIGKILL)
        _recovery_done(c)
        assert "Promoting the standby warmed as rank 0: its model is built." in s1.log_text()
        assert local(standby) == ("0", "1")  # the promoted process, in its slot
        job = _finish(c)
        assert job.assignment.ranks == ("node-s1", "node-a", "node-b", "node-b")
        assert_bitwise_equal(reference, out, world=4)
    finally:
        c.stop_all(timeout=5, drain=False)


def _holder(s: ClusterStatus, node: str) -> str | None:
    """The id of the snapshot holder that ``node``'s live record says runs there."""
    n = s.node(node)
    w = n.warmth.get("mig") if n is not None and n.online else None
    return w.get("holder") if isinstance(w, dict) else None


def _rollback_step(c: LocalCluster) -> tuple[int, str]:
    planned = next(e for e in events(c) if e["kind"] == "migration-planned")
    return int(planned["message"].split("snapshot of step ")[1].split(":")[0]), \
        planned["message"]


def test_without_a_replica_every_rank_rolls_back_from_the_standbys_memory(
        etcd: EmbeddedEtcd, reference_dp1: Path, tmp_path: Path) -> None:
    # TP=2 x DP=1: nobody else holds rank 1's shards. No snapshot directory at all: every 20
    # steps each rank pushes its state (serialized in the background) to the holder in the
    # standby worker's memory on node-s1. When rank 1 dies every rank goes back to the newest
    # step both hold there: rank 0 fetches its copy over TCP, the standby promoted to rank 1
    # takes its own from its own memory, and the job redoes the steps since. Data and dropout
    # follow the step, so the run ends bit for bit where an uninterrupted one does. The standby
    # is sandbox-warmed as well (as rank 0), as in production: its later warmth report must
    # not make the daemon forget the holder it runs.
    expected = reference_dp1
    env = {"UNDERSTUDY_SNAPSHOT_EVERY": "20", "UNDERSTUDY_RECORDINGS": str(tmp_path / "rec")}
    with training(etcd, tmp_path, {"node-a": 1, "node-b": 1}, ("node-s1",), dp=1, standby=1,
                  env=env) as (c, out):
        a, b, s1 = c.daemons["node-a"], c.daemons["node-b"], c.daemons["node-s1"]
        wait_log(s1, "Standby is warm (replay) as rank 0", timeout=120)
        _wait_steps(b, 1, 50)
        wait_log(b, "Snapshots are kept in memory on node-s1")
        holder = _holder(c.status(), "node-s1")
        assert holder is not None
        os.kill(worker_pid(b, "mig.r1"), signal.SIGKILL)
        _recovery_done(c)
        step, planned = _rollback_step(c)
        assert step >= 40 and step % 20 == 0, planned
        assert "rank 1 -> node-s1; copies from memory on node-s1 (ranks 0, 1)." in planned
        assert f"Rolled back to the snapshot of step {step} (from memory on node-s1)." \
            in a.log_text()
        assert f"Took over rank 1 from its snapshot of step {step} (from this standby's own " \
               "memory)." in s1.log_text()
        # The holder closes after the switch report that let the recovery commit: wait for it.
        wait_log(s1, f"Snapshot holder {holder} closed: this standby holds rank 1 now.",
                 timeout=30)
        job = _finish(c)
        assert job.assignment.ranks == ("node-a", "node-s1")
        assert_bitwise_equal(expected, out, world=2)


def test_with_the_holder_gone_every_rank_rolls_back_from_storage(
        etcd: EmbeddedEtcd, reference_dp1: Path, tmp_path: Path) -> None:
    # As above, with a snapshot directory too: both tiers are kept. The standby worker holding
    # the memory copies is killed; its copies die with it, the controller stops counting them
    # (its holder left the node record), and when rank 1 dies the job rolls back from the
    # storage checkpoint (torch.distributed.checkpoint) instead; the restarted standby takes
    # rank 1 from there.
    expected = reference_dp1
    snapshots = {"UNDERSTUDY_SNAPSHOTS": str(tmp_path / "snap"),
                 "UNDERSTUDY_SNAPSHOT_EVERY": "20"}
    with training(etcd, tmp_path, {"node-a": 1, "node-b": 1}, ("node-s1",), dp=1, standby=1,
                  env=snapshots) as (c, out):
        a, b, s1 = c.daemons["node-a"], c.daemons["node-b"], c.daemons["node-s1"]
        _wait_steps(b, 1, 50)
        wait_log(b, "Snapshots are kept in memory on node-s1")
        holder = _holder(c.status(), "node-s1")
        assert holder is not None
        os.kill(worker_pid(s1, "mig.standby"), signal.SIGKILL)
        c.wait_for("the dead holder to leave node-s1's record",
                   lambda s: _holder(s, "node-s1") != holder)
        os.kill(worker_pid(b, "mig.r1"), signal.SIGKILL)
        _recovery_done(c)
        step, planned = _rollback_step(c)
        assert step >= 40 and step % 20 == 0, planned
        assert "rank 1 -> node-s1; copies from storage (ranks 0, 1)." in planned
        assert f"Rolled back to the snapshot of step {step} (from storage)." in a.log_text()
        assert f"Took over rank 1 from its snapshot of step {step} (from storage)." \
            in s1.log_text()
        job = _finish(c)
        assert job.assignment.ranks == ("node-a", "node-s1")
        assert_bitwise_equal(expected, out, world=2)


def test_the_controller_dying_right_after_planning_a_recovery_leaves_it_to_the_next(
        etcd: EmbeddedEtcd, reference: Path, tmp_path: Path) -> None:
    # node-x (a spare standby, outside the job's pool) is the controller, armed to crash the
    # moment a plan is in etcd. The next controller, elected when its lease expires, carries
    # the recovery through from etcd.
    armed = {"node-x": {"UNDERSTUDY_FAILPOINTS": "controller.migration.planned=exit(3)"}}
    c = LocalCluster(etcd_endpoint=etcd.endpoint, base_dir=tmp_path / "cluster")
    try:
        c.add("node-x", "standby", env=armed["node-x"])
        c.wait_state("node-x", "standby")
        c.wait_for("node-x to be the controller", lambda s: s.controller == "node-x")
        for n in ("node-a", "node-b"):
            c.add(n, "active", extra=["--slots", "2"])
        for n in ("node-s1", "node-s2"):
            c.add(n, "standby")
        for n, st in (("node-a", "active"), ("node-b", "active"), ("node-s1", "standby"),
                      ("node-s2", "standby")):
            c.wait_state(n, st)
        out = tmp_path / "out"
        _run_job(c, out)
        wait_standbys(c, ("node-s1", "node-s2"))
        a = c.daemons["node-a"]
        _wait_steps(a, 1, 50)
        os.kill(worker_pid(a, "mig.r1"), signal.SIGKILL)
        assert c.daemons["node-x"].wait(60) == 3  # it died right after writing the plan
        assert "failpoint controller.migration.planned fired" in c.daemons["node-x"].log_text()
        _recovery_done(c)
        kinds = [e["kind"] for e in events(c)]
        assert kinds.count("migration-planned") == 1, kinds  # the plan was carried, not redone
        assert kinds.count("controller-elected") >= 2, kinds
        job = _finish(c)
        assert job.assignment.epoch == 2
        assert_bitwise_equal(reference, out, world=4)
    finally:
        c.stop_all(timeout=5, drain=False)


def test_leavers_dying_in_phase_2_abort_the_drain_and_their_ranks_are_recovered(
        etcd: EmbeddedEtcd, reference: Path, tmp_path: Path) -> None:
    # node-b's ranks crash the moment they start streaming their state to the joiners (a
    # failpoint in the leaver's send): phase 2 of the drain is under way, the switch step is
    # agreed, nothing has moved. The drain is called off and both ranks are recovered from
    # their replicas on node-a.
    armed = {"node-b": {"UNDERSTUDY_FAILPOINTS": "leaver.send=exit(9)"}}
    with training(etcd, tmp_path, {"node-a": 2, "node-b": 2}, STANDBYS,
                  armed=armed) as (c, out):
        b = c.daemons["node-b"]
        _wait_steps(b, 2, 50)
        assert c.cli("drain", "node-b", "--deadline", "240").returncode == 0
        wait_log(b, "failpoint leaver.send fired", timeout=120)
        job = _finish(c)
        evs = events(c)
        aborted = next(e for e in evs if e["kind"] == "migration-aborted")
        # The cause, as it first reached the controller: the leaver's death, or its joiner
        # giving up when the stream from the dead leaver broke (their reports race to etcd).
        why = aborted["message"]
        assert "in phase 2, before its state reached the joiner" in why or re.search(
            r"gave up before it held the state: ([\w.]+\.)?TransferError:", why), aborted
        planned = [e["message"] for e in evs if e["kind"] == "migration-planned"]
        assert any("recovery: rank 2 -> " in m and "(state from rank 0)" in m for m in planned)
        assert job.assignment.epoch == 2
        assert job.assignment.ranks[:2] == ("node-a", "node-a")
        assert "node-b" not in job.assignment.ranks
        assert_bitwise_equal(reference, out, world=4)


@pytest.mark.parametrize("hand_off", ["whole", "ahead"])
def test_a_joiner_dying_after_its_state_arrived_is_recovered_after_the_drain_commits(
        etcd: EmbeddedEtcd, reference: Path, tmp_path: Path, hand_off: str) -> None:
    # node-s2's joiner (rank 3) exits holding the leaver's state, before it says it switched:
    # the leaver has handed off, so the drain is committed (epoch 2) and rank 3, lost under the
    # new epoch, is recovered onto node-s3 from its replica, rank 1 (epoch 3). The leaver says
    # it handed off 3 s late, so the joiner's death is always known first: its daemon must wait
    # for the leaver's word, not take its absence for a failed transfer.
    # "ahead": the state was sent ahead, and rank 0 says the switch was agreed 3 s late, so
    # the joiner dies before its daemon knows of the switch, as a standby not yet promoted (a
    # fresh standby its daemon starts must not be promoted in its place: seen once).
    armed = {"node-s2": {"UNDERSTUDY_FAILPOINTS": "joiner.switch=exit(3)"},
             "node-b": {"UNDERSTUDY_FAILPOINTS": "leaver.handed_off=sleep(3)"}}
    if hand_off == "ahead":
        armed["node-a"] = {"UNDERSTUDY_FAILPOINTS": "stayer.report_switching=sleep(3)"}
    with training(etcd, tmp_path, {"node-a": 2, "node-b": 2}, (*STANDBYS, "node-s3"),
                  armed=armed, standby=3, hand_off=hand_off) as (c, out):
        _wait_steps(c.daemons["node-b"], 3, 50)
        drain = c.cli("drain", "node-b", "--deadline", "120", "--wait", timeout=180)
        assert drain.returncode == 0, drain.stdout + drain.stderr
        job = _finish(c)
        evs = events(c)
        planned = [e for e in evs if e["kind"] == "migration-planned"]
        assert len(planned) == 2 and "recovery: rank 3 -> node-s3 (state from rank 1)" in \
            planned[1]["message"], [e["message"] for e in planned]
        assert [e["kind"] for e in evs].count("migration-done") == 2
        assert job.assignment.epoch == 3
        assert job.assignment.ranks == ("node-a", "node-a", "node-s1", "node-s3")
        assert_bitwise_equal(reference, out, world=4)


def test_a_joiner_hung_at_the_switch_is_stopped_and_its_rank_recovered(
        etcd: EmbeddedEtcd, reference: Path, tmp_path: Path) -> None:
    # node-s2's joiner (rank 3) holds the leaver's state and hangs before it switches (review
    # M5): the stayers wait on it in their first collective of the new epoch, and while the
    # switch stands no recovery is planned. Before, the job stood still until their collective
    # timeout failed them, and the migration stayed in its switch for good. Its daemon now
    # stops it after JOINER_SWITCH_S; the drain commits and rank 3 is recovered from rank 1.
    armed = {"node-s2": {"UNDERSTUDY_FAILPOINTS": "joiner.switch=sleep(600)"}}
    with training(etcd, tmp_path, {"node-a": 2, "node-b": 2}, (*STANDBYS, "node-s3"),
                  armed=armed, standby=3) as (c, out):
        _wait_steps(c.daemons["node-b"], 3, 50)
        drain = c.cli("drain", "node-b", "--deadline", "120", "--wait", timeout=180)
        assert drain.returncode == 0, drain.stdout + drain.stderr
        job = _finish(c)
        assert "holds the rank's state but has not switched" in \
            c.daemons["node-s2"].log_text()
        planned = [e["message"] for e in events(c) if e["kind"] == "migration-planned"]
        assert len(planned) == 2 and "recovery: rank 3 -> node-s3 (state from rank 1)" in \
            planned[1], planned
        assert job.assignment.epoch == 3
        assert job.assignment.ranks == ("node-a", "node-a", "node-s1", "node-s3")
        assert_bitwise_equal(reference, out, world=4)


def test_a_rank_that_hangs_is_found_by_its_waiting_peers_and_replaced(
        etcd: EmbeddedEtcd, reference: Path, tmp_path: Path) -> None:
    # One rank per node. Rank 2 (node-c) hangs at step 40: alive, silent, no reset. Its peers
    # wait on it in their collectives; before, their collective timeout failed *them* one by
    # one, and the job paused with the hung one holding its place. Now
    # each says it waits past half its timeout (10 s here); the controller takes the one rank
    # that does not wait for hung and recovers it from its replica (rank 0) while the others
    # are still there, and its daemon stops it.
    armed = {"node-c": {"UNDERSTUDY_FAILPOINTS": "rank.step.40=sleep(600)"}}
    with training(etcd, tmp_path, {"node-a": 1, "node-b": 1, "node-c": 1, "node-d": 1},
                  STANDBYS, armed=armed, extra=("--collective-timeout", "20")) as (c, out):
        wait_log(c.daemons["node-c"], "failpoint rank.step.40 fired", timeout=120)
        done = _recovery_done(c)
        planned = next(e for e in events(c) if e["kind"] == "migration-planned")
        assert "rank 2 on node-c hangs: rank(s) 0, 1, 3 have waited on it for" in \
            planned["message"], planned["message"]
        assert "recovery: rank 2 -> " in planned["message"]
        assert done["details"]["id"] == planned["details"]["id"]
        job = _finish(c)
        assert job.assignment.epoch == 2
        assert "node-c" not in job.assignment.ranks
        for n, r in (("node-a", 0), ("node-b", 1), ("node-d", 3)):
            assert c.daemons[n].log_text().count(f"Started rank {r} of job mig") == 1
        assert_bitwise_equal(reference, out, world=4)


def test_a_stayer_dying_at_the_switch_is_recovered_after_the_drain_commits(
        etcd: EmbeddedEtcd, reference: Path, tmp_path: Path) -> None:
    # One rank per node. node-b (rank 1) is drained; rank 2 on node-c crashes in phase 2, at
    # the agreed switch step, while the leaver streams its state: the drain still commits (its
    # joiner holds rank 1), and rank 2 is recovered from rank 0 under the new epoch.
    armed = {"node-c": {"UNDERSTUDY_FAILPOINTS": "stayer.switch=exit(9)"}}
    with training(etcd, tmp_path, {"node-a": 1, "node-b": 1, "node-c": 1, "node-d": 1},
                  STANDBYS, armed=armed) as (c, out):
        _wait_steps(c.daemons["node-c"], 2, 50)
        assert c.cli("drain", "node-b", "--deadline", "240").returncode == 0
        wait_log(c.daemons["node-c"], "failpoint stayer.switch fired", timeout=120)
        job = _finish(c)
        # Its exit lands under epoch 1 (then, once epoch 2 is committed, the daemon finds no
        # process for rank 2 and says so) or, if the daemon saw epoch 2 first, under epoch 2;
        # either way the failure is recovered at epoch 2 -> 3, never restarted from nothing.
        assert c.daemons["node-c"].log_text().count("Started rank 2 of job mig") == 1
        planned = [e["message"] for e in events(c) if e["kind"] == "migration-planned"]
        assert any("recovery: rank 2 -> node-s2 (state from rank 0)" in m for m in planned), \
            planned
        assert job.assignment.epoch == 3
        assert job.assignment.ranks == ("node-a", "node-s1", "node-s2", "node-d")
        assert_bitwise_equal(reference, out, world=4)


# -- a sharded optimizer: a lost shard is rebuilt from its copy on the next DP rank -----------


SHARDED = ("--shard-optimizer",)


@pytest.mark.parametrize("dp", [3, 2])
def test_a_sharded_optimizer_loses_no_step_to_a_crash_and_moves_whole_in_a_drain(
        etcd: EmbeddedEtcd, tmp_path: Path, dp: int) -> None:
    """TP 1 x DP 3, the Adam state sharded over DP (ZeRO-1, ``ShardedJob``): rank 1's shard
    exists on rank 1 and, as a copy kept current at every commit, on rank 2. Rank 1 is killed:
    the controller takes its state from rank 2 (not rank 0, whose own shard is another), the
    replacement gets its own copy of rank 0's shard at its first step. Then rank 2's node is
    drained (its state and buddy copy sent ahead, then each step's two shard gradients). The
    run ends bitwise equal to an uninterrupted one, with no committed step lost. The standbys
    warm in the sandbox: rank 0 records its first iterations (the shard's reduce-scatter, the
    buddy copy's send and receive, the all-gather), and each standby replays them as rank 0,
    the one role of a TP 1 x PP 1 job; the standby chosen for rank 1 is promoted with the job it
    warmed, retargeted to rank 1.

    At DP 2 (one rank a node) the ranks build their parameters from their shard and their copy,
    without the all-gather, at every step but the replacement's first (it has no copy yet, and
    both ranks all-gather then); rank 1's state comes from rank 0, and rank 0's node is the one
    drained."""
    expected = standalone_run(tmp_path / "reference", world=dp, tp=1, extra=SHARDED)
    donor, drained = (2, "node-b") if dp == 3 else (0, "node-a")
    with training(etcd, tmp_path, {"node-a": 2, "node-b": 1} if dp == 3 else
                  {"node-a": 1, "node-b": 1}, STANDBYS, dp=dp, tp=1,
                  extra=SHARDED,
                  env={"UNDERSTUDY_RECORDINGS": str(tmp_path / "recordings")}) as (c, out):
        for standby in STANDBYS:
            wait_log(c.daemons[standby], "Standby is warm (replay) as rank 0", timeout=120)
        holder = c.daemons["node-a" if dp == 3 else "node-b"]
        _wait_steps(holder, 1, 50)
        os.kill(worker_pid(holder, "mig.r1"), signal.SIGKILL)
        _recovery_done(c)
        planned = next(e for e in events(c) if e["kind"] == "migration-planned")
        assert re.search(rf"recovery: rank 1 -> node-s\d \(state from rank {donor}\)",
                         planned["message"]), planned["message"]
        # The job warmed as rank 0 serves as rank 1: its shard is another, loaded with the state.
        # Every shard is the same size: its buffers and shards are kept, not re-made.
        assert any(re.search(r"Promoting the standby warmed as rank 0 \(only stage\) to rank 1 "
                             r".*kept its model, buffers and shards \(DP rank 0 -> 1\)",
                             c.daemons[n].log_text()) for n in STANDBYS)
        drain = c.cli("drain", drained, "--deadline", "120", "--wait", timeout=180)
        assert drain.returncode == 0, drain.stdout + drain.stderr
        job = _finish(c)
        if dp == 3:
            assert job.assignment.ranks[0] == "node-a"
            assert set(job.assignment.ranks[1:]) == set(STANDBYS)
        else:
            assert set(job.assignment.ranks) == set(STANDBYS)
        moved = 2 if dp == 3 else 0
        assert f"Sending the state of rank {moved} ahead" in c.daemons[drained].log_text()
        summary = json.loads((out / "rank1.json").read_text())
        assert summary["step"] == STEPS
        assert_bitwise_equal(expected, out, world=dp)
