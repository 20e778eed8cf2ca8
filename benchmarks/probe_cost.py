"""The controller's probing cost against cluster size, capped (``probe.max_rate``) and not.

One command: for each node count N, the real :class:`~understudy.daemon.probe.Prober` of
``daemon/probe.py`` (this process, its own event loop) pings N real
:class:`~understudy.daemon.probe.ProbeResponder` sockets served by four other processes over
loopback UDP, for ``--seconds`` after a 2 s warm-up. Measured: this process's CPU (user +
system, % of one core), the rounds' length, the oldest answer at the end (every node heard
within a round or two), and the nodes condemned (none of them is dead: any is a false
positive). The prober runs at a busy controller's pace (a job running: ``interval``, not
``idle_interval``). Each N runs with the default cap and without one (``max_rate`` 1e9: every
node every ``interval``), alternating, ``--repeats`` times.

    .venv/bin/python benchmarks/probe_cost.py [--nodes 3,128,512,2048] [--seconds 10]
        [--repeats 3] [--smoke] [--out results.json]
"""

from __future__ import annotations

import asyncio
import json
import resource
import subprocess
import sys
import time
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

import harness
from harness import BenchmarkError, Table, summarize

from understudy.common.config import ProbeConfig
from understudy.common.records import NodeRecord
from understudy.common.states import NodeState
from understudy.daemon.probe import Prober, ProbeResponder

RESPONDER_PROCESSES = 4
VARIANTS = {"capped": ProbeConfig().max_rate, "uncapped": 1e9}


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def _serve(count: int, tag: str) -> None:
    """A responder process: ``count`` responders; prints their addresses, then serves."""
    responders = [ProbeResponder(f"n{tag}-{i}", lambda: "i") for i in range(count)]
    print(json.dumps([await r.start("127.0.0.1") for r in responders]), flush=True)
    await asyncio.Event().wait()


async def _measure(records: dict[str, NodeRecord], max_rate: float, seconds: float
                   ) -> dict[str, Any]:
    condemned: list[str] = []

    async def on_dead(rec: NodeRecord, why: str) -> None:
        condemned.append(f"{rec.name}: {why}")

    stop = asyncio.Event()
    prober = Prober(ProbeConfig(max_rate=max_rate), "controller", lambda: records, on_dead)
    task = asyncio.create_task(prober.run(stop))
    await asyncio.sleep(2.0)
    cpu, t0 = _cpu(), time.monotonic()
    await asyncio.sleep(seconds)
    cpu, elapsed, now = _cpu() - cpu, time.monotonic() - t0, time.monotonic()
    oldest = max(now - heard for heard in prober.last_heard().values())
    stop.set()
    await task
    return {"cpu_percent": cpu / elapsed * 100, "round_s": prober.round_s,
            "silence_s": prober.silence, "oldest_answer_s": oldest, "condemned": condemned}


def _run(nodes: int, seconds: float, repeats: int) -> dict[str, Any]:
    per = -(-nodes // RESPONDER_PROCESSES)
    procs = [subprocess.Popen([sys.executable, __file__, "--serve", str(per), str(k)],
                              stdout=subprocess.PIPE, text=True)
             for k in range(RESPONDER_PROCESSES)]
    try:
        records: dict[str, NodeRecord] = {}
        for k, proc in enumerate(procs):
            assert proc.stdout is not None
            for i, address in enumerate(json.loads(proc.stdout.readline())):
                name = f"n{k}-{i}"
                if len(records) < nodes:
                    records[name] = NodeRecord(name=name, incarnation="i", probe=address,
                                               lease=len(records) + 1, state=NodeState.ACTIVE,
                                               role="active", slots=1)
        runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
        for rep in range(repeats):
            order = list(VARIANTS) if rep % 2 == 0 else list(reversed(VARIANTS))
            for variant in order:
                runs[variant].append(asyncio.run(_measure(records, VARIANTS[variant], seconds)))
        return runs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def _summary(result: dict[str, Any]) -> None:
    table = Table(label_width=40, repeats=result["config"]["repeats"])
    table.header("controller CPU, % of one core")
    for nodes, runs in result["sizes"].items():
        for variant, reps in runs.items():
            first = reps[0]
            table.row(f"{nodes} nodes, {variant} (round {first['round_s']:.3g} s)",
                      summarize([r["cpu_percent"] for r in reps]), "%", fmt=".2f")
    oldest = max(r["oldest_answer_s"] for runs in result["sizes"].values()
                 for reps in runs.values() for r in reps)
    false = sum(len(r["condemned"]) for runs in result["sizes"].values()
                for reps in runs.values() for r in reps)
    print(f"\n  oldest answer at a run's end: {oldest:.3f} s; nodes condemned (all were alive): "
          f"{false}")


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--serve"]:
        asyncio.run(_serve(int(sys.argv[2]), sys.argv[3]))
        return 0
    p = harness.Parser("probe_cost", __doc__.split("\n\n")[0])
    p.add_argument("--nodes", help="node counts, comma-separated (default 3,128,512,2048; "
                   "smoke 3,16)")
    p.add_argument("--seconds", type=float, help="measured seconds a run (default 10; smoke 1)")
    p.add_argument("--repeats", type=int, help="runs of each variant a size (default 3; smoke 1)")
    p.add_argument("--smoke", action="store_true", help="seconds, not minutes: for the tests")
    p.outputs()
    args = p.parse(argv, {"nodes": ("3,128,512,2048", "3,16"), "seconds": (10.0, 1.0),
                          "repeats": (3, 1)})
    try:
        sizes = [int(n) for n in args.nodes.split(",")]
    except ValueError:
        p.error(f"--nodes must be whole numbers, comma-separated, got {args.nodes!r}")
    if min(sizes) < 1 or args.seconds <= 0 or args.repeats < 1:
        p.error("--nodes, --seconds and --repeats must be positive")
    started = datetime.now(UTC).isoformat(timespec="seconds")
    result: dict[str, Any] = {**harness.header("probe_cost", started),
                              "config": {"nodes": sizes, "seconds": args.seconds,
                                         "repeats": args.repeats, "smoke": args.smoke,
                                         "probe": asdict(ProbeConfig()),
                                         "variants": VARIANTS},
                              "sizes": {}}
    for nodes in sizes:
        print(f"  {nodes} nodes ...", flush=True)
        result["sizes"][str(nodes)] = _run(nodes, args.seconds, args.repeats)
    harness.report(result, args.out, _summary)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchmarkError as exc:
        sys.exit(f"probe_cost: {exc}")
