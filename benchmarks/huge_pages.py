"""What torch's CPU allocator on huge pages changes: step time, and how soon a killed rank is gone.

understudy's daemon starts its workers with ``THP_MEM_ALLOC_ENABLE=1`` (``daemon/jobs.py``,
``huge_pages``) unless the job or the daemon's environment sets it: torch then places each
allocation of 2 MiB or more on transparent huge pages (where the kernel's
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``). This measures it
against ``THP_MEM_ALLOC_ENABLE=0``, side by side in one command, the order alternating from
repeat to repeat:

- **step**: the plain example as standalone processes (TP 1 x DP ``--dp``, no daemons), rank
  0's median interval between committed steps, the first ``--warmup`` left out;
- **gone after a kill**: one more process of the example (world size 1, the same state) is
  killed with SIGKILL once it committed its second step, and the time from the kill to its reap
  is taken (``wait4``). The kernel frees a process's memory before it closes its files, so
  that is also when its peers' sockets reset and when a daemon can see the exit: the start of a
  crash's detection.

Each run's peak resident memory is taken too (``wait4``'s ``ru_maxrss`` of each process).

``--state-size`` is the replicated job's state per rank (parameters and both Adam moments).

    .venv/bin/python benchmarks/huge_pages.py [--state-size 256MiB] [--dp 2] [--repeats 3]
                                              [--steps 14] [--warmup 4] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import harness
from harness import PROCESS_ENV, TRAIN, BenchmarkError, read_records, summarize, wait

from understudy.common.env import THP_MEM_ALLOC_ENABLE as THP

VARIANTS = {"huge pages": {THP: "1"}, "4 KiB pages": {THP: "0"}}


def gone_after_kill(base: Path, cfg: dict[str, Any], env: dict[str, str]) -> dict[str, float]:
    """A one-rank run of the example killed with SIGKILL once it committed its second step:
    seconds from the kill to its reap (``gone_after_kill_s``), and its peak resident memory
    (``peak_rss_mib``)."""
    base.mkdir(parents=True, exist_ok=True)
    steps = base / "steps"
    with open(base / "rank0.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, str(TRAIN), "--rank", "0", "--world-size", "1",
             "--store", str(base / "store"), "--steps", "1000",
             "--state-size", str(cfg["state_size"]), "--step-log", str(steps),
             *harness.example_options(cfg["smoke"])],
            env={**os.environ, **PROCESS_ENV, **env}, stdout=subprocess.DEVNULL, stderr=log)
    try:
        def committed() -> bool:
            if proc.poll() is not None:
                raise BenchmarkError(f"the one-rank run exited {proc.returncode}: "
                                     f"{(base / 'rank0.log').read_text(errors='replace')[-1500:]}")
            return steps.exists() and sum(1 for r in read_records(steps)
                                          if r.get("kind", "step") == "step") >= 2
        wait("the one-rank run's second step", committed, cfg["timeout"], interval=0.05)
        at = time.perf_counter()
        os.kill(proc.pid, signal.SIGKILL)
        _, peak = harness.reap(proc)
        return {"gone_after_kill_s": time.perf_counter() - at, "peak_rss_mib": peak / harness.MIB}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def measure(cfg: dict[str, Any], base: Path) -> list[dict[str, Any]]:
    def run(directory: Path, variant: str, env: dict[str, str]) -> dict[str, Any]:
        out = harness.standalone_step(directory, variant, cfg, cfg["dp"], ("--tp", "1"), env)
        killed = gone_after_kill(directory / "killed", cfg, env)
        out["gone_after_kill_s"] = killed["gone_after_kill_s"]
        out["killed_peak_rss_mib"] = killed["peak_rss_mib"]
        return out

    def says(i: int, runs: dict[str, Any]) -> str:
        on, off = runs["huge pages"], runs["4 KiB pages"]
        return (f"  repeat {i}: step {off['step_s']:.3f} s on 4 KiB pages, {on['step_s']:.3f} s "
                f"on huge pages ({100 * runs['overhead']:+.1f} %); a killed rank gone in "
                f"{off['gone_after_kill_s']:.3f} s against {on['gone_after_kill_s']:.3f} s")

    return harness.alternating(cfg["repeats"], base, VARIANTS, run, "huge pages",
                               "4 KiB pages", says)


def print_summary(result: dict[str, Any]) -> None:
    harness.overhead_summary(result, (("step, 4 KiB pages", "4 KiB pages"),
                                      ("step, huge pages", "huge pages")),
                             "step on huge pages against 4 KiB", "none: a measurement")
    table = harness.Table(label_width=34, repeats=result["config"]["repeats"])
    table.header("a killed one-rank run, kill -> reap")
    for label, key in (("4 KiB pages", "gone_4k"), ("huge pages", "gone_huge")):
        table.row(label, result["summary"][key], "s", fmt=".3f")
    table.header("rank 0's peak RSS in the step's run")
    for label, key in (("4 KiB pages", "rss_4k"), ("huge pages", "rss_huge")):
        table.row(label, result["summary"][key], "MiB", fmt=".0f")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.overhead_parser("huge_pages", __doc__.splitlines()[0],
                                "data-parallel ranks of the step's run (default 2)")
    return harness.overhead_args(p, argv, "the step's all-reduce of gradients")


def gone(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """The kill -> reap figures, and the peak RSS of rank 0 of the step's run, per variant."""
    out = {}
    for tag, variant in (("4k", "4 KiB pages"), ("huge", "huge pages")):
        out[f"gone_{tag}"] = summarize([r[variant]["gone_after_kill_s"] for r in repeats])
        out[f"rss_{tag}"] = summarize([r[variant]["peak_rss_mib"][0] for r in repeats])
    return out


def main(argv: list[str] | None = None) -> int:
    return harness.overhead_run(parse_args(argv), "huge_pages", "huge pages",
                                ("huge pages", "4 KiB pages"), measure, {"variants": VARIANTS},
                                print_summary, gone)


if __name__ == "__main__":
    sys.exit(main())
