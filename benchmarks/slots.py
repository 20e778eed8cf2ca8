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

With ``--sharded``, both shard the optimizer state: ``--slots DP --shard-optimizer``
(``SlottedShardedJob``: cut by slot, a copy of the previous replica's slots, the canonical sum,
the slot-state census and the parameters' all-gather each step) against ``--shard-optimizer``
(``ShardedJob``: ZeRO-1 by DP rank, its own reduce-scatter, the buddy copy's gradient sent to
the next rank), both keeping a redundant copy of every shard.

    .venv/bin/python benchmarks/slots.py [--state-size 256MiB] [--dp 2] [--repeats 3]
                                         [--steps 14] [--warmup 4] [--sharded] [--smoke]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import harness

#: Design target (issue 16, item 1): the canonical sum's cost, at the real-sized-state sizes.
TARGET_OVERHEAD = 0.03


def measure(cfg: dict[str, Any], base: Path, sharded: bool = False) -> list[dict[str, Any]]:
    shard = ("--shard-optimizer",) if sharded else ()
    variants = {"slots": ("--slots", str(cfg["dp"]), *shard), "all-reduce": shard}
    own = "ShardedJob's reduce-scatter" if sharded else "the job's all-reduce"

    def run(directory: Path, variant: str, job_args: tuple[str, ...]) -> dict[str, Any]:
        return harness.standalone_step(directory, variant, cfg, cfg["dp"],
                                       ("--tp", "1", *job_args))

    def says(i: int, runs: dict[str, Any]) -> str:
        return (f"  repeat {i}: step {runs['all-reduce']['step_s']:.3f} s with {own}, "
                f"{runs['slots']['step_s']:.3f} s with slots: "
                f"{100 * runs['overhead']:+.1f} %")

    return harness.alternating(cfg["repeats"], base, variants, run, "slots", "all-reduce",
                               says)


def print_summary(result: dict[str, Any]) -> None:
    rows = ((("step, ShardedJob (by DP rank)", "all-reduce"),
             ("step, slots, sharded by slot", "slots")) if result["config"]["sharded"] else
            (("step, the job's all-reduce", "all-reduce"),
             ("step, slots (canonical sum)", "slots")))
    harness.overhead_summary(result, rows,
                             "overhead of the slots",
                             f"<= {100 * TARGET_OVERHEAD:.0f} % of the step")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.overhead_parser("slots", __doc__.splitlines()[0],
                                "data-parallel ranks, one slot each (default 2)")
    p.add_argument("--sharded", action="store_true",
                   help="both variants shard the optimizer state (see above)")
    return harness.overhead_args(p, argv, "a sum needs peers")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return harness.overhead_run(args, "slots", "slots", ("slots", "all-reduce"),
                                lambda cfg, base: measure(cfg, base, args.sharded),
                                {"target_overhead": TARGET_OVERHEAD, "sharded": args.sharded},
                                print_summary)


if __name__ == "__main__":
    sys.exit(main())
