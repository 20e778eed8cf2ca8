"""Steady-state overhead benchmark: the job's step time under understudy against torchrun.

One command, real processes. N times, in turn (so that a change in the machine's load hits
every system alike), the plain-PyTorch example's job (``examples/plain_torch/train.py``: same
model, seed, data, TP=2 x DP=2 on gloo) runs ``--steps`` steps, uninterrupted, under:

- **understudy**: ``understudy run`` on a fresh local cluster (embedded etcd, ``node-a`` and
  ``node-b`` with two slots each, no standby: standbys live on other nodes, and here they would
  only take CPU from the job). What it pays each step: the vote (one 3-element all-reduce over
  the world), waits that poll for an abort, the boundary hook asking the daemon about
  migrations; and the daemons run beside it.
- **torchrun**: two torchrun elastic agents of two workers each (``benchmarks/baseline/``), no
  checkpoint: a plain loop of reseed, compute, apply.
- **torchrun+dcp**: the same with the downtime benchmark's baseline: a
  ``torch.distributed.checkpoint`` save every ``--ckpt-every`` steps (``--ckpt-mode``) and the
  drain handler (one rendezvous-store lookup a step).

Each rank logs a line per committed step (``--step-log``); the job's step times are the gaps
between consecutive job-level completions (every rank committed the step), the first
``--warmup`` steps left out (``benchmarks/steplog.py``). Per run: the **median** step (a typical
step) and the **mean** (the window over its steps, checkpoints included). Overhead = understudy /
torchrun - 1, on the medians and on the means; the checkpoint cadence's cost = torchrun+dcp's
mean against torchrun's.

Under understudy the runtime's own per-step timings (``--save``) also say where the step goes:
boundary (the migration hook), compute, vote, apply.

Prints a summary and writes JSON with the machine, the command, the configuration and every
sample. Every process it starts is stopped on exit, Ctrl-C and SIGTERM included.

    .venv/bin/python benchmarks/overhead.py [--repeats N] [--steps S] [--smoke] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import harness
import psutil
import steplog
from baseline.elastic import ElasticRun, TorchrunConfig, TorchrunError
from harness import PROCESS_ENV, TRAIN, BenchmarkError, Table, read_records, summarize

from understudy.common.errors import UnderstudyError

SYSTEMS = ("understudy", "torchrun", "torchrun+dcp")
JOB = "overhead"
WORLD, TP = 4, 2
ACTIVE = ("node-a", "node-b")
#: Design target (/work/shared/design.md, "Targets"): against torchrun without checkpoints.
TARGET_OVERHEAD = 0.02


@dataclass(frozen=True)
class BenchConfig:
    repeats: int
    steps: int
    step_sleep: float
    warmup: int
    ckpt_every: int
    ckpt_mode: str
    smoke: bool


def run_understudy(cfg: BenchConfig, base: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    with harness.local_cluster(base) as (_, cluster):
        for n in ACTIVE:
            cluster.add(n, "active", extra=["--slots", "2"])
        for n in ACTIVE:
            cluster.wait_state(n, "active", timeout=60)
        cluster.wait_for("a controller", lambda s: s.controller is not None, timeout=60)
        env = [f"--env={k}={v}" for k, v in PROCESS_ENV.items()]
        run = cluster.cli("run", "--job", JOB, "--tp", str(TP), "--dp", str(WORLD // TP), *env,
                          "--", sys.executable, str(TRAIN), "--steps", str(cfg.steps),
                          "--step-sleep", str(cfg.step_sleep), "--step-log", str(base / "steps"),
                          "--save", str(base / "out"), *harness.example_options(cfg.smoke))
        if run.returncode != 0:
            raise BenchmarkError(f"understudy run failed: {run.stderr.strip()}")
        harness.wait_done(cluster, JOB, timeout=900)
        tracebacks = sum(harness.tracebacks(cluster).values())
    return {"wall_s": time.monotonic() - t0, "records": read_records(base / "steps"),
            "runtime_split_s": runtime_split(base / "out", cfg.warmup),
            "daemon_log_tracebacks": tracebacks}


def runtime_split(out: Path, warmup: int) -> dict[str, float]:
    """Where an understudy step goes, from the runtime's own per-step timings (``--save``):
    per part (boundary: the migration hook; compute; vote; apply), the median over the steady
    steps of each rank, then the median over the ranks.

    Raises:
        BenchmarkError: a rank saved no timings.
    """
    parts = ("boundary", "compute", "vote", "apply")
    per_rank: dict[str, list[float]] = {k: [] for k in parts}
    for r in range(WORLD):
        try:
            timings = json.loads((out / f"rank{r}.json").read_text())["timings"]
        except (OSError, json.JSONDecodeError, KeyError) as exc:
            raise BenchmarkError(f"rank {r} saved no timings: {exc}") from exc
        steady = [t for t in timings if t["committed"] and t["step"] >= warmup]
        for k in parts:
            per_rank[k].append(statistics.median(t[k] for t in steady))
    return {k: statistics.median(v) for k, v in per_rank.items()}


def run_torchrun(cfg: BenchConfig, base: Path, checkpoints: bool) -> dict[str, Any]:
    tcfg = TorchrunConfig(steps=cfg.steps, step_sleep=cfg.step_sleep,
                          ckpt_every=cfg.ckpt_every if checkpoints else 0,
                          ckpt_mode=cfg.ckpt_mode, drain_notice=checkpoints, max_restarts=0)
    run = ElasticRun(tcfg, base)
    t0 = time.monotonic()
    try:
        run.start()
        codes = run.wait_finished(timeout=900, fail_fast=True)
    except TorchrunError as exc:
        raise BenchmarkError(f"torchrun: {exc}\n{run.agent_log_tail()}") from exc
    finally:
        run.stop()
    if any(c != 0 for c in codes.values()):
        raise BenchmarkError(f"torchrun agents failed: {codes} (logs in {base})")
    records = run.records()
    saves = [r["save_s"] for r in records if r.get("kind") == "saved"]
    return {"wall_s": time.monotonic() - t0, "records": records,
            "checkpoint_save_s": summarize(saves) if saves else None,
            "checkpoints": len({r["step"] for r in records if r.get("kind") == "saved"})}


def measure(system: str, cfg: BenchConfig, base: Path) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    if system == "understudy":
        res = run_understudy(cfg, base)
    else:
        res = run_torchrun(cfg, base, checkpoints=system == "torchrun+dcp")
    done = steplog.completions(res.pop("records"), WORLD)
    if not done or done[-1].step != cfg.steps - 1:
        raise BenchmarkError(f"{system}: the job did not complete step {cfg.steps - 1}")
    steps = steplog.steady_steps(done, cfg.warmup)
    return {"system": system, **steps, **res,
            "loadavg_1m_before_after": [load_before, os.getloadavg()[0]]}


def run_repeat(i: int, cfg: BenchConfig, base: Path) -> dict[str, Any]:
    rep: dict[str, Any] = {"repeat": i}
    # A different order each repeat: no system always runs right after the same one.
    order = SYSTEMS[i % len(SYSTEMS):] + SYSTEMS[:i % len(SYSTEMS)]
    for system in order:
        r = rep[system] = measure(system, cfg, base / system.replace("+", "-"))
        print(f"  repeat {i + 1}/{cfg.repeats} {system}: median step {r['median_s'] * 1e3:.2f} "
              f"ms, mean {r['mean_s'] * 1e3:.2f} ms over {r['steps']} steps; {r['wall_s']:.0f}s, "
              f"load {r['loadavg_1m_before_after'][1]:.1f}", file=sys.stderr, flush=True)
    return rep


def collect(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    per = {s: {k: summarize([r[s][k] for r in repeats]) for k in ("median_s", "mean_s", "p90_s")}
           for s in SYSTEMS}

    def overhead(system: str, base: str, key: str) -> dict[str, Any]:
        # Per repeat (the runs next to each other), and of the medians over repeats.
        return {"per_repeat": summarize([r[system][key] / r[base][key] - 1 for r in repeats]),
                "of_medians": per[system][key]["median"] / per[base][key]["median"] - 1}

    saves = [x for r in repeats if r["torchrun+dcp"]["checkpoint_save_s"] is not None
             for x in [r["torchrun+dcp"]["checkpoint_save_s"]["median"]]]
    return {
        "step_s": per,
        "understudy_over_torchrun": {"median_step": overhead("understudy", "torchrun",
                                                             "median_s"),
                                     "mean_step": overhead("understudy", "torchrun", "mean_s"),
                                     "target": TARGET_OVERHEAD},
        "understudy_over_torchrun_dcp": {"median_step": overhead("understudy", "torchrun+dcp",
                                                                 "median_s"),
                                         "mean_step": overhead("understudy", "torchrun+dcp",
                                                               "mean_s")},
        "dcp_cadence_over_torchrun": {"mean_step": overhead("torchrun+dcp", "torchrun",
                                                            "mean_s")},
        "checkpoint_save_s": summarize(saves) if saves else None,
        "understudy_runtime_split_s": {k: summarize([r["understudy"]["runtime_split_s"][k]
                                                     for r in repeats])
                                       for k in repeats[0]["understudy"]["runtime_split_s"]},
    }


def print_summary(result: dict[str, Any]) -> None:
    cfg, m, s = result["config"], result["machine"], result["summary"]
    print(f"\noverhead: TP2 x DP2 plain job, {cfg['repeats']} run(s) of {cfg['steps']} steps per "
          f"system (first {cfg['warmup']} left out), step sleep {cfg['step_sleep']} s; "
          f"torchrun+dcp saves every {cfg['ckpt_every']} steps ({cfg['ckpt_mode']}); on "
          f"{m['cpus_usable']} CPUs, torch {m['torch']}")

    table = Table(44)
    row = table.row
    table.header()
    for system in SYSTEMS:
        row(f"{system}: median step", s["step_s"][system]["median_s"], "ms", 1e3)
        row(f"{system}: mean step", s["step_s"][system]["mean_s"], "ms", 1e3)
    for key, label in (("understudy_over_torchrun", "understudy vs torchrun"),
                       ("understudy_over_torchrun_dcp", "understudy vs torchrun+dcp")):
        for k in ("median_step", "mean_step"):
            row(f"{label}, {k.replace('_', ' ')}", s[key][k]["per_repeat"], "%", 100)
    row("torchrun+dcp vs torchrun, mean step", s["dcp_cadence_over_torchrun"]["mean_step"][
        "per_repeat"], "%", 100)
    row("one DCP save (median per run)", s["checkpoint_save_s"], "ms", 1e3)
    for k, v in s["understudy_runtime_split_s"].items():
        row(f"understudy step, runtime's {k} (median)", v, "ms", 1e3)
    o = s["understudy_over_torchrun"]["median_step"]["per_repeat"]["median"]
    print(f"  target: understudy <= {TARGET_OVERHEAD * 100:.0f} % over torchrun without "
          f"checkpoints; median of the per-run overheads {o * 100:+.2f} %")
    loads = [x for r in result["repeats"] for sy in SYSTEMS
             for x in r[sy]["loadavg_1m_before_after"]]
    print(f"  1-minute load average during the run: {min(loads):.1f} to {max(loads):.1f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.Parser("overhead", __doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, help="runs per system (default 5; smoke 1)")
    p.add_argument("--steps", type=int, help="steps per run (default 600; smoke 30)")
    p.add_argument("--step-sleep", type=float, default=0.04,
                   help="seconds of stand-in work per step (default 0.04, as the other "
                        "benchmarks)")
    p.add_argument("--warmup", type=int, help="first steps left out (default 20; smoke 5)")
    p.add_argument("--ckpt-every", type=int,
                   help="torchrun+dcp's checkpoint cadence in steps (default 20, as "
                        "benchmarks/downtime.py; smoke 10)")
    p.add_argument("--ckpt-mode", choices=("sync", "async"), default="sync")
    p.add_argument("--smoke", action="store_true", help="one short run each: for the tests")
    p.outputs(keep="keep logs and step lines here")
    args = p.parse(argv, {"repeats": (5, 1), "steps": (600, 30), "warmup": (20, 5),
                          "ckpt_every": (20, 10)})
    if args.repeats < 1 or args.ckpt_every < 1 or args.warmup < 1:
        p.error("--repeats, --ckpt-every and --warmup must be at least 1")
    if args.steps < args.warmup + 2 * args.ckpt_every:
        p.error(f"--steps must be at least --warmup + 2 x --ckpt-every, got {args.steps}")
    if args.step_sleep < 0:
        p.error("--step-sleep must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = BenchConfig(repeats=args.repeats, steps=args.steps, step_sleep=args.step_sleep,
                      warmup=args.warmup, ckpt_every=args.ckpt_every, ckpt_mode=args.ckpt_mode,
                      smoke=args.smoke)
    os.environ.update(PROCESS_ENV)  # every process it starts inherits it
    scratch = harness.Scratch(args.keep_dir, "understudy-bench-ovh-")
    repeats = scratch.repeats("overhead benchmark", cfg.repeats,
                              lambda i, d: run_repeat(i, cfg, d),
                              (OSError, UnderstudyError, ValueError, psutil.Error))
    if isinstance(repeats, int):
        return repeats

    result = {
        **harness.header("overhead", scratch.started, torch=True),
        "config": {**asdict(cfg), "tp": TP, "dp": WORLD // TP, "understudy_standby": 0,
                   "job": "examples/plain_torch/train.py", "threads_per_process": 1,
                   "torchrun": {"agents": 2, "workers_per_agent": 2, "rdzv_backend": "c10d",
                                "dcp_variant_drain_notice": True},
                   "step_time": "gap between consecutive job-level completions (every rank "
                                "committed the step)"},
        "summary": collect(repeats),
        "repeats": repeats,
    }
    harness.report(result, args.out, print_summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
