"""Live migration end to end: a TP=2 x DP=2 job under real daemons, a node drained mid-run, its
ranks moved to standbys while the others keep training, and the final state compared bit for
bit with an uninterrupted run of the same seed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from understudy.daemon.embedded_etcd import EmbeddedEtcd
from understudy.daemon.localcluster import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

TRAIN = str(Path(__file__).parents[2] / "examples" / "plain_torch" / "train.py")
STEPS = 150
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _job_args(out: Path) -> list[str]:
    return [TRAIN, "--steps", str(STEPS), "--step-sleep", "0.04", "--save", str(out)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run: the same job on four plain processes, no daemons."""
    base = tmp_path_factory.mktemp("reference")
    procs = []
    for r in range(4):
        with open(base / f"r{r}.log", "wb") as log:
            procs.append(subprocess.Popen(
                [sys.executable, *_job_args(base / "out"), "--rank", str(r), "--world-size",
                 "4", "--tp", "2", "--store", str(base / "store")],
                env={**os.environ, **ONE_THREAD}, stdout=subprocess.DEVNULL, stderr=log))
    for p in procs:
        assert p.wait(timeout=300) == 0, (base / "r0.log").read_text()[-2000:]
    return base / "out"


@pytest.fixture
def cluster(etcd: EmbeddedEtcd, tmp_path: Path) -> Iterator[LocalCluster]:
    c = LocalCluster(etcd_endpoint=etcd.endpoint, base_dir=tmp_path / "cluster")
    try:
        for n in ("node-a", "node-b"):
            c.add(n, "active", extra=["--slots", "2"])
        for n in ("node-s1", "node-s2"):
            c.add(n, "standby")
        for n, s in (("node-a", "active"), ("node-b", "active"), ("node-s1", "standby"),
                     ("node-s2", "standby")):
            c.wait_state(n, s)
        c.wait_for("a controller", lambda s: s.controller is not None)
        yield c
    finally:
        c.stop_all(timeout=5)


def _leaves(tree: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{path}/{k}")
    elif isinstance(tree, list | tuple):
        for i, v in enumerate(tree):
            yield from _leaves(v, f"{path}[{i}]")
    else:
        yield path, tree


def assert_bitwise_equal(expected_dir: Path, actual_dir: Path, world: int) -> None:
    for rank in range(world):
        a = dict(_leaves(torch.load(expected_dir / f"rank{rank}.pt", weights_only=False)))
        b = dict(_leaves(torch.load(actual_dir / f"rank{rank}.pt", weights_only=False)))
        assert a.keys() == b.keys(), f"rank {rank}: {sorted(a.keys() ^ b.keys())}"
        for key, va in a.items():
            vb = b[key]
            if torch.is_tensor(va):
                assert va.dtype == vb.dtype and torch.equal(va, vb), f"rank {rank} {key} differs"
            elif key.endswith("redone"):
                continue  # a count of redone attempts is not training state
            else:
                assert va == vb, f"rank {rank} {key}: {va!r} != {vb!r}"


def test_drain_moves_a_tp_pair_live_and_the_result_is_bitwise_identical(
        cluster: LocalCluster, reference: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = [f"--env={k}={v}" for k, v in ONE_THREAD.items()]
    run = cluster.cli("run", "--job", "mig", "--tp", "2", "--dp", "2", "--standby", "2", *env,
                      "--", sys.executable, *_job_args(out))
    assert run.returncode == 0, run.stderr
    assert "rank 2 on node-b" in run.stdout and "rank 3 on node-b" in run.stdout
    # Drain while the job trains: let every rank get going first.
    cluster.wait_for("ranks running", lambda s: all(
        n.workers >= 1 for n in s.nodes), timeout=60)
    time.sleep(3)
    drain = cluster.cli("drain", "node-b", "--deadline", "120", "--wait", timeout=180)
    assert drain.returncode == 0, drain.stdout + drain.stderr
    cluster.wait_for("the job to finish", lambda s: s.job("mig") is not None and
                     s.job("mig").state in ("done", "failed"), timeout=240)  # type: ignore
    job = cluster.status().job("mig")
    assert job is not None and job.state == "done", job.status
    assert job.assignment is not None and job.assignment.epoch == 2
    assert job.assignment.ranks == ("node-a", "node-a", "node-s1", "node-s2")
    events = [json.loads(line) for line in cluster.cli("events", "--json").stdout.splitlines()]
    kinds = [e["kind"] for e in events]
    for phase in ("planned", "preparing", "ready", "done"):
        assert f"migration-{phase}" in kinds, kinds
    done = next(e for e in events if e["kind"] == "migration-done")
    assert {"planned", "ready", "done"} <= done["details"]["timings"].keys()
    # The ranks that stayed never restarted: one process each for the whole run.
    a_log = cluster.daemons["node-a"].log_text()
    assert a_log.count("Started rank 0 of job mig") == 1
    assert a_log.count("Started rank 1 of job mig") == 1
    # The joiners reached the last step from the leavers' state.
    for rank in (2, 3):
        summary = json.loads((out / f"rank{rank}.json").read_text())
        assert summary["step"] == STEPS
    assert_bitwise_equal(reference, out, world=4)
