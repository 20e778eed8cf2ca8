"""What interruptible compute costs a step that is not interrupted.

A job that sets ``interruptible = True`` (the plain example does) computes inside
``torch.autograd.graph.saved_tensors_hooks`` whose hooks run at every tensor autograd saves
(forward) and unpacks (backward): a call from autograd into Python, and a look at the clock
(``worker/interrupt.py``). This times a forward and backward with the hooks and without, side by
side in one process, the order alternating from repeat to repeat, on three models: a stack of
``Linear``, ``LayerNorm``, GELU and dropout, from one whose operations are tiny (the cost per
call is all there is to see) to one whose operations take milliseconds. One thread (the
workers' setting on two cores). Per repeat, each variant runs ``--iters`` steps after
``--warmup``; the figures are per step.

    .venv/bin/python benchmarks/interrupt_cost.py [--repeats 7] [--iters 200] [--smoke]
"""

from __future__ import annotations

import sys
import time
from datetime import UTC, datetime
from typing import Any

import harness
import torch
from harness import Parser, Table, summarize

from understudy.worker.interrupt import interruptible

#: (width, layers, batch): tiny operations, the example's 64 MiB-ish ones, large ones
MODELS = ((32, 4, 8), (256, 16, 64), (1024, 8, 256))


def _model(width: int, layers: int) -> torch.nn.Module:
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.GELU(),
                 torch.nn.Dropout(0.1)]
    return torch.nn.Sequential(*mods)


def measure(width: int, layers: int, batch: int, repeats: int, iters: int,
            warmup: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model, x = _model(width, layers), torch.randn(batch, width)
    calls = 0

    def step(hooks: bool) -> None:
        nonlocal calls
        if hooks:
            with interruptible(lambda: False) as wire:
                model(x).square().mean().backward()
            calls = wire.calls
        else:
            model(x).square().mean().backward()

    def timed(hooks: bool) -> float:
        t0 = time.perf_counter()
        for _ in range(iters):
            step(hooks)
        return (time.perf_counter() - t0) / iters

    for _ in range(warmup):
        step(False)
        step(True)
    off, on = [], []
    for r in range(repeats):
        for hooks in ((True, False) if r % 2 else (False, True)):
            (on if hooks else off).append(timed(hooks))
    return {"width": width, "layers": layers, "batch": batch, "hook_calls_per_step": calls,
            "step_s": {"off": summarize(off), "on": summarize(on)},
            "extra_per_step_s": summarize([b - a for a, b in zip(off, on, strict=True)]),
            "extra_fraction": summarize([b / a - 1 for a, b in zip(off, on, strict=True)]),
            "per_call_s": summarize([(b - a) / calls for a, b in zip(off, on, strict=True)])}


def print_summary(result: dict[str, Any]) -> None:
    cfg = result["config"]
    print(f"\ninterrupt cost: forward + backward with the hooks and without, {cfg['repeats']} "
          f"repeats of {cfg['iters']} steps each, one thread, torch "
          f"{result['machine'].get('torch')}")
    table = Table(52, repeats=cfg["repeats"])
    table.header()
    for m in result["models"]:
        name = f"width {m['width']} x {m['layers']} layers, batch {m['batch']}"
        table.row(f"{name}: step, no hooks", m["step_s"]["off"], "ms", 1e3)
        table.row("  step, hooks", m["step_s"]["on"], "ms", 1e3)
        table.row("  extra per step", m["extra_fraction"], "%", 100, ".1f")
        table.row(f"  per hook call ({m['hook_calls_per_step']} a step)", m["per_call_s"], "us",
                  1e6, ".2f")


def parse_args(argv: list[str] | None) -> Any:
    p = Parser("interrupt_cost", __doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int)
    p.add_argument("--iters", type=int, help="steps per variant and repeat (the largest model "
                   "takes a tenth of them)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="two repeats, few steps: for the tests")
    p.outputs()
    args = p.parse(argv, {"repeats": (7, 2), "iters": (200, 10)})
    if args.repeats < 1 or args.iters < 10 or args.warmup < 0:
        p.error("--repeats must be at least 1, --iters at least 10, --warmup at least 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    started = datetime.now(UTC).isoformat(timespec="seconds")
    models = [measure(w, n, b, args.repeats, args.iters // (10 if w >= 1024 else 1),
                      args.warmup) for w, n, b in MODELS]
    result = {**harness.header("interrupt_cost", started, torch=True),
              "config": {"repeats": args.repeats, "iters": args.iters, "warmup": args.warmup,
                         "smoke": args.smoke, "threads": 1},
              "models": models}
    harness.report(result, args.out, print_summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
