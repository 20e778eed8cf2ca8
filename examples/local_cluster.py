"""The main job: a local understudy cluster on an embedded etcd.

Starts one etcd member on loopback and three real ``understudyd`` daemons (two active nodes and
one standby), shows ``understudy status``, drains a node with ``understudy drain --wait``, and
shows the state change and the events. Everything is torn down at the end.

Run it with ``scripts/demo`` (which sets the machine up first).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from understudy.daemon.embedded_etcd import EmbeddedEtcd
from understudy.daemon.localcluster import LocalCluster


def show(title: str, cluster: LocalCluster, *args: str) -> None:
    print(f"\n$ understudy {' '.join(args)}    # {title}", flush=True)
    out = cluster.cli(*args)
    print(out.stdout.rstrip(), flush=True)
    if out.returncode != 0:
        print(out.stderr.rstrip(), file=sys.stderr)
        raise SystemExit(f"`understudy {' '.join(args)}` failed with exit code {out.returncode}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep-dir", help="keep logs and etcd data here instead of a temp dir")
    args = parser.parse_args()
    base = Path(args.keep_dir or tempfile.mkdtemp(prefix="understudy-demo-"))
    base.mkdir(parents=True, exist_ok=True)
    print(f"understudy demo: logs and data in {base}", flush=True)
    with EmbeddedEtcd(data_dir=base / "etcd") as etcd:
        print(f"embedded etcd is up at {etcd.endpoint}", flush=True)
        cluster = LocalCluster(etcd_endpoint=etcd.endpoint, base_dir=base / "nodes")
        try:
            t0 = time.monotonic()
            for name, role in (("node-a", "active"), ("node-b", "active"),
                               ("node-s", "standby")):
                cluster.add(name, role)
            cluster.wait_state("node-a", "active")
            cluster.wait_state("node-b", "active")
            cluster.wait_state("node-s", "standby")
            cluster.wait_for("a controller", lambda s: s.controller is not None)
            print(f"three daemons joined in {time.monotonic() - t0:.2f}s", flush=True)
            show("the cluster", cluster, "status")
            show("drain a node and wait for it", cluster, "drain", "node-b", "--wait",
                 "--deadline", "30", "--reason", "demo maintenance")
            show("the cluster after the drain", cluster, "status")
            show("what happened", cluster, "events")
            print("\nLive migration of training ranks to the standby arrives with the "
                  "worker runtime; this demo shows the control plane it runs on.", flush=True)
        finally:
            cluster.stop_all(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
