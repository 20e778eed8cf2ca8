"""Data-parallel slots end to end (issue 16, items 1 and 2): the plain example with
``--slots 2`` trains the same bits on two TP=2 replicas as on one under real daemons, through a
live drain to standbys warmed in the sandbox (whose shadow iterations replay the slots'
point-to-point sums), and through a live shrink to one replica when a rank is lost and no
standby is free. That any replica count trains the same bits as plain processes is
test_reshape.py's (DP 4, 2 and 3 in one run, against an uninterrupted DP 4 run)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.integration.bitwise import assert_rank_equal
from tests.integration.scenarios import events, start, wait_log, worker_pid
from tests.integration.test_migration import _finish, _run_job, standalone_run
from tests.once import build_once
from understudy.testing.embedded_etcd import EmbeddedEtcd

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SLOTS = ("--slots", "2")


@pytest.fixture(scope="session")
def one_replica(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The slotted job on one TP=2 replica holding both slots (plain processes, no daemons)."""
    return build_once(tmp_path_factory, "slotted-dp1",
                      lambda base: standalone_run(base, world=2, tp=2, extra=SLOTS))


def _assert_same_as_one_replica(one: Path, out: Path) -> None:
    # Rank r of TP=2 x DP=2 holds what rank r % 2 holds on one replica: parameters, Adam's
    # state, schedule, data position and step, bit for bit.
    for rank in range(4):
        assert_rank_equal(one, rank % 2, out, rank, rng=False)


def test_a_slotted_job_drained_live_keeps_the_bits_of_one_replica(
        etcd: EmbeddedEtcd, one_replica: Path, tmp_path: Path) -> None:
    c = start(etcd, tmp_path / "cluster", {"node-a": 2, "node-b": 2}, ("node-s1", "node-s2"))
    try:
        out = tmp_path / "out"
        _run_job(c, out, env={"UNDERSTUDY_RECORDINGS": str(tmp_path / "recordings")},
                 extra=SLOTS)
        # The standbys ran shadow iterations of the slotted step on the recorded sums.
        wait_log(c.daemons["node-s1"], "Standby is warm (replay) as rank", timeout=120)
        wait_log(c.daemons["node-s2"], "Standby is warm (replay) as rank", timeout=120)
        drain = c.cli("drain", "node-b", "--deadline", "120", "--wait", timeout=180)
        assert drain.returncode == 0, drain.stdout + drain.stderr
        job = _finish(c)
        assert job.assignment is not None and job.assignment.epoch == 2
        assert "node-b" not in job.assignment.ranks
        _assert_same_as_one_replica(one_replica, out)
    finally:
        c.stop_all(timeout=5, drain=False)


@pytest.fixture(scope="session")
def one_sharded_replica(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The slotted job with its optimizer sharded by slot, on one TP=2 replica."""
    return build_once(tmp_path_factory, "slotted-sharded-dp1",
                      lambda base: standalone_run(base, world=2, tp=2,
                                                  extra=(*SLOTS, "--shard-optimizer")))


@pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "sharded-optimizer"])
def test_a_slotted_job_shrinks_live_with_no_standby_free_and_grows_back_bit_for_bit(
        etcd: EmbeddedEtcd, request: pytest.FixtureRequest, tmp_path: Path,
        sharded: bool) -> None:
    # Two standby nodes, cordoned: no standby is free. Rank 0's worker dies; its replica
    # (ranks 0 and 1, on node-a) is dropped, and node-b's replica, ranks 2 and 3, trains on as
    # ranks 0 and 1 holding both slots, in the same processes (without --reshape the job would
    # pause); with its optimizer sharded by slot, the dropped replica's slot state comes from
    # the copies node-b's ranks keep. node-a, alive and holding nothing now, stands by for the
    # job: one standby, half a replica. Then node-s1 is uncordoned: with node-a (both warmed in
    # the sandbox as ranks of the submitted shape) it is promoted to ranks 2 and 3, a new
    # replica, with the state of ranks 0 and 1, and the job ends on two replicas again.
    c = start(etcd, tmp_path / "cluster", {"node-a": 2, "node-b": 2}, ("node-s1", "node-s2"))
    try:
        for n in ("node-s1", "node-s2"):
            assert c.cli("cordon", n).returncode == 0
        out = tmp_path / "out"
        extra = (*SLOTS, "--shard-optimizer") if sharded else SLOTS
        one_replica = request.getfixturevalue("one_sharded_replica" if sharded else "one_replica")
        _run_job(c, out, step_sleep=0.1, standby=0, extra=extra, options=("--reshape",),
                 env={"UNDERSTUDY_RECORDINGS": str(tmp_path / "recordings")})
        a, b = c.daemons["node-a"], c.daemons["node-b"]
        stayers = {r: worker_pid(b, f"mig.r{r}") for r in (2, 3)}
        wait_log(b, "50 steps committed on rank 2", timeout=60)
        os.kill(worker_pid(a, "mig.r0"), 9)

        def epoch(n: int) -> Callable[[Any], bool]:
            return lambda s: s.job("mig") is not None and s.job("mig").assignment is not None \
                and s.job("mig").assignment.epoch == n

        c.wait_for("the shrink", epoch(2), timeout=60)
        job = c.status().job("mig")
        assert job is not None and job.assignment is not None
        assert job.assignment.ranks == ("node-b", "node-b")
        wait_log(b, "Rank 3 of job mig is rank 1 after reshape", timeout=30)
        for old, new in ((2, 0), (3, 1)):  # the same process under its new number
            renamed = [json.loads(line) for line in b.log_text().splitlines()
                       if f"Worker mig.r{old}-renumbering is now mig.r{new}." in line]
            assert [x["pid"] for x in renamed] == [stayers[old]], renamed
        wait_log(a, "was in a replica the reshape", timeout=30)  # rank 1 stopped, not failed
        assert job.assignment.standbys == ("node-a",)
        c.wait_for("node-a in the standby pool", lambda s: any(
            n.name == "node-a" and n.state == "standby" for n in s.nodes), timeout=30)
        wait_log(a, "Standby is warm", timeout=120)
        assert c.cli("uncordon", "node-s1").returncode == 0
        c.wait_for("the grow", epoch(3), timeout=120)
        job = _finish(c)
        assert job.assignment is not None and job.assignment.epoch == 3
        assert job.assignment.ranks[:2] == ("node-b", "node-b")
        assert sorted(job.assignment.ranks[2:]) == ["node-a", "node-s1"]
        planned = [e["message"] for e in events(c) if e["kind"] == "migration-planned"]
        assert "reshape for want of a standby: DP 2 -> 1" in planned[0], planned
        assert "reshape onto free standbys: DP 1 -> 2" in planned[1], planned
        assert [e["kind"] for e in events(c)].count("migration-done") == 2
        for n in ("node-a", "node-s1"):
            assert "Promoting the standby warmed as rank" in c.daemons[n].log_text()
        for rank in range(4):
            assert_rank_equal(one_replica, rank % 2, out, rank, rng=False)
    finally:
        c.stop_all(timeout=5, drain=False)
