"""Volatile-capacity benchmark: a seeded trace of capacity dips, under live reshape, paused,
torchft on fewer replica groups, and torchrun elastic restarting at the new size.

One command, real processes, every variant in the same invocation (fresh processes each),
``--repeats`` times, the order rotating, the same trace for all. The job: the plain example, TP 2
x DP 2. Under understudy the cluster is ``node-a`` (the controller) and ``node-b``, two slots
each, and no standby; the job runs with ``--slots 2`` (a ``SlottedJob``: the same bits on any
replica count) and ``--standby 0``:

- **reshape**: ``understudy run --reshape``: at a reclaim the lost replica is dropped and the
  other trains on alone, holding both slots; when capacity returns the job grows back onto it;
- **pause**: without: the job waits, its survivors holding their state, until the new capacity
  takes the lost ranks (``docs/recovery.md``);
- **torchft**: ``PlainJob`` under torchft (``baseline/torchft_job.py``), one replica group per
  DP index, the Lighthouse and the job at ``--min-replicas 1``: at a reclaim group 1 (its agent
  and workers) is killed and group 0 trains on alone on its own micro-batches, the global batch
  halved (torchft's way); at the return a new group 1 joins the quorum and heals from group 0;
- **torchrun**: ``PlainJob`` under torchrun elastic agents (``baseline/torchrun_job.py``), two
  agents of two workers, ``--nnodes 1:2``, a DCP checkpoint every ``--ckpt-every`` steps: at a
  reclaim agent 1 and its workers are killed; agent 0's workers fail on the broken connections,
  and once the rendezvous has declared agent 1 dead (torchrun's keep-alive: 5 s x 3) it starts
  them again alone, TP 2 x DP 1 (the global batch halved), from the newest checkpoint, redoing
  the steps since; at the return a new agent joins, and all four restart from the newest
  checkpoint at DP 2. The rendezvous' ``last_call_timeout`` is 1 s (torchrun's default, 30 s,
  would add 30 s to every shrink).

The trace (``trace``, seeded): ``--dips`` times, after a stretch at full capacity (uniform in
[0.5, 1.5] x ``--mean-up`` seconds), the capacity holding replica 1 is reclaimed in a burst: the
daemon and workers of every node holding one of its ranks are killed at once (kill -9; the
first time ``node-b``, later the two standby nodes it grew onto; torchft: group 1's agent and
workers; torchrun: agent 1 and its workers); a stretch later (uniform in [0.5, 1.5] x
``--mean-down``) capacity comes back: two fresh standby nodes of one slot each (new daemons, as a
cloud's autoscaler adds them; torchft: a new agent for group 1; torchrun: a new agent). A last
stretch at full capacity ends the trace. A reclaim fires at its offset from the start, or, where
the job is not back at full size yet (its replica 1 training again), as soon as it is; the delay
is recorded.

From the job's per-step lines (``--step-log``; a step's commit time is its first rank's), over
the window from the trace's start to its end (the last return plus the last stretch):

- **useful steps**: the steps first committed in the window (a step torchrun redoes after a
  restart counts once, when it was first committed);
- **normal step**: the median interval between commits before the first reclaim;
- **goodput** = useful steps x normal step / window;
- **batch goodput**: the same with each step weighted by the share of the global batch it
  trained: 1 under understudy (a replica holding two slots computes both: with ``--step-sleep``
  per slot, at twice the time), the replicas that committed it over 2 for torchft and torchrun
  (a step on one replica group trains half the batch). Capacity short of half bounds it to
  about ``1 - short / 2 x window`` for every system;
- per dip: the steps committed while capacity was short (the reclaim to the return), and the
  wait from the return to the job's first step at full size again;
- whether the run ends equal to an uninterrupted run of its job (on four plain processes,
  ``harness.reference_run``): understudy's final states bit for bit; for every variant, how many
  of the losses it logged are identical to the uninterrupted run's, and the first that is not
  (torchft and torchrun save no state of the example's kind).

Prints a summary, writes JSON (machine, command, configuration, the trace, every dip) and a
timeline PNG (each variant's steps over time, the dips shaded). Every process it starts is
stopped on exit, Ctrl-C and SIGTERM included.

    .venv/bin/python benchmarks/capacity.py [--seed S] [--dips N] [--mean-up S] [--mean-down S]
                                            [--repeats N] [--variants V,...] [--smoke]
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import harness
import psutil
import steplog
from baseline.elastic import ElasticRun, TorchrunConfig, TorchrunError, torchrun_setup
from baseline.torchft_run import TorchftConfig, TorchftRun
from harness import (
    PROCESS_ENV,
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

VARIANTS = ("reshape", "pause", "torchft", "torchrun")
#: The variants that run ``PlainJob`` (their losses are held to its uninterrupted run's).
PLAIN = {"torchft", "torchrun"}
#: The torchrun rendezvous' ``last_call_timeout``, seconds (see the module docstring).
LAST_CALL_S = 1.0
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


def through_trace(tail: RecordTail, args: Any, dips: list[Dip], length: float,
                  take: Callable[[], dict[str, Any]],
                  give: Callable[[], object]) -> tuple[float, float, list[dict[str, Any]]]:
    """Drive a running job through the trace: once it has committed :data:`LEAD_STEPS` steps
    the trace starts; at each dip ``take()`` reclaims replica 1's capacity (what it returns is
    recorded), ``give()`` brings capacity back, and the next dip waits for the job to be at
    full size again. Returns the window (the trace's start and end, wall times) and the dips as
    they were served.

    Raises:
        BenchmarkError: the job ran out of steps before the trace did. ClusterTimeout or
            BenchmarkError: something waited for never came.
    """
    def newest_step() -> int:
        tail.poll()
        return max((s for _, s in tail.newest.values()), default=-1)

    wait(f"the job's first {LEAD_STEPS} steps", lambda: newest_step() >= LEAD_STEPS,
         timeout=300, interval=0.2)
    start = time.time()
    served: list[dict[str, Any]] = []
    returned_at = start
    for i, dip in enumerate(dips):
        time.sleep(max(0.0, start + dip.down - time.time()))
        fired_at = time.time()
        taken = take()
        time.sleep(max(0.0, fired_at + (dip.up - dip.down) - time.time()))
        returned_at = time.time()
        give()

        def back(since: float = returned_at) -> bool:
            tail.poll()
            return first_full(tail.records, since) is not None

        wait(f"the job back at full size after dip {i + 1}", back,
             timeout=args.serve_timeout, interval=0.2)
        served.append({"index": i, "planned_down": start + dip.down, "fired_at": fired_at,
                       "delay_s": fired_at - (start + dip.down), **taken,
                       "returned_at": returned_at,
                       "full_at": first_full(tail.records, returned_at)})
    # The last stretch at full capacity, from the last return as it happened.
    end = returned_at + (length - dips[-1].up)
    time.sleep(max(0.0, end - time.time()))
    if newest_step() >= args.steps - 1:
        raise BenchmarkError("the job ran out of steps before the trace did: raise --steps")
    return start, end, served


def run_understudy(variant: str, args: Any, dips: list[Dip], length: float,
                   base: Path) -> dict[str, Any]:
    """One run of ``variant`` (reshape, pause) through the trace on a fresh cluster: its
    figures, and where its final state is."""
    out, steps_dir = base / "out", base / "steps"
    tail = RecordTail(steps_dir)
    load_before = os.getloadavg()[0]
    t0 = time.monotonic()
    joined: list[str] = []
    with local_cluster(base, args.ttl) as (_, cluster):
        bring_up(cluster, standbys=())
        env = [f"--env={k}={v}" for k, v in PROCESS_ENV.items()]
        run = cluster.cli("run", "--job", JOB, "--tp", str(TP), "--dp", str(SLOTS),
                          "--standby", "0", *(["--reshape"] if variant == "reshape" else []),
                          *env, "--", sys.executable, str(TRAIN), "--slots", str(SLOTS),
                          "--steps", str(args.steps), "--step-sleep", str(args.step_sleep),
                          "--save", str(out), "--step-log", str(steps_dir),
                          *harness.example_options(args.smoke))
        if run.returncode != 0:
            raise BenchmarkError(f"understudy run failed: {run.stderr.strip()}")

        def take() -> dict[str, Any]:
            nodes = replica1_nodes(cluster)
            return {"reclaimed": nodes, "killed_pids": reclaim(cluster, nodes)}

        start, end, served = through_trace(tail, args, dips, length, take,
                                           lambda: add_standbys(cluster, TP, joined))
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
            "daemon_log_tracebacks": seen["tracebacks"], "out": str(out),
            "losses": steplog.losses(tail.records)}


def run_torchft(args: Any, dips: list[Dip], length: float, base: Path) -> dict[str, Any]:
    """The job under torchft, continuing on fewer replica groups (``--min-replicas 1``): at a
    dip replica group 1 (its agent and workers) is killed, at the return a new group for it
    starts, joins the quorum and heals from group 0 (``baseline/torchft_run.py``)."""
    run = TorchftRun(TorchftConfig(steps=args.steps, step_sleep=args.step_sleep,
                                   min_replicas=1), base)
    return run_baseline("torchft", run, args, dips, length,
                        lambda: {"reclaimed": ["replica group 1"],
                                 "killed_at": run.kill_group(1)},
                        lambda: run.add_group(1), run.log_tail)


def run_torchrun(args: Any, dips: list[Dip], length: float, base: Path) -> dict[str, Any]:
    """The job under torchrun elastic (``--nnodes 1:2``): at a dip agent 1 and its workers are
    killed and agent 0 restarts alone from the newest checkpoint; at the return a new agent
    joins and both restart from the newest checkpoint (``baseline/elastic.py``)."""
    run = ElasticRun(TorchrunConfig(steps=args.steps, step_sleep=args.step_sleep,
                                    ckpt_every=args.ckpt_every, min_nodes=1,
                                    last_call_s=LAST_CALL_S), base)
    return run_baseline("torchrun", run, args, dips, length,
                        lambda: {"reclaimed": ["agent 1"], "killed_at": run.reclaim_node()},
                        run.add_agent, run.agent_log_tail)


def run_baseline(variant: str, run: Any, args: Any, dips: list[Dip], length: float,
                 take: Callable[[], dict[str, Any]], give: Callable[[], object],
                 log_tail: Callable[[], str]) -> dict[str, Any]:
    """One run of a baseline (``run``: a ``TorchftRun`` or an ``ElasticRun``, not started)
    through the trace, ``take`` reclaiming and ``give`` returning its capacity; its figures,
    each step weighted by the share of the batch it trained."""
    load_before = os.getloadavg()[0]
    t0 = time.monotonic()
    try:
        run.start()
        start, end, served = through_trace(run.tail, args, dips, length, take, give)
        codes = run.wait_finished(timeout=args.serve_timeout + 10 * args.steps)
        records = run.records()
    except TorchrunError as exc:
        raise BenchmarkError(f"{variant}: {exc}\n{log_tail()}") from exc
    finally:
        run.stop()
    figures = analyse(commits(records), start, end, served, batch_shares(records))
    return {"variant": variant, "wall_s": time.monotonic() - t0, "start": start, "end": end,
            **figures, "agent_exit_codes": codes,
            "restores": sum(1 for r in records if r.get("kind") == "restored"),
            "steps_redone": steps_redone(records),
            "loadavg_1m_before_after": [load_before, os.getloadavg()[0]],
            "losses": steplog.losses(records)}


def steps_redone(records: list[dict[str, Any]]) -> int:
    """Steps committed more than once (rank 0's lines): the work a restart threw away."""
    seen: dict[int, int] = {}
    for r in records:
        if r.get("kind", "step") == "step" and r["rank"] == 0:
            seen[r["step"]] = seen.get(r["step"], 0) + 1
    return sum(n - 1 for n in seen.values())


def run_variant(variant: str, args: Any, dips: list[Dip], length: float,
                base: Path) -> dict[str, Any]:
    if variant == "torchft":
        return run_torchft(args, dips, length, base)
    if variant == "torchrun":
        return run_torchrun(args, dips, length, base)
    return run_understudy(variant, args, dips, length, base)


def batch_shares(records: list[dict[str, Any]]) -> dict[int, float]:
    """Per step, the share of the global batch its first commit trained: the replicas with a
    line for it within 0.5 s of its first (a step redone after a restart, seconds later, is
    not counted twice), over the job's replica count. For the plain job (torchft, torchrun),
    whose replicas each train their own micro-batch."""
    first = commits(records)
    replicas: dict[int, set[int]] = {}
    for r in records:
        if r.get("kind", "step") == "step" and r["t"] <= first[r["step"]] + 0.5:
            replicas.setdefault(r["step"], set()).add(r["rank"] // TP)
    return {step: len(reps) / SLOTS for step, reps in replicas.items()}


def analyse(commit: dict[int, float], start: float, end: float,
            served: list[dict[str, Any]], shares: dict[int, float] | None = None
            ) -> dict[str, Any]:
    """The figures of one run (see the module docstring); ``shares``: each step's share of the
    global batch (None: every step trains it whole, as a slotted job's does)."""
    times = sorted(commit.values())
    if not times or times[0] >= start or times[-1] < end:
        raise BenchmarkError("the job's step lines do not span the trace")
    before = [b - a for a, b in pairwise(times) if b < start][WARMUP:]
    if not before:
        raise BenchmarkError("too few steps before the trace for a normal step")
    normal = statistics.median(before)
    useful = sum(1 for t in times if start < t <= end)
    batches = sum(1.0 if shares is None else shares.get(step, 1.0)
                  for step, t in commit.items() if start < t <= end)
    dips = []
    for d in served:
        short = [t for t in times if d["fired_at"] <= t < d["returned_at"]]
        dips.append({**d, "steps_short": len(short),
                     "short_s": d["returned_at"] - d["fired_at"],
                     "return_to_full_s": d["full_at"] - d["returned_at"]})
    window = end - start
    return {"window_s": window, "normal_step_s": normal, "useful_steps": useful,
            "goodput": useful * normal / window, "batch_goodput": batches * normal / window,
            "useful_batches": batches,
            "steps_short": sum(d["steps_short"] for d in dips),
            "short_s": sum(d["short_s"] for d in dips), "dips": dips,
            # The timeline: (seconds from the trace's start, step) of every commit, and the
            # global batches trained by then.
            "timeline": [(round(t - start, 3), s) for s, t in sorted(commit.items())],
            "batch_timeline": batch_timeline(commit, start, shares)}


def batch_timeline(commit: dict[int, float], start: float,
                   shares: dict[int, float] | None) -> list[tuple[float, float]]:
    """(seconds from ``start``, global batches trained by then) at every commit, in time
    order."""
    out, total = [], 0.0
    for t, step in sorted((t, s) for s, t in commit.items()):
        total += 1.0 if shares is None else shares.get(step, 1.0)
        out.append((round(t - start, 3), total))
    return out


def run_repeat(i: int, args: Any, dips: list[Dip], length: float, references: dict[str, Path],
               base: Path) -> dict[str, Any]:
    """Every variant once, in an order that rotates from repeat to repeat, each held to its
    uninterrupted run (``references``: the ``--save`` directory of each)."""
    order = args.variants[i % len(args.variants):] + args.variants[:i % len(args.variants)]
    runs = {}
    for v in order:
        run = run_variant(v, args, dips, length, base / v)
        reference = references["plain" if v in PLAIN else "slotted"]
        run["losses_vs_reference"] = steplog.compare_losses(
            steplog.losses(harness.read_records(reference.parent / "steps")), run.pop("losses"))
        # torchft and torchrun save no --save state: their losses say whether they trained
        # the same model.
        run["bitwise"] = (harness.compare_states(reference, Path(run["out"]), WORLD)
                          if "out" in run else {"equal": None, "difference": "no state saved"})
        runs[v] = run
    print(f"  repeat {i + 1}/{args.repeats}: " + "; ".join(
        f"{v} goodput {r['goodput']:.3f} (batches {r['batch_goodput']:.3f}), "
        f"{r['steps_short']} steps while short, equal: "
        f"{r['bitwise']['equal']}, losses {r['losses_vs_reference']['identical']}/"
        f"{r['losses_vs_reference']['compared']}" for v, r in runs.items()),
        file=sys.stderr, flush=True)
    return {"repeat": i, "order": list(order), **runs}


def collect(repeats: list[dict[str, Any]], variants: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for v in variants:
        runs = [r[v] for r in repeats]
        dips = [d for x in runs for d in x["dips"]]
        out[v] = {
            **{k: summarize([x[k] for x in runs])
               for k in ("goodput", "batch_goodput", "useful_steps", "useful_batches",
                         "normal_step_s", "window_s", "steps_short", "short_s")},
            "return_to_full_s": summarize([d["return_to_full_s"] for d in dips]),
            "reclaim_delay_s": summarize([d["delay_s"] for d in dips]),
            "state_equal_every_repeat": (None if any(x["bitwise"]["equal"] is None
                                                     for x in runs)
                                         else all(x["bitwise"]["equal"] for x in runs)),
            "losses_identical_every_repeat": all(
                x["losses_vs_reference"]["identical"] == x["losses_vs_reference"]["compared"]
                for x in runs),
            "first_loss_difference": [x["losses_vs_reference"]["first_difference"]
                                      for x in runs],
        }
        if v == "torchrun":
            out[v]["steps_redone"] = summarize([x["steps_redone"] for x in runs])
    if "reshape" in variants and "pause" in variants:
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
    for v in cfg["variants"]:
        x = s[v]
        table.row(f"{v}: goodput", x["goodput"], "")
        table.row("  goodput in global batches", x["batch_goodput"], "")
        table.row("  useful steps in the window", x["useful_steps"], "steps", fmt=".0f")
        table.row("  window", x["window_s"], "s")
        table.row("  normal step (DP 2)", x["normal_step_s"], "s")
        table.row("  steps committed while short", x["steps_short"], "steps", fmt=".0f")
        table.row("  capacity back -> full size (per dip)", x["return_to_full_s"], "s")
        table.row("  reclaim delayed (per dip)", x["reclaim_delay_s"], "s")
        if "steps_redone" in x:
            table.row("  steps redone after restarts", x["steps_redone"], "steps", fmt=".0f")
        state = x["state_equal_every_repeat"]
        print(f"  {v}: final state equal to the uninterrupted run's, bit for bit, every repeat: "
              f"{'(not saved)' if state is None else state}; every loss identical: "
              f"{x['losses_identical_every_repeat']} (first difference at "
              f"{x['first_loss_difference']})")
    if "goodput_gained" in s:
        table.row("goodput gained by reshaping over pausing", s["goodput_gained"], "")


def plot(result: dict[str, Any], path: Path) -> None:
    """Each variant's global batches trained over time in the first repeat (a baseline's step
    on one replica group counts half), the dips shaded."""
    plt = harness.pyplot()
    rep = result["repeats"][0]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    colours = {"reshape": "tab:blue", "pause": "tab:orange", "torchft": "tab:green",
               "torchrun": "tab:red"}
    for v in result["config"]["variants"]:
        run, colour = rep[v], colours[v]
        t = [x for x, _ in run["batch_timeline"]]
        steps = [y for _, y in run["batch_timeline"]]
        ax.plot(t, steps, color=colour, lw=1.2,
                label=f"{v} (goodput {run['goodput']:.2f}, in batches "
                      f"{run['batch_goodput']:.2f})")
        for d in run["dips"]:
            ax.axvspan(d["fired_at"] - run["start"], d["returned_at"] - run["start"],
                       color=colour, alpha=0.10)
        ax.axvline(run["end"] - run["start"], color=colour, ls=":", lw=0.8)
    ax.set_xlim(left=-5)
    ax.set_xlabel("seconds from the trace's start (shaded: replica 1's capacity reclaimed; "
                  "dotted: the window's end)")
    ax.set_ylabel("global batches trained (a half-batch step: 1/2)")
    ax.set_title(f"TP {TP} x DP {SLOTS}, seed {result['config']['seed']}: live reshape, pause, "
                 "torchft, torchrun elastic")
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
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"which to run, comma-separated (default {','.join(VARIANTS)})")
    p.add_argument("--steps", type=int, help="steps of the job (default: enough to outlast "
                   "the trace at --step-sleep a step)")
    p.add_argument("--ckpt-every", type=int, default=20,
                   help="torchrun: a DCP checkpoint every N steps (default 20)")
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
    args.variants = [v for v in args.variants.split(",") if v]
    if not args.variants or set(args.variants) - set(VARIANTS):
        p.error(f"--variants takes some of {', '.join(VARIANTS)}, got {args.variants}")
    if args.mean_up <= 0 or args.mean_down <= 0 or args.step_sleep <= 0 or args.ckpt_every < 1:
        p.error("--mean-up, --mean-down, --step-sleep and --ckpt-every must be positive")
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
    os.environ.update(PROCESS_ENV)
    dips, length = trace(args.seed, args.dips, args.mean_up, args.mean_down)
    scratch = harness.Scratch(args.keep_dir, "understudy-bench-capacity-")

    def work() -> list[dict[str, Any]]:
        # The uninterrupted runs: the slotted job (understudy's variants), and the plain one
        # (torchft and torchrun run PlainJob: their losses are held to that one's).
        references = {}
        for name, job_args in (("slotted", ("--slots", str(SLOTS))), ("plain", ())):
            if name == "plain" and not PLAIN & set(args.variants):
                continue
            ref = scratch.base / f"reference-{name}"
            references[name] = harness.reference_run(
                ref, WORLD, TP, args.steps, args.smoke,
                (*job_args, "--step-log", str(ref / "steps")))
        return [run_repeat(i, args, dips, length, references, scratch.base / f"repeat{i}")
                for i in range(args.repeats)]

    repeats = scratch.run("capacity benchmark", (OSError, UnderstudyError, psutil.Error), work)
    if isinstance(repeats, int):
        return repeats
    result = {
        **harness.header("capacity", scratch.started, torch=True),
        "config": {"seed": args.seed, "dips": args.dips, "mean_up": args.mean_up,
                   "mean_down": args.mean_down, "repeats": args.repeats,
                   "variants": args.variants, "steps": args.steps,
                   "step_sleep": args.step_sleep, "ttl": args.ttl, "smoke": args.smoke,
                   "torchrun": {**torchrun_setup(10), "nnodes": "1:2",
                                "last_call_timeout_s": LAST_CALL_S,
                                "ckpt_every": args.ckpt_every, "drain_notice": False},
                   "trace_s": length, "short_s": sum(d.up - d.down for d in dips),
                   "trace": [asdict(d) for d in dips], "tp": TP, "slots": SLOTS,
                   "job": "examples/plain_torch/train.py --slots 2", "threads_per_process": 1},
        "summary": collect(repeats, args.variants),
        "repeats": repeats,
        "chart": str(args.png),
    }
    harness.report(result, args.out, print_summary, plot, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
