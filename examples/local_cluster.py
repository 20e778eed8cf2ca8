"""The main job: a live migration on a local understudy cluster with an embedded etcd.

Starts one etcd member on loopback and four real ``understudyd`` daemons (two active nodes with
two slots each, two standby nodes), runs a TP=2 x DP=2 training job on them with
``understudy run``, waits until the standbys are warm in their sandbox (they replayed the first
iterations the job recorded), drains one active node while the job trains (its two ranks move
live to the standbys; the other ranks never stop), then prints the downtime of the switch and
checks the final state bit for bit against an uninterrupted run of the same job and seed.

Run it with ``scripts/demo`` (which sets the machine up first).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

import torch

from understudy.testing.embedded_etcd import EmbeddedEtcd
from understudy.testing.localcluster import LocalCluster

TRAIN = str(Path(__file__).parent / "plain_torch" / "train.py")
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def show(title: str, cluster: LocalCluster, *args: str, timeout: float = 120) -> str:
    print(f"\n$ understudy {' '.join(args)}    # {title}", flush=True)
    out = cluster.cli(*args, timeout=timeout)
    print(out.stdout.rstrip(), flush=True)
    if out.returncode != 0:
        print(out.stderr.rstrip(), file=sys.stderr)
        raise SystemExit(f"`understudy {' '.join(args)}` failed with exit code {out.returncode}")
    return out.stdout


def switch_downtime(summary: dict[str, Any]) -> tuple[int, float, float]:
    """(switch step, its time beyond a normal step, the normal step) from a surviving rank's
    timings: the design's downtime, (first step after) - (last step before) - one step."""
    steps, switch = {}, None
    for t in summary["timings"]:
        if t["committed"]:
            steps[t["step"]] = t["boundary"] + t["compute"] + t["vote"] + t["apply"]
            if t.get("action") == "switch-groups":
                switch = t["step"]
    if switch is None:
        raise SystemExit("rank 0 never switched groups: no migration happened during the run")
    normal = median(v for k, v in steps.items() if k != switch)
    return switch, steps[switch] - normal, normal


def wait_for_standbys(cluster: LocalCluster, nodes: tuple[str, ...],
                      timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all("Standby is warm" in cluster.daemons[n].log_text() for n in nodes):
            return
        time.sleep(0.2)
    raise SystemExit("the standby workers did not warm up")


def reference_run(base: Path, job_args: list[str]) -> Path:
    """The same job, uninterrupted, on four plain processes (no daemons)."""
    procs = []
    for rank in range(4):
        with open(base / f"reference-r{rank}.log", "wb") as log:
            procs.append(subprocess.Popen(
                [sys.executable, TRAIN, *job_args, "--save", str(base / "reference"),
                 "--rank", str(rank), "--world-size", "4", "--tp", "2",
                 "--store", str(base / "reference-store")],
                env={**os.environ, **ONE_THREAD}, stdout=subprocess.DEVNULL, stderr=log))
    for p in procs:
        if p.wait(timeout=600) != 0:
            raise SystemExit(f"the reference run failed; see {base}/reference-r*.log")
    return base / "reference"


def identical(a_dir: Path, b_dir: Path) -> bool:
    def leaves(tree: Any, path: str = "") -> dict[str, Any]:
        if isinstance(tree, dict):
            return {k: v for key, sub in tree.items() for k, v in leaves(sub, f"{path}/{key}")
                    .items()}
        if isinstance(tree, list | tuple):
            return {k: v for i, sub in enumerate(tree) for k, v in leaves(sub, f"{path}[{i}]")
                    .items()}
        return {path: tree}

    for rank in range(4):
        a = leaves(torch.load(a_dir / f"rank{rank}.pt", weights_only=False))
        b = leaves(torch.load(b_dir / f"rank{rank}.pt", weights_only=False))
        for key, va in a.items():
            if key.endswith("redone"):
                continue
            vb = b.get(key)
            same = torch.equal(va, vb) if torch.is_tensor(va) else va == vb
            if not same:
                print(f"  rank {rank}: {key} differs")
                return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep-dir", help="keep logs and data here instead of a temp dir")
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()
    base = Path(args.keep_dir or tempfile.mkdtemp(prefix="understudy-demo-"))
    base.mkdir(parents=True, exist_ok=True)
    job_args = ["--steps", str(args.steps), "--step-sleep", "0.04"]
    print(f"understudy demo: logs and data in {base}", flush=True)
    with EmbeddedEtcd(data_dir=base / "etcd") as etcd:
        print(f"embedded etcd is up at {etcd.endpoint}", flush=True)
        cluster = LocalCluster(etcd_endpoint=etcd.endpoint, base_dir=base / "nodes")
        try:
            for name in ("node-a", "node-b"):
                cluster.add(name, "active", extra=["--slots", "2"])
            for name in ("node-s1", "node-s2"):
                cluster.add(name, "standby")
            for name, state in (("node-a", "active"), ("node-b", "active"),
                                ("node-s1", "standby"), ("node-s2", "standby")):
                cluster.wait_state(name, state)
            cluster.wait_for("a controller", lambda s: s.controller is not None)
            show("the cluster", cluster, "status")
            # Ranks 0 and 1 record their first iterations there; the standbys replay them in
            # their sandbox (docs/sandbox.md), so they are warm before anything happens.
            recordings = {"UNDERSTUDY_RECORDINGS": str(base / "recordings")}
            env = [f"--env={k}={v}" for k, v in {**ONE_THREAD, **recordings}.items()]
            show("start a TP=2 x DP=2 job with two standbys", cluster, "run", "--job", "demo",
                 "--tp", "2", "--dp", "2", "--standby", "2", *env, "--", sys.executable,
                 TRAIN, *job_args, "--save", str(base / "run"))
            cluster.wait_for("every rank to start", lambda s: all(
                n.workers >= 1 for n in s.nodes), timeout=120)
            wait_for_standbys(cluster, ("node-s1", "node-s2"))
            show("the standbys, warm in their sandbox", cluster, "status")
            show("drain node-b while the job trains: its ranks move live", cluster, "drain",
                 "node-b", "--wait", "--deadline", "120", "--reason", "demo maintenance",
                 timeout=200)
            cluster.wait_for("the job to finish", lambda s: s.job("demo") is not None and
                             s.job("demo").state in ("done", "failed", "stopped"),  # type: ignore
                             timeout=600)
            show("the cluster after the drain", cluster, "status")
            events = show("what happened", cluster, "events")
            del events
            for line in cluster.cli("events", "--json").stdout.splitlines():
                ev = json.loads(line)
                if ev["kind"] == "migration-done":
                    t = ev["details"]["timings"]
                    print("\nmigration phases (seconds after it was planned): " +
                          ", ".join(f"{k} {v:.2f}" for k, v in t.items()))
            job = cluster.status().job("demo")
            if job is None or job.state != "done":
                raise SystemExit(f"the job did not finish: {job.status if job else None}")
        finally:
            cluster.stop_all(timeout=10)
    step, downtime, normal = switch_downtime(
        json.loads((base / "run" / "rank0.json").read_text()))
    print(f"\ndowntime of the switch, seen by rank 0 (which never stopped): {downtime:.3f} s "
          f"at step {step} (a normal step takes {normal:.3f} s)", flush=True)
    print("running the same job uninterrupted for comparison...", flush=True)
    reference = reference_run(base, job_args)
    same = identical(reference, base / "run")
    print("final state matches the uninterrupted run bit for bit: "
          + ("YES" if same else "NO"), flush=True)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
