"""The benchmarks run end to end: their smoke modes, as the operator would run them.

Behaviour, not speed: the commands exit 0 and write plausible figures. The design targets are
reported by the full runs (docs/benchmarks.md), never asserted here.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def run_benchmark(script: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run a benchmark script; on timeout, SIGTERM it so it stops its own etcd and daemons."""
    proc = subprocess.Popen([sys.executable, str(REPO / "benchmarks" / script), *args],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"{script} {' '.join(args)} ran past {timeout}s:\n{out}\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.timeout(120)
def test_control_plane_smoke(tmp_path: Path) -> None:
    if shutil.which("etcd") is None:
        pytest.fail("etcd is not installed: the test command installs it (scripts/test)")
    out_file = tmp_path / "control_plane.json"
    res = run_benchmark("control_plane.py", "--smoke", "--out", str(out_file), timeout=90)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "kill -9 -> failed" in res.stdout

    data = json.loads(out_file.read_text())
    assert {"benchmark", "command", "machine", "config", "failure_detection", "idle",
            "daemon_log_tracebacks"} <= set(data)
    assert {"platform", "cpu_count", "python", "etcd_version"} <= set(data["machine"])
    assert "--smoke" in data["command"]
    cfg = data["config"]
    assert cfg["smoke"] is True and cfg["nodes"] == 2 and cfg["repeats"] == 1

    fd = data["failure_detection"]
    assert len(fd["samples"]) == cfg["repeats"]
    for s in fd["samples"]:
        assert s["victim"] != s["controller"]
        assert 0 < s["kill_to_lease_gone_s"] <= s["kill_to_failed_s"] < cfg["ttl"] + 10
    assert {"median", "min", "max", "p90", "spread"} <= set(fd["summary"])
    assert fd["summary"]["min"] <= fd["summary"]["median"] <= fd["summary"]["max"]
    assert fd["target_s"] == cfg["ttl"] + 0.5

    idle = data["idle"]
    assert idle["window_s"] >= cfg["idle_seconds"]
    assert idle["etcd"]["requests_per_s_per_node"] > 0
    assert idle["daemons"]["requests_per_s_per_node"] > 0
    # Every daemon keeps its lease alive while idle, and etcd sees those keep-alives.
    assert idle["etcd"]["by_method"]["LeaseKeepAlive"]["count"] > 0
    assert idle["daemons"]["by_op"]["lease_keepalive"]["count"] > 0
    assert set(idle["daemons"]["per_node"]) == {"node-00", "node-01"}
    fp = idle["footprint"]
    assert 1 < fp["rss_mib"]["median"] <= fp["rss_mib"]["max"]
    assert 0 <= fp["cpu_percent_of_one_core"]["median"] <= fp["cpu_percent_of_one_core"]["max"]
    assert sum(data["daemon_log_tracebacks"].values()) == 0


@pytest.mark.timeout(240)
def test_migration_smoke(tmp_path: Path) -> None:
    if shutil.which("etcd") is None:
        pytest.fail("etcd is not installed: the test command installs it (scripts/test)")
    out_file = tmp_path / "migration.json"
    res = run_benchmark("migration.py", "--smoke", "--out", str(out_file), timeout=200)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "downtime (phase 2)" in res.stdout

    data = json.loads(out_file.read_text())
    assert {"benchmark", "command", "machine", "config", "summary", "repeats"} <= set(data)
    assert {"platform", "cpu_count", "python", "etcd_version"} <= set(data["machine"])
    assert "--smoke" in data["command"]
    cfg = data["config"]
    assert cfg["smoke"] is True and cfg["repeats"] == 1
    assert len(data["repeats"]) == cfg["repeats"]

    for rep in data["repeats"]:
        # The switch happened mid-run, at one step that both joiners started from.
        assert 0 < rep["switch_step"] < cfg["steps"]
        assert set(rep["survivors"]) == {"0", "1"} and set(rep["joiners"]) == {"2", "3"}
        for s in rep["survivors"].values():
            assert 0 < s["normal_step_s"] < s["switch_step_s"]
            assert s["switch_boundary_s"] <= s["switch_step_s"]
            assert s["downtime_s"] == pytest.approx(s["switch_step_s"] - s["normal_step_s"],
                                                   abs=1e-5)  # microsecond JSON
            assert s["redone"] == 0
        assert rep["downtime_s"] == max(s["downtime_s"] for s in rep["survivors"].values())
        # The phases follow each other; the steps before the switch are placed in them.
        ph = rep["phases_s"]
        assert ph["planned"] == 0
        assert ph["planned"] < ph["preparing"] <= ph["ready"] <= ph["switching"]
        assert ph["switching"] <= ph["done"]
        assert rep["phase1_s"] == ph["ready"]
        counted = rep["phase1_steps"]["count"] + rep["steps_before_planned"]
        assert 0 <= counted <= rep["switch_step"]
        # Each leaver sent the same kind of state: the toy job's, tens of kilobytes.
        assert set(rep["transfers"]) == {"2", "3"}
        for t in rep["transfers"].values():
            assert t["step"] == rep["switch_step"]
            assert 1_000 < t["payload_bytes"] < 10_000_000 and t["entries"] > 0
            assert t["seconds"] > 0 and t["mb_per_s"] > 0
        p2p = rep["p2p"]
        assert p2p["raw"]["state"]["bytes"] == rep["transfers"]["2"]["payload_bytes"]
        assert p2p["raw"]["64MiB"]["bytes"] == 64 * 1024 * 1024
        for kind in ("raw", "send_state"):
            assert p2p[kind]["64MiB"]["mb_per_s"] > 10
            assert p2p[kind]["state"]["median_s"] < p2p[kind]["64MiB"]["median_s"]
        assert rep["daemon_log_tracebacks"] == 0

    s = data["summary"]
    d = s["downtime"]
    assert d["target_s"] == 0.25 and d["summary"]["n"] == cfg["repeats"]
    assert {"median", "min", "max", "p90", "spread"} <= set(d["summary"])
    assert 0 < d["summary"]["min"] <= d["summary"]["median"] <= d["summary"]["max"]
    assert d["excess_around_switch_s"]["median"] > 0  # the switch step itself is in it
    assert s["transfer"]["state_payload_bytes"] > 0
    assert s["transfer"]["fraction_of_raw_64mib_bandwidth"] > 0
    assert s["p2p"]["target_fraction"] == 0.7
    assert s["p2p"]["send_state_fraction_of_raw_64mib"]["median"] > 0


@pytest.mark.timeout(600)
def test_recovery_smoke(tmp_path: Path) -> None:
    if shutil.which("etcd") is None:
        pytest.fail("etcd is not installed: the test command installs it (scripts/test)")
    out_file = tmp_path / "recovery.json"
    res = run_benchmark("recovery.py", "--smoke", "--out", str(out_file), timeout=540)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "worker crash (rank 1): end to end" in res.stdout
    assert "cold / warm" in res.stdout

    data = json.loads(out_file.read_text())
    assert {"benchmark", "command", "machine", "config", "summary", "repeats"} <= set(data)
    assert {"platform", "cpu_count", "python", "etcd_version"} <= set(data["machine"])
    assert "--smoke" in data["command"]
    cfg = data["config"]
    assert cfg["smoke"] is True and cfg["repeats"] == 1 and cfg["ttl"] >= 3
    assert len(data["repeats"]) == cfg["repeats"]

    phases = ("detection", "planning", "settle", "rebuild_transfer", "first_step")
    for rep in data["repeats"]:
        for key, lost in (("worker_crash", ["1"]), ("node_loss", ["2", "3"])):
            sc = rep[key]
            # Every lost rank was taken by a standby, from a live data-parallel replica.
            assert sorted(sc["transfers"]) == sorted(sc["joiners"]) == lost
            assert set(sc["joiners"].values()) <= {"node-s1", "node-s2"}
            assert sc["controller"] == "node-a"
            # The phases follow each other and add up to the end-to-end figure.
            assert sc["end_to_end_s"] > 0 and sc["phases_s"]["detection"] > 0
            assert sum(sc["phases_s"][p] for p in phases) == pytest.approx(
                sc["end_to_end_s"], abs=1e-4)  # microsecond JSON
            for t in sc["transfers"].values():
                assert t["payload_bytes"] > 0 and t["send_s"] > 0 and t["joiner_receive_s"] > 0
                assert t["step"] == sc["settled_step"]
            for j in sc["joiner_timeline"].values():
                assert 0 < j["chosen_to_took_over_s"] < j["chosen_to_first_step_s"]
            # The failure landed mid-run; the job redid no more than the step it lost.
            assert cfg["crash_at"] <= sc["steps_before_failure"] <= sc["settled_step"]
            assert sc["settled_step"] < cfg["steps"] and sc["settled_steps_agree"]
            assert sc["first_step_after"] == sc["settled_step"]
            assert sc["recovery"]["phase"] == "done"
        assert rep["worker_crash"]["exit_record"]["failed"] is True
        assert "node-b" in rep["node_loss"]["node_failed_message"]
        cold = rep["cold_start"]
        assert cold["saved_step"] == cfg["steps"] and set(cold["ranks"]) == {"0", "1", "2", "3"}
        for r in cold["ranks"].values():
            assert 0 < r["first_step_s"] < r["spawn_to_first_step_s"] <= r["spawn_to_exit_s"]
            # The parts fit in the whole: imports, the step, and the rest (start, build, load).
            assert 0 <= r["lazy_dynamo_import_s"] < r["imports_s"]
            assert r["start_groups_build_load_s"] > 0
        assert rep["warm_vs_cold"]["cold_over_warm"] > 0

    s = data["summary"]
    for key in ("worker_crash", "node_loss"):
        for fig in ("end_to_end_s", *(f"{p}_s" for p in phases), "transfer_send_s"):
            assert {"median", "min", "max", "spread", "n"} <= set(s[key][fig])
            assert s[key][fig]["min"] <= s[key][fig]["median"] <= s[key][fig]["max"]
        assert s[key]["end_to_end_s"]["min"] > 0
    assert s["node_loss"]["lease_ttl_s"] == cfg["ttl"]
    w = s["warm_vs_cold"]
    for fig in ("warm_chosen_to_first_step_s", "cold_spawn_to_first_step_s", "cold_over_warm"):
        assert w[fig]["median"] > 0
