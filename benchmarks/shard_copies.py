"""What the sharded optimizer's redundant copies cost: step time with and without them.

The example job with ``--shard-optimizer`` (``ShardedJob``: ZeRO-1 over DP, each rank owning a
shard of the Adam state) against the same job with ``--no-shard-copy`` (plain ZeRO-1, no copy:
a lost shard is gone), side by side in one command. Each repeat runs both, in an order that
alternates from repeat to repeat, as standalone processes (TP 1 x DP ``--dp``, no daemons: the
copies' cost is the job's own work: a point-to-point send of ``1/dp`` of the gradients and one
more Adam over ``1/dp`` of the parameters per step). A run's step time is the median of rank
0's intervals between committed steps (its step log), the first ``--warmup`` left out; the
overhead is taken per repeat, ``with / without - 1``, and summarised over the repeats; the
pooled overhead compares the medians of every interval of every repeat of each variant (less
sensitive to one repeat's noise on a shared machine).

``--state-size`` sizes the model as the replicated job's state per rank (parameters and both
Adam moments, 12 bytes a parameter): at DP 2 each rank owns half of the Adam state, and holds
its buddy's half beside it with copies.

    .venv/bin/python benchmarks/shard_copies.py [--state-size 256MiB] [--dp 2] [--repeats 3]
                                                [--steps 14] [--warmup 4] [--smoke]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import harness
from harness import ONE_THREAD, TRAIN, BenchmarkError, Table, summarize

from understudy.common.errors import UnderstudyError
from understudy.common.sizes import size_arg

VARIANTS = {"copies": ("--shard-optimizer",),
            "no copies": ("--shard-optimizer", "--no-shard-copy")}
#: Design target (/work/shared/design.md, "Targets"): the copies' cost at 256 MiB per rank.
TARGET_OVERHEAD = 0.03


def run_job(base: Path, variant: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """One standalone run of ``variant``; rank 0's median step time and the samples."""
    base.mkdir(parents=True, exist_ok=True)
    steps = base / "steps"
    procs = []
    for rank in range(cfg["dp"]):
        with open(base / f"rank{rank}.log", "wb") as log:
            procs.append(subprocess.Popen(
                [sys.executable, str(TRAIN), "--rank", str(rank), "--world-size", str(cfg["dp"]),
                 "--tp", "1", "--store", str(base / "store"), "--steps", str(cfg["steps"]),
                 "--state-size", str(cfg["state_size"]), "--step-log", str(steps),
                 *VARIANTS[variant]],
                env={**os.environ, **ONE_THREAD}, stdout=subprocess.DEVNULL, stderr=log))
    codes = [p.wait(timeout=cfg["timeout"]) for p in procs]
    if any(codes):
        tail = (base / "rank0.log").read_text(errors="replace")[-1500:]
        raise BenchmarkError(f"{variant}: the job exited {codes}: {tail}")
    times = sorted(r["t"] for r in harness.read_records(steps)
                   if r.get("rank") == 0 and r.get("kind", "step") == "step")
    intervals = [b - a for a, b in itertools.pairwise(times)][cfg["warmup"]:]
    if not intervals:
        raise BenchmarkError(f"{variant}: too few steps logged ({len(times)})")
    return {"step_s": statistics.median(intervals), "intervals": intervals}


def measure(cfg: dict[str, Any], base: Path) -> list[dict[str, Any]]:
    out = []
    for i in range(cfg["repeats"]):
        order = list(VARIANTS) if i % 2 == 0 else list(reversed(VARIANTS))
        runs = {v: run_job(base / f"repeat{i}" / v.replace(" ", "-"), v, cfg) for v in order}
        runs["overhead"] = runs["copies"]["step_s"] / runs["no copies"]["step_s"] - 1
        print(f"  repeat {i}: step {runs['no copies']['step_s']:.3f} s without copies, "
              f"{runs['copies']['step_s']:.3f} s with: {100 * runs['overhead']:+.1f} %",
              flush=True)
        out.append({"order": order, **runs})
    return out


def pooled(repeats: list[dict[str, Any]]) -> float:
    """``with / without - 1`` of the medians of all intervals of each variant."""
    def median(variant: str) -> float:
        return statistics.median(i for r in repeats for i in r[variant]["intervals"])
    return median("copies") / median("no copies") - 1


def print_summary(result: dict[str, Any]) -> None:
    s, cfg = result["summary"], result["config"]
    table = Table(label_width=34, repeats=cfg["repeats"])
    table.header(f"state {cfg['state_size']} B/rank, DP {cfg['dp']}")
    table.row("step, no copies (plain ZeRO-1)", s["no copies"], "s")
    table.row("step, with copies", s["copies"], "s")
    table.row("overhead of the copies", s["overhead"], "%", scale=100, fmt=".1f")
    print(f"  pooled (medians of every interval): {100 * s['pooled_overhead']:+.1f} %")
    print(f"  target: <= {100 * TARGET_OVERHEAD:.0f} % at 256 MiB per rank")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.Parser("shard_copies", __doc__.splitlines()[0])
    p.add_argument("--state-size", type=size_arg, help="state per rank, replicated-equivalent "
                   "(default 256MiB; smoke 1MiB)")
    p.add_argument("--dp", type=int, default=2, help="data-parallel ranks (default 2)")
    p.add_argument("--repeats", type=int, help="runs of each variant (default 3; smoke 1)")
    p.add_argument("--steps", type=int, help="steps per run (default 14; smoke 6)")
    p.add_argument("--warmup", type=int, help="first step intervals left out (default 4; "
                   "smoke 1)")
    p.add_argument("--smoke", action="store_true", help="seconds, not minutes: for the tests")
    p.outputs(keep="keep the runs' logs and step logs here")
    args = p.parse(argv, {"state_size": (256 << 20, 1 << 20), "repeats": (3, 1),
                          "steps": (14, 6), "warmup": (4, 1)})
    if args.dp < 2 or args.repeats < 1 or args.warmup < 0 or args.steps < args.warmup + 2:
        p.error("--dp >= 2 (a copy lives on another DP rank), --repeats >= 1, --warmup >= 0 "
                "and --steps >= --warmup + 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = {"state_size": args.state_size, "dp": args.dp, "repeats": args.repeats,
           "steps": args.steps, "warmup": args.warmup, "smoke": args.smoke,
           "timeout": 120 if args.smoke else 1800}
    scratch = harness.Scratch(args.keep_dir, "understudy-bench-shard-")
    repeats = scratch.run("shard copies benchmark", (OSError, UnderstudyError,
                                                     subprocess.TimeoutExpired),
                          lambda: measure(cfg, scratch.base))
    if isinstance(repeats, int):
        return repeats
    result = {
        **harness.header("shard_copies", scratch.started, torch=True),
        "config": {**cfg, "tp": 1, "threads_per_process": 1, "variants": VARIANTS,
                   "target_overhead": TARGET_OVERHEAD},
        "summary": {"copies": summarize([r["copies"]["step_s"] for r in repeats]),
                    "no copies": summarize([r["no copies"]["step_s"] for r in repeats]),
                    "overhead": summarize([r["overhead"] for r in repeats]),
                    "pooled_overhead": pooled(repeats)},
        "repeats": repeats,
    }
    harness.report(result, args.out, print_summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
