"""Volatile-capacity benchmark: a seeded trace of capacity dips, under live reshape and paused.

One command, real processes, both variants on fresh clusters in the same invocation, ``--repeats``
times each, the order alternating, the same trace for both. The cluster: ``node-a`` (the
controller) and ``node-b``, two slots each, and no standby. The job: the plain example, TP 2 x
DP 2 with ``--slots 2`` (a ``SlottedJob``: the same bits on any replica count), ``--standby 0``,
run

- **reshape**: with ``understudy run --reshape``: at a reclaim the lost replica is dropped and
  the other trains on alone, holding both slots; when capacity returns the job grows back onto
  it;
- **pause**: without: the job waits, its survivors holding their state, until the new capacity
  takes the lost ranks (``docs/recovery.md``).

The trace (``trace``, seeded): ``--dips`` times, after a stretch at full capacity (uniform in
[0.5, 1.5] x ``--mean-up`` seconds), the capacity holding replica 1 is reclaimed in a burst: the
daemon and workers of every node holding one of its ranks are killed at once (kill -9; the
first time ``node-b``, later the two standby nodes it grew onto); a stretch later (uniform in
[0.5, 1.5] x ``--mean-down``) capacity comes back: two fresh standby nodes of one slot each (new
daemons, as a cloud's autoscaler adds them). A last stretch at full capacity ends the trace. A
reclaim fires at its offset from the start, or, where the job is not back at full size yet (its
replica 1 training again), as soon as it is; the delay is recorded.

From the job's per-step lines (``--step-log``; a step's commit time is its first rank's), over
the window from the trace's start to its end (the last return plus the last stretch):

- **useful steps**: the steps committed in the window (neither variant redoes a step);
- **normal step**: the median interval between commits before the first reclaim;
- **goodput** = useful steps x normal step / window;
- per dip: the steps committed while capacity was short (the reclaim to the return), and the
  wait from the return to the job's first step at full size again;
- whether the run's final state equals an uninterrupted run's (the same job on four plain
  processes, ``harness.reference_run``), bit for bit.

Prints a summary, writes JSON (machine, command, configuration, the trace, every dip) and a
timeline PNG (each variant's steps over time, the dips shaded). Every process it starts is
stopped on exit, Ctrl-C and SIGTERM included.

    .venv/bin/python benchmarks/capacity.py [--seed S] [--dips N] [--mean-up S] [--mean-down S]
                                            [--repeats N] [--smoke]
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import harness
import psutil
from harness import (
    ONE_THREAD,
    TRAIN,
    BenchmarkError,
    RecordTail,
    Table,
    local_cluster,
    snapshot,
    summarize,
    wait,
    wait_done,
)
from interruptions import JOB, TP, WORLD, add_standbys, bring_up, train_processes

from understudy.common import config as config_mod
from understudy.common.errors import UnderstudyError

VARIANTS = ("reshape", "pause")
SLOTS = WORLD // TP
#: Steps committed before the trace starts (warm-up, and the intervals the normal step is of).
LEAD_STEPS = 60
#: Steps left out of the normal step at the start (the first ones build and warm up).
WARMUP = 10


@dataclass(frozen=True)
class Dip:
    """Capacity for replica 1 reclaimed ``down`` seconds into the trace, back at ``up``."""

    down: float
    up: float


def trace(seed: int, dips: int, mean_up: float, mean_down: float) -> tuple[list[Dip], float]:
    """The dips and the trace's length: stretches at full capacity and short alternate, each
    drawn uniformly from ``[0.5, 1.5] x`` its mean, starting and ending at full capacity."""
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(dips):
        down = t + rng.uniform(0.5, 1.5) * mean_up
        up = down + rng.uniform(0.5, 1.5) * mean_down
        out.append(Dip(down, up))
        t = up
    return out, t + rng.uniform(0.5, 1.5) * mean_up


def commits(records: list[dict[str, Any]]) -> dict[int, float]:
    """Per step, its commit time: the first of its ranks' lines."""
    first: dict[int, float] = {}
    for r in records:
        if r.get("kind", "step") == "step":
            first[r["step"]] = min(first.get(r["step"], r["t"]), r["t"])
    return first


def first_full(records: list[dict[str, Any]], since: float) -> float | None:
    """The first commit of a rank of replica 1 after ``since``: the job at full size again."""
    return min((r["t"] for r in records if r.get("kind", "step") == "step"
                and r["rank"] >= TP and r["t"] > since), default=None)


