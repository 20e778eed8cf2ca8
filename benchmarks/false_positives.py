"""False-positive benchmark: how often the controller's probes (``daemon/probe.py``) condemn a
node that is alive, on a machine kept busy.

One command: a local cluster as the recovery benchmark sets it up (embedded etcd; ``node-a``
and ``node-b``, two slots each; two standby nodes warmed in the sandbox) runs the plain TP=2 x
DP=2 job at full speed for ``--minutes`` with no fault injected, while ``--burners`` processes
spin on the CPU besides (the job's four ranks and two standby workers already share this
machine's cores). Every ``node-unreachable`` event (a lease the controller revoked), every
``node-failed`` event and every recovery planned in that time is a false positive, since
nothing failed; a suspicion the confirming probes cleared ("answered its probe again") is
counted too. The 1-minute load average is sampled each 10 s.

Prints a summary and writes JSON. Every process it starts is stopped on exit, Ctrl-C and
SIGTERM included.

    .venv/bin/python benchmarks/false_positives.py [--minutes M] [--burners B] [--smoke]
                                                   [--out FILE]
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import harness
from harness import BenchmarkError
from interruptions import JOB, RecoveryConfig, bring_up, submit

#: steps enough for the job to outlast any run (it is stopped with the cluster)
STEPS = 10**6


def _burn() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        pass


def measure(minutes: float, burners: int, base: Path) -> dict[str, Any]:
    cfg = RecoveryConfig(repeats=1, steps=STEPS, step_sleep=0.0, crash_at=0, ttl=3,
                         smoke=False, sandbox=True)
    procs: list[multiprocessing.Process] = []
    loads: list[float] = []
    with harness.local_cluster(base, cfg.ttl) as (_, cluster):
        try:
            bring_up(cluster)
            submit(cluster, cfg, base / "out")
            procs = [multiprocessing.Process(target=_burn, daemon=True) for _ in range(burners)]
            for p in procs:
                p.start()
            t0 = time.time()
            end = time.monotonic() + minutes * 60
            while time.monotonic() < end:
                loads.append(os.getloadavg()[0])
                time.sleep(min(10.0, max(0.0, end - time.monotonic())))
            seen = harness.snapshot(cluster)
            suspicions = sum(d.log_text().count("answered its probe again")
                             for d in cluster.daemons.values())
            job = cluster.status().job(JOB)
        finally:
            for p in procs:
                p.kill()
    since = [e for e in seen["events"] if e["time"] >= t0]

    def count(kind: str) -> list[dict[str, Any]]:
        return [e for e in since if e["kind"] == kind]

    return {
        "minutes": minutes, "burners": burners,
        "false_revocations": len(count("node-unreachable")),
        "nodes_failed": len(count("node-failed")),
        "recoveries_planned": len(count("migration-planned")),
        "suspicions_cleared": suspicions,
        "revoked": [e["message"] for e in count("node-unreachable")],
        "job_state": job.state if job else "gone",
        "loadavg_1m": {"median": statistics.median(loads), "min": min(loads),
                       "max": max(loads)} if loads else None,
        "daemon_log_tracebacks": seen["tracebacks"],
    }


def main(argv: list[str] | None = None) -> int:
    p = harness.Parser("false_positives", __doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, help="how long the cluster runs (default 10; "
                   "smoke 0.5)")
    p.add_argument("--burners", type=int, default=2,
                   help="CPU-spinning processes besides the job (default 2)")
    p.add_argument("--smoke", action="store_true", help="a short run, for the tests")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/false_positives.json"))
    args = p.parse(argv, {"minutes": (10.0, 0.5)})
    minutes = args.minutes
    if minutes <= 0 or args.burners < 0:
        p.error("--minutes must be positive and --burners at least 0")
    scratch = harness.Scratch(None, "understudy-bench-fp-")
    scratch.keep = True  # this benchmark has always left its scratch directory behind
    res = scratch.run("false-positive benchmark", (BenchmarkError,),
                      lambda: measure(minutes, args.burners, scratch.base))
    if isinstance(res, int):
        return res
    result = {"benchmark": "false_positives", "command": " ".join(sys.argv),
              "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "cpus": os.cpu_count(), **res}
    harness.write_results(result, args.out)
    load = res["loadavg_1m"] or {}
    print(f"false positives: {res['false_revocations']} leases revoked, "
          f"{res['nodes_failed']} nodes failed, {res['recoveries_planned']} recoveries "
          f"planned, {res['suspicions_cleared']} suspicions cleared by the confirming probes; "
          f"{minutes:g} min, {args.burners} burners, load average {load.get('median', 0):.1f} "
          f"(min {load.get('min', 0):.1f}, max {load.get('max', 0):.1f}) on {os.cpu_count()} "
          f"CPUs; job {res['job_state']}")
    print(f"results written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
