"""Restart-only jobs (``understudy run --restart-only``, docs/restart.md): an unmodified
torch.distributed script under real daemons and a real etcd, restarted from its own checkpoint
after a rank is killed and when a node is drained, ending bit for bit where the uninterrupted
run of the same script ends."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.scenarios import worker_pid
from understudy.testing.embedded_etcd import EmbeddedEtcd
from understudy.testing.localcluster import LocalCluster

pytestmark = pytest.mark.slow
SCRIPT = str(Path(__file__).parents[1] / "workers" / "torchrun_script.py")
STEPS = 150


@pytest.fixture
def cluster(etcd: EmbeddedEtcd, tmp_path: Path) -> Iterator[LocalCluster]:
    """As the integration layer's, but a traceback is held against the daemons only when they
    logged it: the script's own (rank 0's gloo error when its peer is killed) reaches the same
    file through the ranks' stderr."""
    c = LocalCluster(etcd_endpoint=etcd.endpoint, base_dir=tmp_path / "cluster")
    try:
        yield c
    finally:
        c.stop_all(timeout=5, drain=False)
        for name, d in c.daemons.items():
            own = [line for line in d.log_text().splitlines()
                   if line.startswith("{") and "Traceback" in line]
            assert not own, f"{name} logged a traceback: {own[0][-2000:]}"


def _script_args(base: Path) -> list[str]:
    return [SCRIPT, "--ckpt", str(base / "ckpt"), "--events", str(base / "events"), "--out",
            str(base / "out.json"), "--steps", str(STEPS), "--save-every", "10"]