def replica1_nodes(cluster: Any) -> list[str]:
    """The nodes holding a rank of replica 1 (ranks ``TP..2*TP-1``) in the current assignment.

    Raises:
        BenchmarkError: the job is not at full size.
    """
    job = cluster.status().job(JOB)
    if job is None or job.assignment is None or len(job.assignment.ranks) != WORLD:
        raise BenchmarkError(f"the job is not at full size: {job.status if job else 'gone'}")
    return sorted(set(job.assignment.ranks[TP:2 * TP]))


def reclaim(cluster: Any, nodes: list[str]) -> list[int]:
    """kill -9 of the nodes' daemons and the job's workers under them, at once; their pids."""
    daemons = [cluster.daemons[n] for n in nodes]
    workers = [p.pid for p in train_processes(cluster, tuple(nodes))]
    for d in daemons:
        os.kill(d.pid, signal.SIGKILL)
    for pid in workers:  # each worker leads a process group of its own
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    for d in daemons:
        d.wait(timeout=10)
    return [d.pid for d in daemons] + workers


def run_variant(variant: str, args: Any, dips: list[Dip], length: float,
                base: Path) -> dict[str, Any]:
    """One run of ``variant`` through the trace on a fresh cluster: its figures, and where its
    final state is."""
    out, steps_dir = base / "out", base / "steps"
    tail = RecordTail(steps_dir)
    load_before = os.getloadavg()[0]
    t0 = time.monotonic()
    served: list[dict[str, Any]] = []
    joined: list[str] = []
    with local_cluster(base, args.ttl) as (_, cluster):
        bring_up(cluster, standbys=())
        env = [f"--env={k}={v}" for k, v in ONE_THREAD.items()]
        run = cluster.cli("run", "--job", JOB, "--tp", str(TP), "--dp", str(SLOTS),
                          "--standby", "0", *(["--reshape"] if variant == "reshape" else []),
                          *env, "--", sys.executable, str(TRAIN), "--slots", str(SLOTS),
                          "--steps", str(args.steps), "--step-sleep", str(args.step_sleep),
                          "--save", str(out), "--step-log", str(steps_dir),
                          *harness.example_options(args.smoke))
        if run.returncode != 0:
            raise BenchmarkError(f"understudy run failed: {run.stderr.strip()}")

        def newest_step() -> int:
            tail.poll()
            return max((s for _, s in tail.newest.values()), default=-1)

        wait(f"the job's first {LEAD_STEPS} steps", lambda: newest_step() >= LEAD_STEPS,
             timeout=300, interval=0.2)
        start = time.time()
        for i, dip in enumerate(dips):
            time.sleep(max(0.0, start + dip.down - time.time()))
            nodes = replica1_nodes(cluster)
            fired_at = time.time()
            pids = reclaim(cluster, nodes)
            time.sleep(max(0.0, fired_at + (dip.up - dip.down) - time.time()))
            returned_at = time.time()
            add_standbys(cluster, TP, joined)

            def back(since: float = returned_at) -> bool:
                tail.poll()
                return first_full(tail.records, since) is not None

            wait(f"the job back at full size after dip {i + 1}", back,
                 timeout=args.serve_timeout, interval=0.2)
            full_at = first_full(tail.records, returned_at)
            served.append({"index": i, "planned_down": start + dip.down,
                           "fired_at": fired_at, "delay_s": fired_at - (start + dip.down),
                           "reclaimed": nodes, "killed_pids": pids, "returned_at": returned_at,
                           "full_at": full_at})
        # The last stretch at full capacity, from the last return as it happened.
        end = returned_at + (length - dips[-1].up) if dips else start + length
        time.sleep(max(0.0, end - time.time()))
        if newest_step() >= args.steps - 1:
            raise BenchmarkError("the job ran out of steps before the trace did: raise --steps")
        job = wait_done(cluster, JOB, timeout=args.serve_timeout + 10 * args.steps)
        seen = snapshot(cluster)
    tail.poll()
    figures = analyse(commits(tail.records), start, end, served)
    kinds = [e["kind"] for e in seen["events"]]
    return {"variant": variant, "wall_s": time.monotonic() - t0, "start": start, "end": end,
            **figures, "epochs": job.assignment.epoch if job.assignment else None,
            "paused_events": kinds.count("job-paused"),
            "plans": [e["message"] for e in seen["events"] if e["kind"] == "migration-planned"],
            "loadavg_1m_before_after": [load_before, os.getloadavg()[0]],
            "daemon_log_tracebacks": seen["tracebacks"], "out": str(out)}


