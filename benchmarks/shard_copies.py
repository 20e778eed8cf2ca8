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
import sys
from pathlib import Path
from typing import Any

import harness

VARIANTS = {"copies": ("--shard-optimizer",),
            "no copies": ("--shard-optimizer", "--no-shard-copy")}
#: Design target (/work/shared/design.md, "Targets"): the copies' cost at 256 MiB per rank.
TARGET_OVERHEAD = 0.03


def measure(cfg: dict[str, Any], base: Path) -> list[dict[str, Any]]:
    def run(directory: Path, variant: str, job_args: tuple[str, ...]) -> dict[str, Any]:
        return harness.standalone_step(directory, variant, cfg, cfg["dp"], ("--tp", "1",
                                                                            *job_args))

    def says(i: int, runs: dict[str, Any]) -> str:
        return (f"  repeat {i}: step {runs['no copies']['step_s']:.3f} s without copies, "
                f"{runs['copies']['step_s']:.3f} s with: {100 * runs['overhead']:+.1f} %")

    return harness.alternating(cfg["repeats"], base, VARIANTS, run, "copies", "no copies", says)


def memory(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """Each rank's peak RSS (from the kernel at its reap) with and without copies: a rank with
    copies holds its buddy's shard beside its own (fp32 values, their gradient and both Adam
    moments)."""
    rss = {v: harness.summarize([m for r in repeats for m in r[v]["peak_rss_mib"]])
           for v in VARIANTS}
    return {"peak_rss_mib": rss,
            "copy_rss_mib": rss["copies"]["median"] - rss["no copies"]["median"]}


def print_summary(result: dict[str, Any]) -> None:
    harness.overhead_summary(result, (("step, no copies (plain ZeRO-1)", "no copies"),
                                      ("step, with copies", "copies")),
                             "overhead of the copies",
                             f"<= {100 * TARGET_OVERHEAD:.0f} % at 256 MiB per rank")
    rss = result["summary"]["peak_rss_mib"]
    print(f"  peak RSS per rank, median: {rss['no copies']['median']:.0f} MiB without copies, "
          f"{rss['copies']['median']:.0f} MiB with: the copy holds "
          f"{result['summary']['copy_rss_mib']:+.0f} MiB")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.overhead_parser("shard_copies", __doc__.splitlines()[0],
                                "data-parallel ranks (default 2)")
    return harness.overhead_args(p, argv, "a copy lives on another DP rank")


def main(argv: list[str] | None = None) -> int:
    return harness.overhead_run(parse_args(argv), "shard_copies", "shard copies",
                                ("copies", "no copies"), measure,
                                {"variants": VARIANTS, "target_overhead": TARGET_OVERHEAD},
                                print_summary, memory)


if __name__ == "__main__":
    sys.exit(main())