def _uninterrupted(base: Path) -> list[subprocess.Popen[bytes]]:
    """The same script as two plain processes with torchrun's core variables, no daemons."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [subprocess.Popen([sys.executable, *_script_args(base)],
                             env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2",
                                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                  "OMP_NUM_THREADS": "1"})
            for r in range(2)]


def _events(base: Path, rank: int) -> list[dict[str, Any]]:
    path = base / "events" / f"rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _saved(base: Path) -> int:
    latest = base / "ckpt" / "latest"
    return int(latest.read_text()) if latest.exists() else 0


def _until(what: str, check: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.05)


def test_an_unmodified_script_restarts_from_its_checkpoint_after_a_crash_and_a_drain(
        cluster: LocalCluster, tmp_path: Path) -> None:
    reference = _uninterrupted(tmp_path / "reference")
    for n in ("node-a", "node-b"):
        cluster.add(n, "active", extra=["--slots", "1"])
    cluster.add("node-s", "standby")
    for n, state in (("node-a", "active"), ("node-b", "active"), ("node-s", "standby")):
        cluster.wait_state(n, state)
    # Bad input: one sentence, nothing written.
    for args, says in ((("--reshape",), "cannot reshape"),
                       (("--max-restarts", "-1"), "max restarts (-1) must be 0 to 1000")):
        bad = cluster.cli("run", "--job", "bad", "--tp", "1", "--dp", "2", "--restart-only",
                          *args, "--", "true")
        assert bad.returncode == 1 and says in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1
    bad = cluster.cli("run", "--job", "bad", "--tp", "1", "--dp", "2", "--max-restarts", "2",
                      "--", "true")
    assert bad.returncode == 1 and "--max-restarts counts a --restart-only" in bad.stderr
    assert cluster.status().job("bad") is None

    base = tmp_path / "job"
    run = cluster.cli("run", "--job", "plain", "--tp", "1", "--dp", "2", "--standby", "1",
                      "--restart-only", "--", sys.executable, *_script_args(base),
                      "--step-sleep", "0.04")
    assert run.returncode == 0 and "restart-only (at most 3 restarts" in run.stdout, run.stderr
    assert "rank 0 on node-a, rank 1 on node-b" in run.stdout
    (row,) = json.loads(cluster.cli("jobs", "-o", "json").stdout)
    assert row["mode"] == "restart-only"

    # A rank killed: every rank restarts, from the last checkpoint, on the same nodes.
    _until("a checkpoint at step 20", lambda: _saved(base) >= 20, 60)
    os.kill(worker_pid(cluster.daemons["node-b"], "plain.r1"), signal.SIGKILL)
    _until("both ranks resumed", lambda: all(
        any(e["event"] == "resumed" for e in _events(base, r)) for r in range(2)), 60)
    (crash_resume,) = {e["step"] for r in range(2) for e in _events(base, r)
                       if e["event"] == "resumed"}
    assert crash_resume >= 20 and crash_resume % 10 == 0
    # A drain of node-b: SIGTERM to both ranks, which save where they are; the restart puts
    # rank 1 on the standby and resumes from that very step.
    _until("training to go on", lambda: _saved(base) >= crash_resume + 10, 60)
    drain = cluster.cli("drain", "node-b")
    assert drain.returncode == 0, drain.stderr
    cluster.wait_for("the job to be done", lambda s: (j := s.job("plain")) is not None
                     and j.state == "done", timeout=90)
    for p in reference:
        assert p.wait(timeout=60) == 0

    out = json.loads((base / "out.json").read_text())
    assert out == json.loads((tmp_path / "reference" / "out.json").read_text())
    assert out["step"] == STEPS
    job = cluster.status().job("plain")
    assert job is not None and job.assignment is not None
    assert job.assignment.epoch == 3 and job.assignment.ranks == ("node-a", "node-s")
    assert job.assignment.restarts == 1  # the crash counts, the drain does not
    cluster.wait_state("node-b", "drained", timeout=30)

    sigterm = {(e["rank"], e["step"]) for r in range(2) for e in _events(base, r)
               if e["event"] == "saved" and e["reason"] == "sigterm"}
    ((_, drain_step), _) = sorted(sigterm)
    assert sigterm == {(0, drain_step), (1, drain_step)}
    resumed = [e["step"] for e in _events(base, 1) if e["event"] == "resumed"]
    assert resumed == [crash_resume, drain_step]  # nothing redone after the drain
    starts = [e["env"] for e in _events(base, 1) if e["event"] == "start"]
    assert [s["TORCHELASTIC_RESTART_COUNT"] for s in starts] == ["0", "1", "1"]
    assert {(s["RANK"], s["WORLD_SIZE"], s["LOCAL_RANK"], s["GROUP_RANK"], s["MASTER_ADDR"],
             s["TORCHELASTIC_RUN_ID"], s["TORCHELASTIC_MAX_RESTARTS"]) for s in starts} == \
        {("1", "2", "0", "1", "127.0.0.1", "plain", "3")}
    assert len({s["MASTER_PORT"] for s in starts}) == 3  # a fresh store each epoch
    kinds = [e.kind for e in cluster.events()]
    assert kinds.count("migration-planned") == 2 and kinds.count("migration-done") == 2

    # `understudy stop`: there is no step vote in a plain script, so every rank gets SIGTERM,
    # saves where it is and ends; the job is stopped, cleanly.
    base2 = tmp_path / "stopped"
    run = cluster.cli("run", "--job", "plain2", "--tp", "1", "--dp", "1", "--restart-only",
                      "--", sys.executable, *_script_args(base2), "--step-sleep", "0.04")
    assert run.returncode == 0 and "rank 0 on node-a" in run.stdout, run.stderr
    _until("a first checkpoint", lambda: _saved(base2) >= 10, 60)
    stop = cluster.cli("stop", "plain2", "--grace", "30", "-o", "json", timeout=60)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    said = json.loads(stop.stdout)
    assert said["state"] == "stopped" and said["clean"], said
    (saved,) = [e["step"] for e in _events(base2, 0)
                if e["event"] == "saved" and e["reason"] == "sigterm"]
    assert saved == _saved(base2) >= 10
