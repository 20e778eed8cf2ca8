"""Pipeline-parallel ranks move and recover like any other: a TP=1 x DP=2 x PP=2 plain job (the
runtime's own micro-batch schedule over gloo) under real daemons, ranks 0 and 1 the first stage
on node-a, ranks 2 and 3 the last on node-b; the final state is compared bit for bit with an
uninterrupted run of the same seed and layout."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest

from tests.integration.bitwise import assert_bitwise_equal
from tests.integration.scenarios import events, wait_log, worker_pid
from tests.integration.test_migration import STEPS, _finish, standalone_run
from tests.integration.test_recovery import STANDBYS, _recovery_done, _wait_steps, training
from tests.once import build_once
from understudy.testing.embedded_etcd import EmbeddedEtcd

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

LAYOUT = {"tp": 1, "dp": 2, "pp": 2}
NODES = {"node-a": 2, "node-b": 2}


@pytest.fixture(scope="module")
def pipeline_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted PP=2 run (one per test run, shared by every xdist worker)."""
    return build_once(tmp_path_factory, "pp-reference",
                      lambda base: standalone_run(base, world=4, tp=1, pp=2))


def _rebuilt(log: str, rank: int) -> list[str]:
    """The groups ``rank`` rebuilt in its last phase 1, from its log."""
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    found = [ln for ln in lines if ln.get("rank") == rank
             and str(ln.get("event", "")).startswith("Phase 1 of migration")]
    assert found, f"rank {rank} logged no phase 1"
    match = re.search(r"rebuilding (\[.*\])", found[-1]["event"])
    assert match is not None
    return sorted(json.loads(match.group(1).replace("'", '"')))


def test_a_drained_first_stage_moves_to_standbys_warmed_per_stage_type(
        etcd: EmbeddedEtcd, pipeline_reference: Path, tmp_path: Path) -> None:
    # With a recording directory, rank 0 records the first stage's iterations and rank 2 the
    # last's; node-s1 warms as rank 0 (first stage), node-s2 as rank 2 (last stage). Draining
    # node-a moves ranks 0 and 1, both of the first stage: node-s1 takes rank 0 as warmed, and
    # node-s2, warm as a last stage, is retargeted: it keeps its block and allocates only the
    # embedding (dropping the head).
    recordings = {"UNDERSTUDY_RECORDINGS": str(tmp_path / "recordings")}
    with training(etcd, tmp_path, NODES, STANDBYS, env=recordings, **LAYOUT) as (c, out):
        s1, s2 = c.daemons["node-s1"], c.daemons["node-s2"]
        wait_log(s1, "Standby is warm (replay) as rank 0", timeout=120)
        wait_log(s2, "Standby is warm (replay) as rank 2", timeout=120)
        warmth = json.loads(c.cli("status", "--json").stdout)["nodes"]
        roles = {n["name"]: n["warmth"]["mig"]["roles"] for n in warmth if n["warmth"]}
        assert roles == {"node-s1": ["stage-first.tp-0-of-1"],
                         "node-s2": ["stage-last.tp-0-of-1"]}, roles
        drain = c.cli("drain", "node-a", "--deadline", "120", "--wait", timeout=180)
        assert drain.returncode == 0, drain.stdout + drain.stderr
        job = _finish(c)
        assert job.assignment is not None and job.assignment.epoch == 2
        assert job.assignment.ranks == ("node-s1", "node-s2", "node-b", "node-b")
        assert "Promoting the standby warmed as rank 0: its model is built." in s1.log_text()
        assert ("Promoting the standby warmed as rank 2 (last stage) to rank 1 (first stage): "
                "kept 1 blocks, allocated embed_w, embed_b, dropped head_w, head_b."
                in s2.log_text()), s2.log_text()[-3000:]
        # Only the groups that held a leaver were rebuilt: rank 2's pipeline (pp-0, with rank
        # 0) and the world; its data-parallel group (ranks 2, 3) and its own TP group stayed.
        b_log = c.daemons["node-b"].log_text()
        assert _rebuilt(b_log, 2) == ["pp-0", "world"]
        assert _rebuilt(b_log, 3) == ["pp-1", "world"]
        assert b_log.count("Started rank 2 of job mig") == 1
        assert_bitwise_equal(pipeline_reference, out, world=4)


def test_a_killed_pipeline_rank_is_recovered_from_its_stage_replica(
        etcd: EmbeddedEtcd, pipeline_reference: Path, tmp_path: Path) -> None:
    # Rank 3 (last stage, second replica) is killed mid-step: rank 1 waits in the pipeline's
    # send/recv, rank 2 in the data-parallel all-reduce of the last stage. The donor is rank
    # 2, the replica in the same stage; the joiner gets the last stage's layers, not the first.
    with training(etcd, tmp_path, NODES, STANDBYS, **LAYOUT) as (c, out):
        b = c.daemons["node-b"]
        _wait_steps(b, 3, 50)
        os.kill(worker_pid(b, "mig.r3"), signal.SIGKILL)
        _recovery_done(c)
        planned = next(e for e in events(c) if e["kind"] == "migration-planned")
        assert "recovery: rank 3 -> node-s1 (state from rank 2)" in planned["message"]
        job = _finish(c)
        assert job.assignment.ranks == ("node-a", "node-a", "node-b", "node-s1")
        assert c.daemons["node-a"].log_text().count("Started rank 1 of job mig") == 1
        summary = json.loads((out / "rank3.json").read_text())
        assert summary["step"] == STEPS
        assert_bitwise_equal(pipeline_reference, out, world=4)

