"""Downtime against state size: ``downtime.py`` at each of several sizes of state per rank, in
one run, and a chart of each event kind's downtime against the size, per system.

    python benchmarks/state_sizes.py [--sizes 27KB,64MiB,256MiB,1GiB] [--events E,...]
                                     [--systems S,...] [--repeats N] [--smoke] [--out F]
    python benchmarks/state_sizes.py --combine RESULT.json [RESULT.json ...] --out F

Each size is one ``downtime.py --state-size SIZE`` run (its own JSON next to ``--out``, named
by the size), the systems side by side inside it as ``downtime.py`` runs them: understudy,
torchrun with DCP checkpoints, torchft. The example job (``examples/plain_torch/train.py``)
picks its hidden width so that a rank holds about SIZE of parameters and Adam state; the
sizes below 64 MiB are the example's own (about 27 KB). The combined JSON keeps each size's
summary and the path of its full result; the chart has one panel per event kind, downtime
(median, with min-max bars) against state size on log axes, one line per system.

``--combine`` runs nothing: it makes the table and the chart of several earlier runs' results
(say, the small sizes with every event in one run, 1 GiB's drain in another and its failures
in a third, where a step takes seconds), each size and event from the last file that has it.
Every file must have run the same systems; an event no run of a size measured is left out of
that size's point. The combined JSON names the source of each size's events (the command,
commit and start of each run).

The 24 GiB machine fits 1 GiB per rank: four ranks and two standbys of understudy (each a
built model), the holder's snapshot copies, and the baselines, which run after it.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import harness
from harness import BenchmarkError

from understudy.common.sizes import parse_size

HERE = Path(__file__).resolve().parent
DEFAULT_SIZES = "27KB,64MiB,256MiB,1GiB"
#: sizes at or below this are the example's own size (no --state-size): it holds ~27 KB
EXAMPLE_OWN = 64 * 1024
EVENTS = "planned-drain,worker-crash,node-loss"
SYSTEMS = "understudy,torchrun,torchft"
COLOURS = {"understudy": "tab:green", "torchrun": "tab:red", "torchft": "tab:blue"}


def label(size: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{size} B"


def run_size(size: int, args: Any, out: Path) -> dict[str, Any]:
    """One ``downtime.py`` run at ``size``; its result (also written at ``out``)."""
    argv = [sys.executable, str(HERE / "downtime.py"), "--events", args.events,
            "--systems", args.systems, "--repeats", str(args.repeats), "--out", str(out)]
    if size > EXAMPLE_OWN:
        argv += ["--state-size", str(size)]
    if args.smoke:
        argv.append("--smoke")
    if args.steps is not None:
        argv += ["--steps", str(args.steps)]
    if args.event_at is not None:
        argv += ["--event-at", str(args.event_at)]
    argv += ["--hand-off", args.hand_off]
    if args.keep_dir is not None:
        argv += ["--keep-dir", str(args.keep_dir / str(size))]
    print(f"\n== state {label(size)} per rank: {' '.join(argv[1:])}", flush=True)
    res = subprocess.run(argv, check=False)
    if res.returncode != 0:
        raise BenchmarkError(f"downtime.py at {label(size)} failed (exit {res.returncode})")
    return json.loads(out.read_text())


def with_event(result: dict[str, Any], event: str) -> list[dict[str, Any]]:
    """The sizes whose run measured ``event`` (a combined result's may not all have)."""
    return [size for size in result["sizes"] if event in size["summary"]]


def print_summary(result: dict[str, Any]) -> None:
    systems = result["config"]["systems"]
    for event in result["config"]["events"]:
        print(f"\n  {event}: downtime, median (min-max) s")
        print(f"  {'state per rank':<16}" + "".join(f"{s:>24}" for s in systems))
        for size in with_event(result, event):
            cells = "".join(
                f"{f['median']:>10.3f} ({f['min']:.3f}-{f['max']:.3f})"
                for f in (size["summary"][event][s]["downtime_s"] for s in systems))
            print(f"  {label(size['state_bytes']):<16}{cells}")


def plot(result: dict[str, Any], png: Path) -> None:
    plt = harness.pyplot()
    events = result["config"]["events"]
    fig, axes = plt.subplots(1, len(events), figsize=(4.2 * len(events), 3.6), squeeze=False)
    for ax, event in zip(axes[0], events, strict=True):
        sizes = with_event(result, event)
        xs = [s["state_bytes"] for s in sizes]
        for system in result["config"]["systems"]:
            fig_s = [s["summary"][event][system]["downtime_s"] for s in sizes]
            # A median at or below zero (the first step after the event ran shorter than a
            # normal step by more than the event cost) cannot sit on a log axis: it is left
            # out of the line (NaN breaks it) and drawn at 1 ms, hollow, labelled with its
            # value rather than passed for 1 ms.
            med = [f["median"] if f["median"] > 0 else math.nan for f in fig_s]
            lo = [m - max(f["min"], 1e-3) if m > 0 else 0.0
                  for m, f in zip(med, fig_s, strict=True)]
            hi = [max(f["max"], 1e-3) - m if m > 0 else 0.0
                  for m, f in zip(med, fig_s, strict=True)]
            ax.errorbar(xs, med, yerr=[lo, hi], marker="o", capsize=3, label=system,
                        color=COLOURS.get(system))
            for x, f in zip(xs, fig_s, strict=True):
                if f["median"] <= 0:
                    ax.plot([x], [1e-3], marker="v", markersize=9, markerfacecolor="none",
                            color=COLOURS.get(system))
                    ax.annotate(f"{f['median']:.2f} s", (x, 1e-3), textcoords="offset points",
                                xytext=(4, 6), fontsize=7, color=COLOURS.get(system))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(xs, [label(x) for x in xs], rotation=30)
        ax.set_title(event)
        ax.set_xlabel("state per rank")
        ax.set_ylabel("downtime (s)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend()
    fig.suptitle("Downtime per event against state size (TP 2 x DP 2, median, min-max)")
    harness.save_chart(fig, png)


def parse_args(argv: list[str] | None = None) -> Any:
    p = harness.Parser("state_sizes", __doc__.splitlines()[0])
    p.add_argument("--sizes", help=f"state per rank, comma-separated (default {DEFAULT_SIZES};"
                   " smoke 27KB,64MiB)")
    p.add_argument("--events", help=f"downtime.py's --events (default {EVENTS}; smoke "
                   "worker-crash)")
    p.add_argument("--systems", help=f"downtime.py's --systems (default {SYSTEMS}; smoke "
                   "understudy,torchft)")
    p.add_argument("--repeats", type=int, help="repeats per size (default 3; smoke 1)")
    p.add_argument("--steps", type=int, help="downtime.py's --steps (default: its own, 300; "
                   "smoke 120): at 1 GiB a step of the four ranks on two cores takes seconds")
    p.add_argument("--event-at", type=int, help="downtime.py's --event-at (default: its own, "
                   "50): the failures at 1 GiB may come at 30 of 60 steps, torchrun's "
                   "checkpoint then 10 steps behind as at 50")
    p.add_argument("--hand-off", choices=("ahead", "whole"), default="ahead",
                   help="downtime.py's --hand-off: understudy's drain sends the state ahead "
                        "(default) or whole at the switch")
    p.add_argument("--smoke", action="store_true", help="two small sizes, one event")
    p.add_argument("--combine", nargs="+", type=Path, metavar="RESULT",
                   help="run nothing: the table and chart of earlier runs' results (their "
                        "JSON), each size from the last file that has it")
    p.outputs(keep="keep each size's logs here, under the size in bytes (downtime.py "
              "--keep-dir)", chart="chart")
    args = p.parse(argv, {"sizes": (DEFAULT_SIZES, "27KB,64MiB"), "events": (EVENTS,
                          "worker-crash"), "systems": (SYSTEMS, "understudy,torchft"),
                          "repeats": (3, 1)})
    try:
        args.size_list = sorted({parse_size(x) for x in args.sizes.split(",") if x.strip()})
    except ValueError as exc:
        p.error(f"--sizes: {exc}")
    if not args.size_list:
        p.error("--sizes names no size")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.combine:
        given = [a.split("=")[0] for a in (sys.argv[1:] if argv is None else argv)]
        runs = sorted({"--sizes", "--events", "--systems", "--repeats", "--steps", "--smoke",
                       "--event-at", "--hand-off", "--keep-dir"} & set(given))
        if runs:
            p.error(f"--combine runs nothing: {', '.join(runs)} would not be used")
    return args


def combine(paths: list[Path]) -> dict[str, Any]:
    """The ``config`` and ``sizes`` of earlier runs' results taken together, each size and
    event from the last file that has it (a size's ``runs`` name each event's source).

    Raises:
        BenchmarkError: a file is not a state-size result, or the files ran other systems.
    """
    by_size: dict[int, dict[str, Any]] = {}
    events: list[str] = []
    systems: list[str] | None = None
    for path in paths:
        try:
            data = json.loads(path.read_text())
            config, sizes = data["config"], data["sizes"]
            theirs, ran = list(config["systems"]), list(config["events"])
            run = {"file": str(path), "command": data.get("command"),
                   "started_at": data.get("started_at"),
                   "git_commit": data.get("machine", {}).get("git_commit"),
                   "repeats": config.get("repeats"), "steps": config.get("steps"),
                   "event_at": config.get("event_at")}
            for size in sizes:  # every figure the table and the chart read
                int(size["state_bytes"])
                for event in size["summary"]:
                    for system in theirs:
                        float(size["summary"][event][system]["downtime_s"]["median"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise BenchmarkError(f"{path} is not a state_sizes.py result: "
                                 f"{type(exc).__name__}: {exc}") from exc
        if systems is not None and theirs != systems:
            raise BenchmarkError(f"{path} ran the systems {theirs}, the files before it "
                                 f"{systems}: a chart compares the same systems")
        systems = theirs
        events += [e for e in ran if e not in events]
        for size in sizes:
            kept = by_size.setdefault(int(size["state_bytes"]), {
                "state_bytes": int(size["state_bytes"]), "job_state": size.get("job_state"),
                "summary": {}, "runs": {}})
            for event, figures in size["summary"].items():
                kept["summary"][event] = figures
                kept["runs"][event] = {**run, "result": size.get("result")}
    assert systems is not None  # argparse gives at least one path
    return {"config": {"sizes": sorted(by_size), "events": events, "systems": systems,
                       "combined": [str(p) for p in paths]},
            "sizes": [by_size[size] for size in sorted(by_size)]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = harness.header("state_sizes", time.strftime("%Y-%m-%dT%H:%M:%S%z"), torch=True)
    if args.combine:
        try:
            result = {**started, **combine(args.combine)}
        except BenchmarkError as exc:
            print(f"state-size benchmark failed: {exc}", file=sys.stderr)
            return 1
        harness.report(result, args.out, print_summary, plot, args.png)
        return 0
    sizes = []
    try:
        for size in args.size_list:
            out = args.out.with_name(f"{args.out.stem.removesuffix('.smoke')}-{size}.json"
                                     + (".tmp" if args.smoke else ""))
            res = run_size(size, args, out)
            sizes.append({"state_bytes": size, "result": str(out),
                          "job_state": "example's own" if size <= EXAMPLE_OWN else label(size),
                          "summary": res["summary"]})
    except BenchmarkError as exc:
        print(f"state-size benchmark failed: {exc}", file=sys.stderr)
        return 1
    result = {**started,
              "config": {"sizes": args.size_list, "events": args.events.split(","),
                         "systems": args.systems.split(","), "repeats": args.repeats,
                         "steps": args.steps, "event_at": args.event_at,
                         "hand_off": args.hand_off,
                         "smoke": args.smoke},
              "sizes": sizes}
    harness.report(result, args.out, print_summary, plot, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
