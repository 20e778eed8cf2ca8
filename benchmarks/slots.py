"""What data-parallel slots cost: step time with the runtime's canonical sum against the job's
own all-reduce.

The example job with ``--slots DP`` (``SlottedPlainJob``: one slot per replica, the slots'
gradients summed in slot order by an all-to-all of chunks and an all-gather, point to point:
``understudy.worker.slots``) against the same job without (its own gloo all-reduce of the
gradients, whose order of additions depends on the ring), side by side in one command. Each
repeat runs both, in an order that alternates from repeat to repeat, as standalone processes
(TP 1 x DP ``--dp``, no daemons). A run's step time is the median of rank 0's intervals
between committed steps, the first ``--warmup`` left out; the overhead is taken per repeat,
``slots / all-reduce - 1``, and summarised over the repeats, with the pooled overhead of
every interval beside it.

    .venv/bin/python benchmarks/slots.py [--state-size 256MiB] [--dp 2] [--repeats 3]
                                         [--steps 14] [--warmup 4] [--smoke]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import harness

#: Design target (issue 16, item 1): the canonical sum's cost, at the real-sized-state sizes.
TARGET_OVERHEAD = 0.03


def measure(cfg: dict[str, Any], base: Path) -> list[dict[str, Any]]:
    variants = {"slots": ("--slots", str(cfg["dp"])), "all-reduce": ()}

    def run(directory: Path, variant: str, job_args: tuple[str, ...]) -> dict[str, Any]:
        return harness.standalone_step(directory, variant, cfg, cfg["dp"],
                                       ("--tp", "1", *job_args))

    def says(i: int, runs: dict[str, Any]) -> str:
        return (f"  repeat {i}: step {runs['all-reduce']['step_s']:.3f} s with the job's "
                f"all-reduce, {runs['slots']['step_s']:.3f} s with slots: "
                f"{100 * runs['overhead']:+.1f} %")

    return harness.alternating(cfg["repeats"], base, variants, run, "slots", "all-reduce",
                               says)


def print_summary(result: dict[str, Any]) -> None:
    harness.overhead_summary(result, (("step, the job's all-reduce", "all-reduce"),
                                      ("step, slots (canonical sum)", "slots")),
                             "overhead of the slots",
                             f"<= {100 * TARGET_OVERHEAD:.0f} % of the step")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.overhead_parser("slots", __doc__.splitlines()[0],
                                "data-parallel ranks, one slot each (default 2)")
    return harness.overhead_args(p, argv, "a sum needs peers")


def main(argv: list[str] | None = None) -> int:
    return harness.overhead_run(parse_args(argv), "slots", "slots", ("slots", "all-reduce"),
                                measure, {"target_overhead": TARGET_OVERHEAD}, print_summary)


if __name__ == "__main__":
    sys.exit(main())
