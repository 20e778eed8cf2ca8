"""A job that trains on the GPU under real daemons (``TrainingJob.gpu``): a data-parallel pair
on two nodes and a standby, its gradients all-reduced over NCCL, drained and crashed, each run
ending bit for bit equal to an uninterrupted run of the same job on the same cluster shape.

Needs CUDA: skipped here and in CI, with the reason. Each node of the local cluster gets its own
``NCCL_HOSTID``, so that NCCL treats the node's workers as another host's even where every node
is the same one-GPU machine (it refuses two ranks of a communicator on one device otherwise):
its socket transport on loopback, the code paths of a multi-node cluster."""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.integration.bitwise import assert_bitwise_equal
from tests.integration.scenarios import events, start, wait_log, worker_pid
from understudy.testing.embedded_etcd import EmbeddedEtcd
from understudy.testing.localcluster import LocalCluster

pytestmark = [
    pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU and NCCL: the job trains on the GPU"),
]

JOB = str(Path(__file__).parents[1] / "workers" / "gpu_dp.py")
STEPS = 150
NODES = {"node-a": 1, "node-b": 1}
STANDBY = ("node-s1",)


def _node_env(node: str) -> dict[str, str]:
    return {"NCCL_HOSTID": f"understudy-test-{node}", "NCCL_SOCKET_IFNAME": "lo",
            "NCCL_IB_DISABLE": "1", "OMP_NUM_THREADS": "1"}


@pytest.fixture
def cluster(etcd: EmbeddedEtcd, tmp_path: Path) -> Iterator[LocalCluster]:
    c = start(etcd, tmp_path / "cluster", NODES, STANDBY,
              env={n: _node_env(n) for n in (*NODES, *STANDBY)})
    try:
        yield c
    finally:
        c.stop_all(timeout=5, drain=False)


def _run(c: LocalCluster, name: str, out: Path, step_sleep: float) -> None:
    run = c.cli("run", "--job", name, "--tp", "1", "--dp", "2", "--standby", "1", "--",
                sys.executable, JOB, "--steps", str(STEPS), "--step-sleep", str(step_sleep),
                "--save", str(out))
    assert run.returncode == 0, run.stderr


def _finish(c: LocalCluster, name: str, out: Path) -> None:
    c.wait_for(f"job {name} to end", lambda s: s.job(name) is not None and
               s.job(name).state in ("done", "failed"), timeout=240)  # type: ignore[union-attr]
    job = c.status().job(name)
    if job is None or job.state != "done":
        logs = "".join(f"\n== {f}\n{f.read_text()[-3000:]}"
                       for f in sorted(c.base_dir.glob(f"*/logs/{name}/*.log")))
        raise AssertionError(f"{job.status if job else None}{logs}")
    for rank in (0, 1):
        summary = json.loads((out / f"rank{rank}.json").read_text())
        assert summary["step"] == STEPS and summary["devices"] == ["cuda:0"], summary


def _wait_trained(c: LocalCluster) -> None:
    """Until job gpu's standby is warm and its rank 1 committed 50 steps (the reference run,
    on the same daemons, logged the same lines first)."""
    wait_log(c.daemons["node-s1"], "Standby worker of job gpu is warm", timeout=120)
    wait_log(c.daemons["node-b"], "50 steps committed on rank 1", timeout=120, times=2)


@pytest.fixture
def reference(cluster: LocalCluster, tmp_path: Path) -> Path:
    """The uninterrupted run, on this test's cluster before its scenario."""
    out = tmp_path / "reference"
    _run(cluster, "ref", out, step_sleep=0)
    _finish(cluster, "ref", out)
    return out


def test_a_gpu_job_drained_to_a_standby_ends_bitwise_equal(cluster: LocalCluster,
                                                          reference: Path,
                                                          tmp_path: Path) -> None:
    out = tmp_path / "out"
    _run(cluster, "gpu", out, step_sleep=0.05)
    _wait_trained(cluster)
    drain = cluster.cli("drain", "node-b", "--deadline", "120", "--wait", timeout=180)
    assert drain.returncode == 0, drain.stdout + drain.stderr
    _finish(cluster, "gpu", out)
    job = cluster.status().job("gpu")
    assert job is not None and job.assignment is not None
    assert job.assignment.ranks == ("node-a", "node-s1")
    assert cluster.daemons["node-a"].log_text().count("Started rank 0 of job gpu") == 1
    assert_bitwise_equal(reference, out, world=2)


def test_a_gpu_jobs_killed_rank_is_replaced_from_its_replica_bitwise(cluster: LocalCluster,
                                                                     reference: Path,
                                                                     tmp_path: Path) -> None:
    out = tmp_path / "out"
    _run(cluster, "gpu", out, step_sleep=0.05)
    _wait_trained(cluster)
    b = cluster.daemons["node-b"]
    os.kill(worker_pid(b, "gpu.r1"), signal.SIGKILL)
    cluster.wait_for("the recovery to finish", lambda s: any(
        e["kind"] == "migration-done" for e in events(cluster)), timeout=120)
    _finish(cluster, "gpu", out)
    job = cluster.status().job("gpu")
    assert job is not None and job.assignment is not None
    assert job.assignment.ranks == ("node-a", "node-s1")
    assert cluster.daemons["node-a"].log_text().count("Started rank 0 of job gpu") == 1
    assert_bitwise_equal(reference, out, world=2)
