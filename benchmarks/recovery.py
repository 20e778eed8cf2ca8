"""Recovery benchmark: end-to-end recovery from unexpected failures, and warm vs cold start.

One command, real processes. N times, each scenario on a fresh local cluster (an embedded etcd,
``node-a`` and ``node-b`` with two slots each, standby nodes ``node-s1`` and ``node-s2``; node-a
is started first so that it holds the controller): the plain-PyTorch example
(``examples/plain_torch/train.py``) runs TP=2 x DP=2 with two standbys under ``understudy run``,
once both standby workers are up (imports done, waiting to be chosen) and, unless
``--no-sandbox``, warm: the job is given a recording directory, ranks 0 and 1 record their first
iterations, and each standby builds the job for one rank on replay groups and runs shadow
iterations (node-s2 warms as rank 1, which the controller then gives it).

1. **Worker crash.** Once rank 1 has committed ``--crash-at`` steps (its runtime says so in the
   log every 50), its worker is killed with SIGKILL. End to end: the kill -> the last
   "First step after recovery" log line over all ranks (every rank has committed a step on the
   new groups). Split, each phase from the previous milestone: detection (-> the ``time`` of the
   rank's exit record in etcd, written by its daemon), planning (-> the controller's
   ``migration-planned`` event, emitted once the plan is in etcd), settle (-> the last
   survivor's "settled on step" line: the survivors saw the plan, aborted their step and agreed
   on the last committed step), rebuild+transfer (-> the last survivor's "Recovered from the
   loss" line: new group versions up, the joiner prepared and given the state), first step
   (-> the last "First step after recovery" line). Also: the donor's state transfer (its
   "Gave rank 1's joiner the state" line), the step the survivors were at when they aborted,
   the step the job settled on.
2. **Node loss.** Once every rank has committed ``--crash-at`` steps, ``node-b``'s daemon and its
   two workers are killed with SIGKILL at once (no clean leave, no exit record): the loss is
   detected by the node's lease expiring. The same split, with detection = the kill -> the
   controller's ``node-failed`` event.
3. **Warm standby vs cold start of the same rank.** Warm: the joiner of scenario 1, from its
   "Standby chosen to take over rank 1" line to its "First step after recovery" line (which
   includes waiting for the survivors), and to its "Took over rank 1" line. Cold: after the
   job of scenario 1 finished (and its cluster is stopped), the same job starts fresh as four
   standalone processes loading the run's final state (``--load``; ``--steps`` one more than the
   saved step, so exactly one step runs); per process, Popen -> its state saved after that step
   (the file's mtime), split into its imports (``python -X importtime``, in the same process:
   the interpreter's, torch, the example's, and ``torch._dynamo``, which the job's first
   optimizer imports lazily while it builds), the step itself (the process's saved timings),
   and the rest (interpreter start, the groups' rendezvous, the build, loading the state).
   Ratio: cold / warm.

Prints a summary and writes JSON with the machine, the command, the configuration and every
sample. Every process it starts is stopped on exit, Ctrl-C and SIGTERM included.

    .venv/bin/python benchmarks/recovery.py [--repeats N] [--steps S] [--state-size SIZE]
        [--smoke] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import harness
import psutil
from harness import PROCESS_ENV, REPO, TRAIN, BenchmarkError, Table, summarize, summarize_some
from interruptions import (
    LOG_EVERY,
    LOST_NODE,
    PHASES,
    TP,
    VICTIM,
    WORLD,
    RecoveryConfig,
    node_loss,
    worker_crash,
)

from understudy.common import config as config_mod
from understudy.common.errors import UnderstudyError
from understudy.common.sizes import size_arg

KEEPALIVE_INTERVAL = config_mod.LeaseConfig().keepalive_interval
#: A line of ``python -X importtime``: microseconds, two spaces of indent per nesting level.
IMPORT_TIME = re.compile(r"^import time:\s+(?P<self>\d+) \|\s+(?P<cumulative>\d+) \| "
                         r"(?P<indent> *)(?P<module>\S+)\s*$")
#: Imported lazily by the job's first optimizer, while it builds.
LAZY = "torch._dynamo"


def spawn_all(argvs: list[list[str]], base: Path, name: str) -> list[dict[str, Any]]:
    """Start the commands at once (stdout and stderr to files under ``base``); returns each one's
    Popen time, exit time (polled every 5 ms), exit code and stdout. Every process is killed
    should this be cut short."""
    env = {**os.environ, **PROCESS_ENV}
    procs: list[tuple[float, subprocess.Popen[bytes]]] = []
    try:
        for i, argv in enumerate(argvs):
            with open(base / f"{name}{i}.out", "wb") as out, \
                    open(base / f"{name}{i}.err", "wb") as err:
                t = time.time()
                procs.append((t, subprocess.Popen(argv, cwd=REPO, env=env,
                                                  stdin=subprocess.DEVNULL, stdout=out,
                                                  stderr=err)))
        ended: dict[int, float] = {}
        deadline = time.monotonic() + 300
        while len(ended) < len(procs):
            if time.monotonic() > deadline:
                raise BenchmarkError(f"{name} processes ran past 300 s (logs in {base})")
            for i, (_, p) in enumerate(procs):
                if i not in ended and p.poll() is not None:
                    ended[i] = time.time()
            time.sleep(0.005)
    finally:
        for _, p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    return [{"popen_at": t, "exit_at": ended[i], "returncode": p.returncode,
             "stdout": (base / f"{name}{i}.out").read_text(errors="replace"),
             "stderr_tail": (base / f"{name}{i}.err").read_text(errors="replace")[-2000:]}
            for i, (t, p) in enumerate(procs)]


def import_times(stderr: str) -> dict[str, float]:
    """Seconds per top-level import, its nested imports included, from the lines of
    ``-X importtime`` (the interpreter's own imports at start-up are among them)."""
    out: dict[str, float] = {}
    for line in stderr.splitlines():
        m = IMPORT_TIME.match(line)
        if m and not m["indent"]:
            out[m["module"]] = int(m["cumulative"]) / 1e6
    return out


def cold_start(saved: Path, cfg: RecoveryConfig, base: Path) -> dict[str, Any]:
    """The job started fresh as four standalone processes from the run's final state (one step).

    Raises:
        BenchmarkError: the saved state is missing, or a process failed.
    """
    base.mkdir(parents=True, exist_ok=True)
    try:
        steps = {json.loads((saved / f"rank{r}.json").read_text())["step"] for r in range(WORLD)}
    except (OSError, json.JSONDecodeError, KeyError) as exc:
        raise BenchmarkError(f"the run's final state is missing or unreadable: {exc}") from exc
    if len(steps) != 1:
        raise BenchmarkError(f"the ranks saved different steps: {sorted(steps)}")
    step = steps.pop()
    out = base / "out"
    argvs = [[sys.executable, "-X", "importtime", str(TRAIN), "--rank", str(r),
              "--world-size", str(WORLD), "--tp", str(TP), "--store", str(base / "store"),
              "--steps", str(step + 1), "--step-sleep", str(cfg.step_sleep),
              "--load", str(saved), "--save", str(out),
              *(["--state-size", str(cfg.state_bytes)] if cfg.state_bytes else []),
              *(["--shard-optimizer"] if cfg.shard_optimizer else []),
              *harness.example_options(cfg.smoke)]
             for r in range(WORLD)]
    ranks: dict[str, Any] = {}
    for r, p in enumerate(spawn_all(argvs, base, "rank")):
        stderr = (base / f"rank{r}.err").read_text(errors="replace")
        if p["returncode"] != 0:
            told = "\n".join(x for x in stderr.splitlines() if not x.startswith("import time:"))
            raise BenchmarkError(f"cold rank {r} exited with {p['returncode']}: {told[-2000:]}")
        try:
            summary = json.loads((out / f"rank{r}.json").read_text())
            saved_at = (out / f"rank{r}.pt").stat().st_mtime
        except (OSError, json.JSONDecodeError) as exc:
            raise BenchmarkError(f"cold rank {r} saved nothing readable: {exc}") from exc
        timings = summary["timings"]
        if summary["step"] != step + 1 or [t["step"] for t in timings] != [step]:
            raise BenchmarkError(f"cold rank {r} ran steps {[t['step'] for t in timings]}, "
                                 f"not just step {step}")
        imports = import_times(stderr)
        if not imports:
            raise BenchmarkError(f"cold rank {r} wrote no -X importtime lines")
        first = timings[0]
        first_s = first["boundary"] + first["compute"] + first["vote"] + first["apply"]
        # The state is saved right after the step (a few kB): its mtime stands for the commit.
        to_first = saved_at - p["popen_at"]
        imports_s = sum(imports.values())
        ranks[str(r)] = {
            "spawn_to_first_step_s": to_first,
            "imports_s": imports_s,
            "lazy_dynamo_import_s": imports.get(LAZY, 0.0),
            "slowest_imports": dict(sorted(imports.items(), key=lambda kv: -kv[1])[:5]),
            "start_groups_build_load_s": to_first - imports_s - first_s,
            "first_step_s": first_s, "first_step_compute_s": first["compute"],
            "spawn_to_exit_s": p["exit_at"] - p["popen_at"],
        }

    def med(key: str) -> float:
        return statistics.median(x[key] for x in ranks.values())

    return {
        "saved_step": step,
        "spawn_to_first_step_s": med("spawn_to_first_step_s"),
        "slowest_spawn_to_first_step_s": max(x["spawn_to_first_step_s"] for x in ranks.values()),
        "imports_s": med("imports_s"),
        "lazy_dynamo_import_s": med("lazy_dynamo_import_s"),
        "start_groups_build_load_s": med("start_groups_build_load_s"),
        "first_step_s": med("first_step_s"),
        "spawn_to_exit_s": med("spawn_to_exit_s"),
        "ranks": ranks,
    }


def run_repeat(i: int, cfg: RecoveryConfig, base: Path) -> dict[str, Any]:
    crash = worker_crash(cfg, base / "crash")
    cold = cold_start(base / "crash" / "out", cfg, base / "cold")
    warm = crash["joiner_timeline"][str(VICTIM)]
    lost = node_loss(cfg, base / "node")
    return {"repeat": i, "worker_crash": crash, "node_loss": lost, "cold_start": cold,
            "warm_vs_cold": {
                "warm_chosen_to_first_step_s": warm["chosen_to_first_step_s"],
                "warm_chosen_to_took_over_s": warm["chosen_to_took_over_s"],
                "warm_chosen_to_preparing_s": warm["chosen_to_preparing_s"],
                "cold_spawn_to_first_step_s": cold["spawn_to_first_step_s"],
                "cold_over_warm": cold["spawn_to_first_step_s"] / warm["chosen_to_first_step_s"],
                "cold_over_warm_took_over": cold["spawn_to_first_step_s"]
                / warm["chosen_to_took_over_s"],
            }}


# -- the run -----------------------------------------------------------------------------------

def collect(repeats: list[dict[str, Any]], cfg: RecoveryConfig) -> dict[str, Any]:
    def scenario(key: str, what: str, detection: str) -> dict[str, Any]:
        s = [r[key] for r in repeats]
        transfers = [t for x in s for t in x["transfers"].values()]
        joiners = [j for x in s for j in x["joiner_timeline"].values()]
        return {
            "what": what, "detection": detection,
            "end_to_end_s": summarize([x["end_to_end_s"] for x in s]),
            **{f"{p}_s": summarize([x["phases_s"][p] for x in s]) for p in PHASES},
            "transfer_send_s": summarize([t["send_s"] for t in transfers]),
            "transfer_joiner_receive_s": summarize([t["joiner_receive_s"] for t in transfers]),
            "transfer_payload_bytes": transfers[0]["payload_bytes"],
            "joiner_chosen_to_first_step_s": summarize([j["chosen_to_first_step_s"]
                                                        for j in joiners]),
            "steps_before_failure": summarize_some([x["steps_before_failure"] for x in s
                                                    if x["steps_before_failure"] is not None]),
            "settled_step": summarize([x["settled_step"] for x in s]),
        }

    warm = [r["warm_vs_cold"] for r in repeats]
    cold = [r["cold_start"] for r in repeats]
    return {
        "worker_crash": scenario(
            "worker_crash", f"kill -9 of rank {VICTIM}'s worker -> the last 'First step after "
            "recovery' line over all ranks", "kill -> the time of the rank's exit record in etcd"),
        "node_loss": {**scenario(
            "node_loss", f"kill -9 of {LOST_NODE}'s daemon and workers at once -> the last "
            "'First step after recovery' line over all ranks",
            "kill -> the controller's node-failed event (lease expiry)"),
            "lease_ttl_s": cfg.ttl, "keepalive_interval_s": KEEPALIVE_INTERVAL},
        "warm_vs_cold": {
            "what": f"warm: rank {VICTIM}'s joiner in the crash scenario, 'Standby chosen' -> "
                    "its first step after recovery (waiting for the survivors included); cold: "
                    "4 standalone processes started at once from the final state, Popen -> "
                    "state saved after their first step (median of the 4)",
            "warm_chosen_to_first_step_s": summarize([w["warm_chosen_to_first_step_s"]
                                                      for w in warm]),
            "warm_chosen_to_took_over_s": summarize([w["warm_chosen_to_took_over_s"]
                                                     for w in warm]),
            "warm_chosen_to_preparing_s": summarize_some([
                w["warm_chosen_to_preparing_s"] for w in warm
                if w["warm_chosen_to_preparing_s"] is not None]),
            "cold_spawn_to_first_step_s": summarize([c["spawn_to_first_step_s"] for c in cold]),
            "cold_imports_s": summarize([c["imports_s"] for c in cold]),
            "cold_lazy_dynamo_import_s": summarize([c["lazy_dynamo_import_s"] for c in cold]),
            "cold_start_groups_build_load_s": summarize([c["start_groups_build_load_s"]
                                                         for c in cold]),
            "cold_first_step_s": summarize([c["first_step_s"] for c in cold]),
            "cold_spawn_to_exit_s": summarize([c["spawn_to_exit_s"] for c in cold]),
            "cold_over_warm": summarize([w["cold_over_warm"] for w in warm]),
            "cold_over_warm_took_over": summarize([w["cold_over_warm_took_over"] for w in warm]),
        },
    }


def print_summary(result: dict[str, Any]) -> None:
    cfg, m, s = result["config"], result["machine"], result["summary"]
    print(f"\nrecovery: TP2 x DP2 + 2 standbys, {cfg['repeats']} repeats of each scenario, "
          f"{cfg['steps']} steps, failure after {cfg['crash_at']}, lease TTL {cfg['ttl']} s; "
          f"on {m['cpus_usable']} CPUs, Python {m['python']}, etcd {m['etcd_version']}")
    print(f"worker crash: kill -9 of rank {VICTIM}'s worker; node loss: kill -9 of {LOST_NODE}'s "
          f"daemon and workers at once; each to the last rank's first step after recovery")

    table = Table(44, missing=f"{'(never recorded)':>20}", repeats=cfg["repeats"])
    row = table.row
    table.header()
    for key, title, detect in (("worker_crash", f"worker crash (rank {VICTIM})",
                                "detection (-> exit record)"),
                               ("node_loss", f"node loss ({LOST_NODE})",
                                "detection (-> node-failed, lease)")):
        x = s[key]
        row(f"{title}: end to end", x["end_to_end_s"], "s")
        row(f"  {detect}", x["detection_s"], "s")
        row("  planning (-> recovery planned)", x["planning_s"], "s")
        row("  settle (-> survivors settled)", x["settle_s"], "s")
        row("  rebuild+transfer (-> recovered)", x["rebuild_transfer_s"], "s")
        row("  first step (-> all ranks' first step)", x["first_step_s"], "s")
        row("  state transfer, donor's send", x["transfer_send_s"], "ms", 1e3)
        row("  joiner: chosen -> first step", x["joiner_chosen_to_first_step_s"], "s")
        row("  steps committed before the failure", x["steps_before_failure"], "steps")
        row("  step the job settled on", x["settled_step"], "steps")
    w = s["warm_vs_cold"]
    row(f"warm: joiner chosen -> first step (rank {VICTIM})", w["warm_chosen_to_first_step_s"],
        "s")
    row("  joiner chosen -> bound (job built)", w["warm_chosen_to_preparing_s"], "s")
    row("  joiner chosen -> took over rank", w["warm_chosen_to_took_over_s"], "s")
    row("cold: Popen -> first step committed", w["cold_spawn_to_first_step_s"], "s")
    row("  imports (all, -X importtime)", w["cold_imports_s"], "s")
    row("    of which torch._dynamo (lazy, in build)", w["cold_lazy_dynamo_import_s"], "s")
    row("  start + groups + build + load (the rest)", w["cold_start_groups_build_load_s"], "s")
    row("  first step", w["cold_first_step_s"], "s")
    row("  Popen -> exit (save, teardown included)", w["cold_spawn_to_exit_s"], "s")
    row("cold / warm (chosen -> first step)", w["cold_over_warm"], "x")
    row("cold / warm (chosen -> took over)", w["cold_over_warm_took_over"], "x")
    loads = [x for r in result["repeats"] for k in ("worker_crash", "node_loss")
             for x in r[k]["loadavg_1m_before_after"]]
    print(f"  1-minute load average during the run: {min(loads):.1f} to {max(loads):.1f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.Parser("recovery", __doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, help="repeats of each scenario, each on a fresh "
                   "cluster (default 5; smoke 1)")
    p.add_argument("--steps", type=int, help="steps of the job (default 300; smoke 150: "
                   "with 90 a loaded machine's harness can see the crash step too late, as "
                   "the job ends)")
    p.add_argument("--step-sleep", type=float, default=0.04,
                   help="seconds of stand-in work per step (default 0.04, as the e2e tests)")
    p.add_argument("--crash-at", type=int, default=LOG_EVERY,
                   help=f"fail once this many steps are committed, a multiple of {LOG_EVERY} "
                        f"(default {LOG_EVERY})")
    p.add_argument("--ttl", type=int, default=config_mod.LeaseConfig().ttl,
                   help=f"the daemons' lease TTL in seconds (default "
                        f"{config_mod.LeaseConfig().ttl}, the daemon's default)")
    p.add_argument("--smoke", action="store_true", help="a few minutes: for the tests")
    p.add_argument("--no-sandbox", action="store_true",
                   help="standbys only import the job (no recording directory): the model is "
                        "built once chosen")
    p.add_argument("--state-size", type=size_arg, metavar="SIZE",
                   help="the job's state per rank (64MiB, 1GiB, ...: examples/plain_torch/"
                        "train.py --state-size), the same for the cold start (default: the "
                        "example's own, about 27 KB)")
    p.add_argument("--shard-optimizer", action="store_true",
                   help="the job shards its Adam state over DP, each shard's redundant copy on "
                        "the next DP rank (train.py --shard-optimizer), the cold start too")
    p.interruptible()
    p.outputs(keep="keep daemon logs, etcd data and states here")
    args = p.parse(argv, {"repeats": (5, 1), "steps": (300, 150)})
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.crash_at < LOG_EVERY or args.crash_at % LOG_EVERY:
        p.error(f"--crash-at must be a positive multiple of {LOG_EVERY} (the runtime logs its "
                f"progress every {LOG_EVERY} steps), got {args.crash_at}")
    if args.steps < args.crash_at + 20:
        p.error(f"--steps must be at least --crash-at + 20 for the failure to land mid-run, "
                f"got {args.steps}")
    if args.step_sleep < 0:
        p.error("--step-sleep must be >= 0")
    if args.ttl < 3:
        p.error(f"--ttl must be at least 3: the daemon's etcd timeout (1 s) must be at most "
                f"TTL/3, got {args.ttl}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = RecoveryConfig(repeats=args.repeats, steps=args.steps, step_sleep=args.step_sleep,
                         crash_at=args.crash_at, ttl=args.ttl, smoke=args.smoke,
                         sandbox=not args.no_sandbox, state_bytes=args.state_size,
                         shard_optimizer=args.shard_optimizer, interruptible=args.interruptible)
    os.environ.update(PROCESS_ENV)  # the daemons, their workers and the cold ranks inherit it
    scratch = harness.Scratch(args.keep_dir, "understudy-bench-rec-")

    def run(i: int, base: Path) -> dict[str, Any]:
        rep = run_repeat(i, cfg, base)
        c, n, w = rep["worker_crash"], rep["node_loss"], rep["warm_vs_cold"]
        print(f"  repeat {i + 1}/{cfg.repeats}: crash recovered in {c['end_to_end_s']:.2f}s "
              f"(settled on step {c['settled_step']}), node loss in "
              f"{n['end_to_end_s']:.2f}s; warm {w['warm_chosen_to_first_step_s']:.2f}s vs "
              f"cold {w['cold_spawn_to_first_step_s']:.2f}s; "
              f"{c['wall_s'] + n['wall_s']:.0f}s, load "
              f"{n['loadavg_1m_before_after'][1]:.1f}", file=sys.stderr, flush=True)
        return rep

    # Each scenario stops its cluster.
    repeats = scratch.repeats("recovery benchmark", cfg.repeats, run,
                              (OSError, UnderstudyError, psutil.Error))
    if isinstance(repeats, int):
        return repeats

    result = {
        **harness.header("recovery", scratch.started),
        "config": {**asdict(cfg), "tp": TP, "dp": WORLD // TP, "standby": 2,
                   "job": "examples/plain_torch/train.py", "threads_per_process": 1,
                   "victim_rank": VICTIM, "lost_node": LOST_NODE,
                   "keepalive_interval_s": KEEPALIVE_INTERVAL},
        "summary": collect(repeats, cfg),
        "repeats": repeats,
    }
    harness.report(result, args.out, print_summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