def analyse(commit: dict[int, float], start: float, end: float,
            served: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of one run (see the module docstring)."""
    times = sorted(commit.values())
    if not times or times[0] >= start or times[-1] < end:
        raise BenchmarkError("the job's step lines do not span the trace")
    before = [b - a for a, b in pairwise(times) if b < start][WARMUP:]
    if not before:
        raise BenchmarkError("too few steps before the trace for a normal step")
    normal = statistics.median(before)
    useful = sum(1 for t in times if start < t <= end)
    dips = []
    for d in served:
        short = [t for t in times if d["fired_at"] <= t < d["returned_at"]]
        dips.append({**d, "steps_short": len(short),
                     "short_s": d["returned_at"] - d["fired_at"],
                     "return_to_full_s": d["full_at"] - d["returned_at"]})
    window = end - start
    return {"window_s": window, "normal_step_s": normal, "useful_steps": useful,
            "goodput": useful * normal / window,
            "steps_short": sum(d["steps_short"] for d in dips),
            "short_s": sum(d["short_s"] for d in dips), "dips": dips,
            # The timeline: (seconds from the trace's start, step) of every commit.
            "timeline": [(round(t - start, 3), s) for s, t in sorted(commit.items())]}


def run_repeat(i: int, args: Any, dips: list[Dip], length: float, reference: Path,
               base: Path) -> dict[str, Any]:
    order = VARIANTS if i % 2 == 0 else VARIANTS[::-1]
    runs = {v: run_variant(v, args, dips, length, base / v) for v in order}
    for v in order:
        runs[v]["bitwise"] = harness.compare_states(reference, Path(runs[v]["out"]), WORLD)
    r, p = runs["reshape"], runs["pause"]
    print(f"  repeat {i + 1}/{args.repeats}: goodput reshape {r['goodput']:.3f}, pause "
          f"{p['goodput']:.3f}; steps while short {r['steps_short']} vs {p['steps_short']}; "
          f"equal to the uninterrupted run: {r['bitwise']['equal']}, {p['bitwise']['equal']}",
          file=sys.stderr, flush=True)
    return {"repeat": i, "order": list(order), **runs}


def collect(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for v in VARIANTS:
        runs = [r[v] for r in repeats]
        dips = [d for x in runs for d in x["dips"]]
        out[v] = {
            **{k: summarize([x[k] for x in runs])
               for k in ("goodput", "useful_steps", "normal_step_s", "window_s", "steps_short",
                         "short_s")},
            "return_to_full_s": summarize([d["return_to_full_s"] for d in dips]),
            "reclaim_delay_s": summarize([d["delay_s"] for d in dips]),
            "equal_every_repeat": all(x["bitwise"]["equal"] for x in runs),
        }
    out["goodput_gained"] = summarize([r["reshape"]["goodput"] - r["pause"]["goodput"]
                                       for r in repeats])
    return out


def print_summary(result: dict[str, Any]) -> None:
    cfg, s = result["config"], result["summary"]
    print(f"\ncapacity: TP {TP} x DP {SLOTS} ({SLOTS} slots), no standby; seed {cfg['seed']}: "
          f"{cfg['dips']} dip(s) in a {cfg['trace_s']:.0f} s trace ({cfg['short_s']:.0f} s "
          f"short of replica 1); {cfg['repeats']} repeat(s)")
    table = Table(46, missing=f"{'(none)':>20}", repeats=cfg["repeats"])
    table.header()
    for v in VARIANTS:
        x = s[v]
        table.row(f"{v}: goodput", x["goodput"], "")
        table.row("  useful steps in the window", x["useful_steps"], "steps", fmt=".0f")
        table.row("  window", x["window_s"], "s")
        table.row("  normal step (DP 2)", x["normal_step_s"], "s")
        table.row("  steps committed while short", x["steps_short"], "steps", fmt=".0f")
        table.row("  capacity back -> full size (per dip)", x["return_to_full_s"], "s")
        table.row("  reclaim delayed (per dip)", x["reclaim_delay_s"], "s")
        print(f"  {v}: ends equal to the uninterrupted run, bit for bit, every repeat: "
              f"{x['equal_every_repeat']}")
    table.row("goodput gained by reshaping", s["goodput_gained"], "")


def plot(result: dict[str, Any], path: Path) -> None:
    """Each variant's committed steps over time in the first repeat, the dips shaded."""
    plt = harness.pyplot()
    rep = result["repeats"][0]
    fig, ax = plt.subplots(figsize=(9, 4))
    for v, colour in zip(VARIANTS, ("tab:blue", "tab:orange"), strict=True):
        run = rep[v]
        t = [x for x, _ in run["timeline"]]
        s = [y for _, y in run["timeline"]]
        ax.plot(t, s, color=colour, lw=1.2, label=f"{v} (goodput {run['goodput']:.2f})")
        for d in run["dips"]:
            ax.axvspan(d["fired_at"] - run["start"], d["returned_at"] - run["start"],
                       color=colour, alpha=0.12)
        ax.axvline(run["end"] - run["start"], color=colour, ls=":", lw=0.8)
    ax.set_xlim(left=-5)
    ax.set_xlabel("seconds from the trace's start (shaded: replica 1's capacity reclaimed)")
    ax.set_ylabel("step committed")
    ax.set_title(f"TP {TP} x DP {SLOTS}, seed {result['config']['seed']}: live reshape vs "
                 "pause")
    ax.legend(loc="upper left")
    harness.save_chart(fig, path)


def parse_args(argv: list[str] | None = None) -> Any:
    p = harness.Parser("capacity", __doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0, help="the trace's seed (default 0)")
    p.add_argument("--dips", type=int, help="reclaims in the trace (default 3; smoke 1)")
    p.add_argument("--mean-up", type=float,
                   help="mean seconds at full capacity between dips (default 20; smoke 4)")
    p.add_argument("--mean-down", type=float,
                   help="mean seconds short of replica 1's capacity (default 30; smoke 6)")
    p.add_argument("--repeats", type=int, help="repeats of each variant (default 1; smoke 1)")
    p.add_argument("--steps", type=int, help="steps of the job (default: enough to outlast "
                   "the trace at --step-sleep a step)")
    p.add_argument("--step-sleep", type=float, default=0.04,
                   help="seconds of stand-in work per step (default 0.04, as the e2e tests)")
    p.add_argument("--ttl", type=int, default=config_mod.LeaseConfig().ttl,
                   help="the daemons' lease TTL in seconds (default: the daemon's)")
    p.add_argument("--serve-timeout", type=float, default=300.0,
                   help="seconds the job may take to reach full size after a return (default "
                        "300)")
    p.add_argument("--smoke", action="store_true", help="a minute or two: for the tests")
    p.outputs(keep="keep daemon logs, etcd data, step lines and states here",
              chart="timeline")
    args = p.parse(argv, {"repeats": (1, 1), "dips": (3, 1), "mean_up": (20.0, 4.0),
                          "mean_down": (30.0, 6.0)})
    if args.repeats < 1 or args.dips < 1:
        p.error("--repeats and --dips must be at least 1")
    if args.mean_up <= 0 or args.mean_down <= 0 or args.step_sleep <= 0:
        p.error("--mean-up, --mean-down and --step-sleep must be positive")
    _, length = trace(args.seed, args.dips, args.mean_up, args.mean_down)
    least = LEAD_STEPS + int(length / args.step_sleep) + 100
    if args.steps is None:
        args.steps = least
    elif args.steps < least:
        p.error(f"--steps must be at least {least}: the job must outlast the trace at "
                f"{args.step_sleep:g} s a step")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.update(ONE_THREAD)
    dips, length = trace(args.seed, args.dips, args.mean_up, args.mean_down)
    scratch = harness.Scratch(args.keep_dir, "understudy-bench-capacity-")

    def work() -> list[dict[str, Any]]:
        reference = harness.reference_run(scratch.base / "reference", WORLD, TP, args.steps,
                                          args.smoke, ("--slots", str(SLOTS)))
        return [run_repeat(i, args, dips, length, reference, scratch.base / f"repeat{i}")
                for i in range(args.repeats)]

    repeats = scratch.run("capacity benchmark", (OSError, UnderstudyError, psutil.Error), work)
    if isinstance(repeats, int):
        return repeats
    result = {
        **harness.header("capacity", scratch.started, torch=True),
        "config": {"seed": args.seed, "dips": args.dips, "mean_up": args.mean_up,
                   "mean_down": args.mean_down, "repeats": args.repeats, "steps": args.steps,
                   "step_sleep": args.step_sleep, "ttl": args.ttl, "smoke": args.smoke,
                   "trace_s": length, "short_s": sum(d.up - d.down for d in dips),
                   "trace": [asdict(d) for d in dips], "tp": TP, "slots": SLOTS,
                   "job": "examples/plain_torch/train.py --slots 2", "threads_per_process": 1},
        "summary": collect(repeats),
        "repeats": repeats,
        "chart": str(args.png),
    }
    harness.report(result, args.out, print_summary, plot, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
