"""Reshape benchmark: a replica lost with no standby free, under live reshape and paused.

One command, real processes, both variants on fresh clusters in the same invocation, ``--repeats``
times each, the order alternating. The cluster is the benchmarks' (``interruptions.bring_up``:
``node-a``, the controller, and ``node-b``, two slots each; standby nodes ``node-s1`` and
``node-s2``), the standby nodes cordoned: no standby is free. The job: the plain example,
TP 2 x DP 2 with ``--slots 2`` (a ``SlottedJob``: the same bits on any replica count) and
``--standby 0``, run

- **reshape**: with ``understudy run --reshape``: the lost rank's replica is dropped and the
  other trains on alone, holding both slots; when capacity returns the job grows back;
- **pause**: without: the job waits, its survivors holding their state, until a standby takes
  the lost rank (``docs/recovery.md``).

Once rank 1 has committed ``--crash-at`` steps its worker is killed (kill -9); ``--gap`` seconds
later the standby nodes are uncordoned (capacity returns, as a cloud's autoscaler or the
cluster's scheduler gives it back). From the job's per-step lines (``--step-log``: a step's
commit time is its first rank's):

- the steps committed during the gap (the kill to the uncordon) and their median interval;
- the interruption at the kill: the last commit before it to the first after it, less one
  normal step (the median interval before the kill): reshape, the shrink; pause, the whole
  pause;
- at the return: reshape, the longest time between two commits in the next two minutes, less a
  normal step (the grow); pause, the return to the first step (the recovery);
- the time without commits after the kill in all (each interval over three normal steps, less
  a normal step);
- the kill to the job's last step, and whether both variants end on the same state, bit for
  bit (every rank's ``--save``).

Prints a summary and writes JSON with the machine, the command, the configuration and every
sample. Every process it starts is stopped on exit, Ctrl-C and SIGTERM included.

    .venv/bin/python benchmarks/reshape.py [--repeats N] [--gap S] [--steps S] [--smoke]
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

import harness
import psutil
import torch
from harness import (
    PROCESS_ENV,
    TRAIN,
    BenchmarkError,
    RecordTail,
    Table,
    local_cluster,
    snapshot,
    summarize,
    wait_done,
    wait_log,
    worker_pid,
)
from interruptions import JOB, LOG_EVERY, STANDBYS, TP, VICTIM, WORLD, bring_up, steps_timeout

from understudy.common import config as config_mod
from understudy.common.errors import UnderstudyError
from understudy.common.sizes import size_arg

VARIANTS = ("reshape", "pause")
SLOTS = WORLD // TP


def run_variant(variant: str, args: Any, base: Path) -> dict[str, Any]:
    """One run of ``variant`` on a fresh cluster; its figures, and where its final state is."""
    out, steps_dir = base / "out", base / "steps"
    load_before = os.getloadavg()[0]
    t0 = time.monotonic()
    with local_cluster(base, args.ttl) as (_, cluster):
        bring_up(cluster)
        for n in STANDBYS:
            if cluster.cli("cordon", n).returncode != 0:
                raise BenchmarkError(f"could not cordon {n}")
        env = [f"--env={k}={v}" for k, v in PROCESS_ENV.items()]
        size = ["--state-size", str(args.state_size)] if args.state_size else []
        run = cluster.cli("run", "--job", JOB, "--tp", str(TP), "--dp", str(SLOTS),
                          "--standby", "0", *(["--reshape"] if variant == "reshape" else []),
                          *env, "--", sys.executable, str(TRAIN), "--slots", str(SLOTS),
                          "--steps", str(args.steps), "--step-sleep", str(args.step_sleep),
                          "--save", str(out), "--step-log", str(steps_dir), *size,
                          *harness.example_options(args.smoke))
        if run.returncode != 0:
            raise BenchmarkError(f"understudy run failed: {run.stderr.strip()}")
        d = cluster.daemons["node-a"]
        wait_log(d, f"Started rank {VICTIM} of job {JOB}", timeout=steps_timeout(0))
        pid = worker_pid(d, f"{JOB}.r{VICTIM}")  # found first: the job runs on meanwhile
        wait_log(d, f"{args.crash_at} steps committed on rank {VICTIM}",
                 timeout=steps_timeout(args.crash_at))
        kill_at = time.time()
        os.kill(pid, signal.SIGKILL)
        time.sleep(max(0.0, kill_at + args.gap - time.time()))
        back_at = time.time()
        for n in STANDBYS:
            if cluster.cli("uncordon", n).returncode != 0:
                raise BenchmarkError(f"could not uncordon {n}")
        job = wait_done(cluster, JOB, timeout=steps_timeout(args.steps) + 600)
        seen = snapshot(cluster)
    tail = RecordTail(steps_dir)
    tail.poll()
    figures = analyse(tail.records, kill_at, back_at)
    kinds = [e["kind"] for e in seen["events"]]
    planned = [e["message"] for e in seen["events"] if e["kind"] == "migration-planned"]
    return {"variant": variant, "wall_s": time.monotonic() - t0, "kill_at": kill_at,
            "back_at": back_at, **figures, "epochs": job.assignment.epoch if job.assignment
            else None, "paused_events": kinds.count("job-paused"), "plans": planned,
            "loadavg_1m_before_after": [load_before, os.getloadavg()[0]],
            "daemon_log_tracebacks": seen["tracebacks"], "out": str(out)}


def analyse(records: list[dict[str, Any]], kill_at: float, back_at: float) -> dict[str, Any]:
    """The figures of one run from its step lines (see the module docstring)."""
    first: dict[int, float] = {}
    for r in records:
        if r.get("kind", "step") == "step":
            first[r["step"]] = min(first.get(r["step"], r["t"]), r["t"])
    times = sorted(first.values())
    if not times or times[0] >= kill_at or times[-1] < back_at:
        raise BenchmarkError("the job's step lines do not span the kill and the return")
    before = [b - a for a, b in pairwise(times) if b < kill_at][5:]
    normal = statistics.median(before) if before else 0.0
    in_gap = [t for t in times if kill_at <= t < back_at]
    gap_intervals = [b - a for a, b in pairwise(in_gap)]
    last_before = max(t for t in times if t < kill_at)
    first_after = min(t for t in times if t >= kill_at)
    # After the return: the longest time between two commits in the next two minutes (a
    # grow's stop), or, for a job that did not train in the gap, the wait for its first step.
    after = [max(t for t in times if t < back_at), *(t for t in times
                                                    if back_at <= t <= back_at + 120)]
    longest = max((b - a for a, b in pairwise(after)), default=0.0)
    stalled = sum(g - normal for a, b in pairwise(times)
                  if (g := b - a) > 3 * normal and b >= kill_at)
    return {"normal_step_s": normal, "steps_in_gap": len(in_gap),
            "step_in_gap_s": statistics.median(gap_intervals) if gap_intervals else None,
            "at_loss_s": first_after - last_before - normal,
            "at_return_s": longest - normal if in_gap else first_after - back_at,
            "stalled_s": stalled, "kill_to_last_step_s": times[-1] - kill_at,
            "steps": len(times)}


def same_state(a: Path, b: Path) -> dict[str, Any]:
    """Whether two runs' final states (each rank's ``--save``) are the same, bit for bit."""
    differ = []
    for r in range(WORLD):
        x = torch.load(a / f"rank{r}.pt", weights_only=False)
        y = torch.load(b / f"rank{r}.pt", weights_only=False)
        differ += [f"rank {r}{p}" for p in _differences(x, y, "")]
    return {"identical": not differ, "differences": differ[:5]}


def _differences(x: Any, y: Any, path: str) -> list[str]:
    if isinstance(x, dict) and isinstance(y, dict):
        if set(x) != set(y):
            return [f"{path}: keys {sorted(set(x) ^ set(y))}"]
        return [d for k in sorted(x, key=str) for d in _differences(x[k], y[k], f"{path}/{k}")]
    if isinstance(x, list | tuple) and isinstance(y, list | tuple):
        if len(x) != len(y):
            return [f"{path}: lengths {len(x)} and {len(y)}"]
        return [d for i, (p, q) in enumerate(zip(x, y, strict=True))
                for d in _differences(p, q, f"{path}/{i}")]
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        same = x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        return [] if same else [path]
    return [] if x == y else [path]


def run_repeat(i: int, args: Any, base: Path) -> dict[str, Any]:
    order = VARIANTS if i % 2 == 0 else VARIANTS[::-1]
    runs = {v: run_variant(v, args, base / v) for v in order}
    rep: dict[str, Any] = {"repeat": i, "order": list(order), **runs,
                           "same_state": same_state(Path(runs["reshape"]["out"]),
                                                    Path(runs["pause"]["out"]))}
    r, p = runs["reshape"], runs["pause"]
    print(f"  repeat {i + 1}/{args.repeats}: reshape {r['steps_in_gap']} steps in the gap, "
          f"shrink {r['at_loss_s']:.2f} s, grow {r['at_return_s']:.2f} s; pause "
          f"{p['steps_in_gap']} steps, recovery {p['at_return_s']:.2f} s; same state: "
          f"{rep['same_state']['identical']}", file=sys.stderr, flush=True)
    return rep


def collect(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    def of(variant: str, key: str) -> dict[str, float] | None:
        values = [r[variant][key] for r in repeats if r[variant][key] is not None]
        return summarize(values) if values else None

    out: dict[str, Any] = {v: {k: of(v, k) for k in (
        "normal_step_s", "steps_in_gap", "step_in_gap_s", "at_loss_s", "at_return_s",
        "stalled_s", "kill_to_last_step_s")} for v in VARIANTS}
    out["same_state_every_repeat"] = all(r["same_state"]["identical"] for r in repeats)
    out["steps_gained"] = summarize([r["reshape"]["steps_in_gap"] - r["pause"]["steps_in_gap"]
                                     for r in repeats])
    return out


def print_summary(result: dict[str, Any]) -> None:
    cfg, s = result["config"], result["summary"]
    print(f"\nreshape: TP {TP} x DP {SLOTS} ({SLOTS} slots), no standby free; rank {VICTIM}'s "
          f"worker killed after step {cfg['crash_at']}, capacity back {cfg['gap']:g} s later; "
          f"{cfg['repeats']} repeat(s)")
    table = Table(46, missing=f"{'(none)':>20}", repeats=cfg["repeats"])
    table.header()
    for v in VARIANTS:
        x = s[v]
        table.row(f"{v}: normal step (DP 2)", x["normal_step_s"], "s")
        table.row("  steps committed in the gap", x["steps_in_gap"], "steps")
        table.row("  step in the gap", x["step_in_gap_s"], "s")
        table.row("  interruption at the loss", x["at_loss_s"], "s")
        table.row("  at the return (grow; pause: to a step)", x["at_return_s"], "s")
        table.row("  time without steps after the kill", x["stalled_s"], "s")
        table.row("  kill -> last step", x["kill_to_last_step_s"], "s")
    table.row("steps gained by reshaping", s["steps_gained"], "steps")
    print(f"  both variants end on the same state, bit for bit, every repeat: "
          f"{s['same_state_every_repeat']}")


def parse_args(argv: list[str] | None = None) -> Any:
    p = harness.Parser("reshape", __doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, help="repeats of each variant (default 3; smoke 1)")
    p.add_argument("--steps", type=int, help="steps of the job (default 800; smoke 250)")
    p.add_argument("--gap", type=float, help="seconds from the kill to capacity's return "
                   "(default 20; smoke 4)")
    p.add_argument("--step-sleep", type=float, default=0.04,
                   help="seconds of stand-in work per step (default 0.04, as the e2e tests)")
    p.add_argument("--crash-at", type=int, default=2 * LOG_EVERY,
                   help=f"kill once this many steps are committed, a multiple of {LOG_EVERY} "
                        f"(default {2 * LOG_EVERY})")
    p.add_argument("--ttl", type=int, default=config_mod.LeaseConfig().ttl,
                   help="the daemons' lease TTL in seconds (default: the daemon's)")
    p.add_argument("--state-size", type=size_arg, metavar="SIZE",
                   help="the job's state per rank (train.py --state-size; default: the "
                        "example's own, about 27 KB)")
    p.add_argument("--smoke", action="store_true", help="a minute or two: for the tests")
    p.outputs(keep="keep daemon logs, etcd data, step lines and states here")
    args = p.parse(argv, {"repeats": (3, 1), "steps": (800, 250), "gap": (20.0, 4.0)})
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.crash_at < LOG_EVERY or args.crash_at % LOG_EVERY:
        p.error(f"--crash-at must be a positive multiple of {LOG_EVERY}, got {args.crash_at}")
    if args.gap <= 0 or args.step_sleep < 0:
        p.error("--gap must be positive and --step-sleep at least 0")
    if args.steps < args.crash_at + 100:
        p.error("--steps must be at least --crash-at + 100: the job must outlast the gap")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.update(PROCESS_ENV)
    scratch = harness.Scratch(args.keep_dir, "understudy-bench-reshape-")
    repeats = scratch.repeats("reshape benchmark", args.repeats,
                              lambda i, base: run_repeat(i, args, base),
                              (OSError, UnderstudyError, psutil.Error))
    if isinstance(repeats, int):
        return repeats
    result = {
        **harness.header("reshape", scratch.started, torch=True),
        "config": {"repeats": args.repeats, "steps": args.steps, "gap": args.gap,
                   "step_sleep": args.step_sleep, "crash_at": args.crash_at, "ttl": args.ttl,
                   "state_bytes": args.state_size, "smoke": args.smoke, "tp": TP, "slots": SLOTS,
                   "victim_rank": VICTIM, "job": "examples/plain_torch/train.py --slots 2",
                   "threads_per_process": 1},
        "summary": collect(repeats),
        "repeats": repeats,
    }
    harness.report(result, args.out, print_summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
