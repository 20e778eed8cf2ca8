"""A three-member etcd cluster loses its leader under a training job: the members elect another
within about a second, the daemons move to a member that answers, and the job trains through it
without a fence, a restart or a new epoch; the final state is compared bit for bit with an
uninterrupted run."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.bitwise import assert_bitwise_equal
from tests.integration.etcd_members import EtcdMembers
from tests.integration.scenarios import (
    assert_no_tracebacks,
    events,
    start,
    wait_log,
    wait_standbys,
)
from tests.integration.test_migration import STEPS, _finish, _run_job
from understudy.testing.localcluster import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

RANKS = {"node-a": (0, 1), "node-b": (2, 3)}
STANDBYS = ("node-s1", "node-s2")


@pytest.fixture
def members(tmp_path: Path) -> Iterator[EtcdMembers]:
    with EtcdMembers(tmp_path / "etcd") as m:
        yield m


@pytest.fixture
def cluster(members: EtcdMembers, tmp_path: Path) -> Iterator[LocalCluster]:
    c = start(members.endpoints, tmp_path / "cluster", {"node-a": 2, "node-b": 2}, STANDBYS)
    try:
        yield c
    finally:
        c.stop_all(timeout=5, drain=False)
        assert_no_tracebacks(c)


def test_losing_the_etcd_leader_fences_nothing_and_the_result_is_bitwise_identical(
        members: EtcdMembers, cluster: LocalCluster, reference: Path, tmp_path: Path) -> None:
    # Every client dials the first endpoint first. Two losses in one run, the first member back
    # before the second goes. First the leader is that member ("dialled"): its loss is both a
    # lost connection for each daemon and an election among the other two. Then it is another
    # member ("not dialled"): the daemons' member survives and only forwards their keep-alives
    # to a leader that is gone until the others elect a new one. Steps of 0.15 s: the second
    # loss must come before the job's last 50 steps begin.
    out = tmp_path / "out"
    _run_job(cluster, out, step_sleep=0.15)
    wait_standbys(cluster, STANDBYS)
    a, b = cluster.daemons["node-a"], cluster.daemons["node-b"]
    wait_log(a, "50 steps committed on rank 0", timeout=120)
    watched = [(d, f"steps committed on rank {r}") for d, r in ((a, 0), (b, 2))]
    for victim in members.members[:2]:
        members.make_leader(victim)
        committed = [d.log_text().count(line) for d, line in watched]
        assert max(committed) * 50 < STEPS, f"the job is at its last 50 steps: {committed}"
        members.kill(victim)
        members.wait_leader(timeout=15, other_than=victim)
        # Both nodes train on while the member is down: each commits its next 50 steps.
        for (d, line), n in zip(watched, committed, strict=True):
            wait_log(d, line, timeout=120, times=n + 1)
        members.restart(victim)
    job = _finish(cluster)
    # No takeover happened: the job is at its first assignment, every rank ran in one process
    # from start to end, and no standby took a rank.
    assert job.assignment is not None and job.assignment.epoch == 1
    for name, d in cluster.daemons.items():
        log = d.log_text()
        # etcd keeps every lease through a change of leader: no daemon lost its lease.
        assert "lost its lease" not in log and "fenced itself" not in log, name
        assert log.count("Started rank") == len(RANKS.get(name, ())), name
        for r in RANKS.get(name, ()):
            assert log.count(f"Started rank {r} of job mig.") == 1, (name, r)
        # An outage a daemon noticed (a loaded machine can delay keep-alives past the point
        # where the lease is unproven) ended once etcd answered.
        assert log.count("etcd has acknowledged no keep-alive") == \
            log.count("etcd answers again after an outage"), name
        assert d.alive(), f"{name} exited with {d.proc and d.proc.returncode}"
    kinds = [e["kind"] for e in events(cluster)]
    assert "node-failed" not in kinds and "node-fenced" not in kinds, kinds
    assert_bitwise_equal(reference, out, world=4)
