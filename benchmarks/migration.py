"""Planned-migration benchmark: downtime, phase 1 and the state transfer of a live migration.

One command, real processes. N times, on a fresh local cluster each time (an embedded etcd,
``node-a`` and ``node-b`` with two slots each, two standby nodes): the plain-PyTorch example
(``examples/plain_torch/train.py``) runs TP=2 x DP=2 with two standbys under ``understudy run``;
once every rank trains (its groups are up and its write syscalls climb step after step) and
both standby workers are connected to their daemons (they have imported the job), and
``--settle-seconds`` later, ``node-b`` is drained, its two ranks move live to the standbys, and
the job runs to its last step. Then:

- **downtime (phase 2)**, as the design defines it: on each survivor (ranks 0 and 1), the time
  of the switch step (boundary + compute + vote + apply, from the job's saved per-step
  timings) minus the survivor's median step. The switch step is the joiners' first step; its
  boundary holds the wait for the leavers' transfer and the group switch. A repeat's figure is
  the larger of the two survivors'.
- **phase 1**, off the critical path: the migration's phase times from the ``migration-done``
  event (planned -> preparing -> ready -> switching -> done), and how many steps the survivors
  committed while it ran.
- **the state transfer**: bytes, seconds and MB/s from each leaver's "Handed the state ... off"
  log line (worker stderr goes to the daemon log); with the state sent ahead (the example's
  default, ``--hand-off ahead``), from its "sent ahead" line, and the last step's message (its
  gradients, with the RNG states and counters: the switch's word) apart.
- **raw point-to-point bandwidth of the same machine, in the same run**: after each repeat, two
  processes exchange gloo send/recv (a buffer of the state's size and one of 64 MiB, each
  answered by a 1-byte ack), and ``send_state``/``receive_state`` move a state of each size
  over a ``PairGroupTransport``, so the transfer path is also measured at a size where
  bandwidth, not latency, dominates.

Prints a summary and writes JSON with the machine, the command, the configuration and every
sample. Every process it starts is stopped on exit, Ctrl-C and SIGTERM included.

    .venv/bin/python benchmarks/migration.py [--repeats N] [--steps S] [--state-size SIZE]
                                             [--hand-off ahead|whole] [--smoke] [--out FILE]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import harness
import psutil
from harness import (
    MIB,
    PROCESS_ENV,
    TRAIN,
    BenchmarkError,
    Table,
    log_records,
    summarize,
    summarize_some,
    wait,
)
from interruptions import AROUND, LEAVERS, analyse_drain, finish_timeout, train_processes

from understudy.common.errors import UnderstudyError
from understudy.common.sizes import size_arg
from understudy.testing.localcluster import LocalCluster

JOB = "bench"
BIG = 64 * MIB
#: Design targets (/work/shared/design.md, "Targets").
TARGET_DOWNTIME_S = 0.25
TARGET_TRANSFER_FRACTION = 0.70


@dataclass(frozen=True)
class BenchConfig:
    repeats: int
    steps: int
    step_sleep: float
    settle_seconds: float
    p2p_iters: int
    smoke: bool
    #: the job's state per rank in bytes (None: the example's own, about 27 KB)
    state_bytes: int | None = None
    #: the leavers send their state ahead (the example's default) or whole at the switch
    hand_off: str = "ahead"


# -- one repeat on a fresh cluster -------------------------------------------------------------


def ranks_grouped(cluster: LocalCluster) -> bool:
    """Every rank has switched to its first group versions (it builds the job next)."""
    up = set()
    for node in ("node-a", "node-b"):
        for rec in log_records(cluster.daemons[node].log_text()):
            if (rec.get("event") == "Switched group versions."
                    and str((rec.get("switched") or {}).get("world", "")).startswith("v0->")):
                up.add(rec.get("member"))
    return len(up) == 4


def ranks_stepping(cluster: LocalCluster, window: float = 1.0, min_writes: int = 60) -> bool:
    """Every rank is past its build and trains: its write syscalls (the collectives' sends, a
    daemon request per step) climb by ``min_writes`` within ``window`` seconds, about two steps
    of the plain job; while a rank builds the job it writes next to nothing."""
    try:
        ranks = train_processes(cluster, ("node-a", "node-b"))
        if len(ranks) != 4:
            return False
        before = [p.io_counters().write_count for p in ranks]
        time.sleep(window)
        after = [p.io_counters().write_count for p in ranks]
    except psutil.Error:
        return False
    return all(b - a >= min_writes for a, b in zip(before, after, strict=True))


def standbys_connected(cluster: LocalCluster) -> bool:
    """Both standby workers hold their daemon connection, which a worker opens once it has
    imported the job (torch included): they are waiting, warm."""
    try:
        workers = train_processes(cluster, ("node-s1", "node-s2"))
        return len(workers) == 2 and all(p.net_connections(kind="unix") for p in workers)
    except psutil.Error:
        return False


def run_repeat(i: int, cfg: BenchConfig, base: Path) -> dict[str, Any]:
    out = base / "out"
    load_before = os.getloadavg()[0]
    t0 = time.monotonic()
    with harness.local_cluster(base) as (_, cluster):
        for n in ("node-a", "node-b"):
            cluster.add(n, "active", extra=["--slots", "2"])
        for n in ("node-s1", "node-s2"):
            cluster.add(n, "standby")
        for n, s in (("node-a", "active"), ("node-b", "active"), ("node-s1", "standby"),
                     ("node-s2", "standby")):
            cluster.wait_state(n, s, timeout=60)
        cluster.wait_for("a controller", lambda s: s.controller is not None, timeout=60)
        env = [f"--env={k}={v}" for k, v in PROCESS_ENV.items()]
        run = cluster.cli("run", "--job", JOB, "--tp", "2", "--dp", "2", "--standby", "2", *env,
                          "--", sys.executable, str(TRAIN), "--steps", str(cfg.steps),
                          "--step-sleep", str(cfg.step_sleep), "--save", str(out),
                          "--hand-off", cfg.hand_off,
                          *(["--state-size", str(cfg.state_bytes)] if cfg.state_bytes else []),
                          *harness.example_options(cfg.smoke))
        if run.returncode != 0:
            raise BenchmarkError(f"understudy run failed: {run.stderr.strip()}")
        started = wait("every rank to build its groups", lambda: ranks_grouped(cluster),
                       timeout=180)
        stepping = wait("every rank to step", lambda: ranks_stepping(cluster), timeout=180)
        warm = wait("both standby workers to connect", lambda: standbys_connected(cluster),
                    timeout=180)
        time.sleep(cfg.settle_seconds)
        t_drain = time.monotonic()
        drain = cluster.cli("drain", "node-b", "--deadline", "300", "--wait", timeout=360)
        drain_s = time.monotonic() - t_drain
        if drain.returncode != 0:
            raise BenchmarkError(f"the drain failed: {drain.stdout}{drain.stderr}")
        harness.wait_done(cluster, JOB, timeout=finish_timeout(cfg.steps))
        seen = harness.snapshot(cluster, limit=200)
    figures = analyse_drain(out, seen["events"], seen["logs"])
    return {"repeat": i, "wall_s": time.monotonic() - t0, "ranks_groups_up_after_s": started,
            "ranks_stepping_after_s": started + stepping,
            "standbys_connected_after_s": warm, "drain_command_s": drain_s,
            "loadavg_1m_before_after": [load_before, os.getloadavg()[0]],
            "daemon_log_tracebacks": seen["tracebacks"], **figures}


# -- raw point-to-point bandwidth, two processes -----------------------------------------------


def _p2p_peer(rank: int, store_path: str, sizes: dict[str, int], entries: int, iters: int,
              results: Any) -> None:
    """One end: raw gloo send + 1-byte ack, then send_state/receive_state, for each size."""
    try:

        import torch

        from understudy.worker.transfer import receive_state, send_state

        torch.set_num_threads(1)
        raw, transport = harness.gloo_pair(store_path, rank, timeout_s=60)
        ack = torch.zeros(1, dtype=torch.uint8)
        out: dict[str, Any] = {"raw": {}, "send_state": {}}

        def ping(buf: torch.Tensor) -> float:
            t = time.perf_counter()
            harness.round_trip(raw, rank, [buf], ack, tags=(0, 1))
            return time.perf_counter() - t

        def state_of(nbytes: int) -> dict[str, torch.Tensor]:
            n = nbytes // 4
            return {f"t{k}": torch.randn(n // entries + (1 if k < n % entries else 0))
                    for k in range(entries)}

        out["latency_1b_s"] = statistics.median(ping(ack.clone()) for _ in range(3 * iters))
        for label, nbytes in sizes.items():
            n = iters * (5 if nbytes < MIB else 1)
            buf = torch.empty(nbytes, dtype=torch.uint8)
            samples = [ping(buf) for _ in range(n + 2)][2:]  # two warm-up rounds
            out["raw"][label] = {"bytes": nbytes, "samples_s": samples}
            state = state_of(nbytes) if rank == 0 else None
            sent = []
            for _ in range(max(3, n // 2) + 1):
                if rank == 0:
                    stats = send_state(transport, state)
                else:
                    _, stats = receive_state(transport)
                sent.append((stats.seconds, stats.payload_bytes))
            out["send_state"][label] = {"bytes": sent[-1][1],
                                        "samples_s": [s for s, _ in sent[1:]]}
        results.put((rank, out))
    except Exception as exc:  # the parent reports it; a child has nobody else to tell
        results.put((rank, {"error": f"{type(exc).__name__}: {exc}"}))


def measure_p2p(state_bytes: int, entries: int, iters: int, base: Path) -> dict[str, Any]:
    """Raw and ``send_state`` point-to-point times between two fresh processes on this machine.

    Raises:
        BenchmarkError: a peer failed or ran past its time.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    sizes = {"state": state_bytes, "64MiB": BIG}
    store = base / "p2p-store"
    peers = [ctx.Process(target=_p2p_peer, name=f"p2p-{r}",
                         args=(r, str(store), sizes, entries, iters, results)) for r in (0, 1)]
    for p in peers:
        p.start()
    got: dict[int, dict[str, Any]] = {}
    try:
        while len(got) < 2:
            rank, res = results.get(timeout=300)
            if "error" in res:
                raise BenchmarkError(f"the point-to-point peer {rank} failed: {res['error']}")
            got[rank] = res
    except Exception as exc:
        if isinstance(exc, BenchmarkError):
            raise
        raise BenchmarkError(f"the point-to-point peers gave no result: {exc!r}") from exc
    finally:
        for p in peers:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    sender = got[0]
    out: dict[str, Any] = {"latency_1b_round_trip_s": sender["latency_1b_s"]}
    for kind in ("raw", "send_state"):
        out[kind] = {}
        for label, r in sender[kind].items():
            med = statistics.median(r["samples_s"])
            out[kind][label] = {"bytes": r["bytes"], "median_s": med,
                                "mb_per_s": r["bytes"] / med / 1e6, "samples_s": r["samples_s"]}
    return out


# -- the run -----------------------------------------------------------------------------------


def collect(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    transfers = [t for r in repeats for t in r["transfers"].values()]
    p2p = [r["p2p"] for r in repeats]

    def over(key: Callable[[dict[str, Any]], float], items: list[Any]) -> dict[str, float]:
        return summarize([key(x) for x in items])

    downtimes = [r["downtime_s"] for r in repeats]
    raw_big = over(lambda p: p["raw"]["64MiB"]["mb_per_s"], p2p)
    state_bytes = transfers[0]["payload_bytes"]
    transfer_rate = over(lambda t: t["mb_per_s"], transfers)
    return {
        "downtime": {
            "what": "survivor's switch step minus its median step; per repeat the larger of "
                    "ranks 0 and 1",
            "target_s": TARGET_DOWNTIME_S, "summary": summarize(downtimes),
            "within_target": sum(1 for d in downtimes if d <= TARGET_DOWNTIME_S),
            "switch_step_s": over(lambda r: max(s["switch_step_s"] for s in
                                                r["survivors"].values()), repeats),
            "switch_boundary_s": over(lambda r: max(s["switch_boundary_s"] for s in
                                                    r["survivors"].values()), repeats),
            "excess_around_switch_s": over(lambda r: r["excess_around_switch_s"], repeats),
            "around_steps": [AROUND.start, AROUND.stop - 1],
            "normal_step_s": over(lambda r: statistics.median(
                s["normal_step_s"] for s in r["survivors"].values()), repeats),
            "hand_off_to_switch_s": over(lambda r: r["hand_off_to_switch_s"], repeats),
            "joiner_first_step_s": summarize([j["first_step_s"] for r in repeats
                                              for j in r["joiners"].values()]),
        },
        "phase1": {
            "planned_to_ready_s": over(lambda r: r["phase1_s"], repeats),
            # The controller may go from ready straight to done when the switch reports beat
            # its "switching" write: a phase missing from a repeat leaves it out of a gap.
            **{f"{a}_to_{b}_s": summarize_some([r["phases_s"][b] - r["phases_s"][a]
                                                for r in repeats
                                                if {a, b} <= r["phases_s"].keys()])
               for a, b in (("planned", "preparing"), ("preparing", "ready"), ("ready", "done"),
                            ("ready", "switching"), ("switching", "done"))},
            "steps_committed_during": over(lambda r: r["phase1_steps"]["count"], repeats),
            "planned_to_chosen_s": summarize_some([r["planned_to_chosen_s"] for r in repeats
                                                   if r["planned_to_chosen_s"] is not None]),
            "steps_before_planned": over(lambda r: r["steps_before_planned"], repeats),
        },
        "transfer": {
            "state_payload_bytes": state_bytes,
            "seconds": over(lambda t: t["seconds"], transfers),
            "mb_per_s": transfer_rate,
            "fraction_of_raw_64mib_bandwidth": transfer_rate["median"] / raw_big["median"],
            "lower_bound_s_at_raw_64mib_bandwidth": state_bytes / (raw_big["median"] * 1e6),
            # The job replays (worker.migration.SendAhead): the state crossed while training
            # went on; what crossed at the switch (RNGs, counters) and the steps forwarded.
            "sent_ahead": all(t.get("sent_ahead") for t in transfers),
            "at_switch_bytes": summarize_some([t["at_switch_bytes"] for t in transfers
                                               if t.get("sent_ahead")]),
            "at_switch_seconds": summarize_some([t["at_switch_seconds"] for t in transfers
                                                 if t.get("sent_ahead")]),
            "steps_forwarded": summarize_some([t["steps_forwarded"] for t in transfers
                                               if t.get("sent_ahead")]),
            # Each end's RSS as its transfer began and the process's peak RSS as it ended
            # (worker.transfer logs them); the peak is the process's lifetime one, an upper
            # bound on what the transfer took, not that alone.
            **{f"{end}_rss_mib": {k: summarize_some([t[f"{end}_rss_mib"][k] for t in transfers
                                                     if t.get(f"{end}_rss_mib")])
                                  for k in ("start", "peak")}
               for end in ("leaver", "joiner")},
        },
        "p2p": {
            "latency_1b_round_trip_s": over(lambda p: p["latency_1b_round_trip_s"], p2p),
            **{f"{kind}_{label}_{unit}": summarize([p[kind][label][unit] for p in p2p])
               for kind in ("raw", "send_state") for label in ("state", "64MiB")
               for unit in ("median_s", "mb_per_s")},
            "send_state_fraction_of_raw_64mib": over(
                lambda p: p["send_state"]["64MiB"]["mb_per_s"] / p["raw"]["64MiB"]["mb_per_s"],
                p2p),
            "target_fraction": TARGET_TRANSFER_FRACTION,
        },
    }


def print_summary(result: dict[str, Any]) -> None:
    cfg, m, s = result["config"], result["machine"], result["summary"]
    print(f"\nplanned migration: TP2 x DP2 + 2 standbys, {cfg['repeats']} drains, {cfg['steps']} "
          f"steps, state {s['transfer']['state_payload_bytes']} B per rank; on "
          f"{m['cpus_usable']} CPUs, Python {m['python']}, etcd {m['etcd_version']}")

    table = Table(40, missing=f"{'(never recorded)':>20}", repeats=cfg["repeats"])
    row = table.row
    table.header()
    d, p1, tr, p2p = s["downtime"], s["phase1"], s["transfer"], s["p2p"]
    row("downtime (phase 2)", d["summary"], "s")
    row("  survivors' switch step", d["switch_step_s"], "s")
    row("    its boundary (transfer wait + switch)", d["switch_boundary_s"], "s")
    row("  survivors' normal step", d["normal_step_s"], "s")
    lo, hi = d["around_steps"]
    row(f"  excess over steps switch{lo:+d}..{hi:+d}", d["excess_around_switch_s"], "s")
    row("  leaver's hand-off -> rank 0 switched", d["hand_off_to_switch_s"], "s")
    row("  joiners' first step", d["joiner_first_step_s"], "s")
    verdict = "meets" if d["summary"]["median"] <= d["target_s"] else "misses"
    print(f"  target <= {d['target_s']} s: median {verdict} it; {d['within_target']}/"
          f"{d['summary']['n']} repeats within")
    row("phase 1: planned -> ready", p1["planned_to_ready_s"], "s")
    row("  planned -> preparing (joiners bound)", p1["planned_to_preparing_s"], "s")
    row("  preparing -> ready (next groups up)", p1["preparing_to_ready_s"], "s")
    row("  ready -> done", p1["ready_to_done_s"], "s")
    row("    ready -> switching (the vote)", p1["ready_to_switching_s"], "s")
    row("    switching -> done", p1["switching_to_done_s"], "s")
    row("  planned -> both standbys chosen", p1["planned_to_chosen_s"], "s")
    row("  steps committed during phase 1", p1["steps_committed_during"], "steps")
    row("  steps committed before the drain", p1["steps_before_planned"], "steps")
    row("state sent ahead (per leaver)" if tr.get("sent_ahead") else
        "transfer in the migration (per leaver)", tr["seconds"], "ms", 1e3)
    row("  rate", tr["mb_per_s"], "MB/s")
    if tr.get("sent_ahead"):
        row("  steps' gradients forwarded after it", tr["steps_forwarded"], "steps")
        row("  last step + switch's word", tr["at_switch_bytes"], "B")
        row("  its send (beside the apply)", tr["at_switch_seconds"], "ms", 1e3)
    for end in ("leaver", "joiner"):
        rss = tr.get(f"{end}_rss_mib", {})
        row(f"  {end}: RSS at its start", rss.get("start"), "MiB")
        row(f"  {end}: peak RSS at its end", rss.get("peak"), "MiB")
    row("raw p2p 1-byte round trip", p2p["latency_1b_round_trip_s"], "ms", 1e3)
    row("raw p2p, state size, send + ack", p2p["raw_state_median_s"], "ms", 1e3)
    row("raw p2p, 64 MiB, send + ack", p2p["raw_64MiB_median_s"], "ms", 1e3)
    row("  rate", p2p["raw_64MiB_mb_per_s"], "MB/s")
    row("send_state, state size (harness)", p2p["send_state_state_median_s"], "ms", 1e3)
    row("send_state, 64 MiB (harness)", p2p["send_state_64MiB_median_s"], "ms", 1e3)
    row("  rate", p2p["send_state_64MiB_mb_per_s"], "MB/s")
    row("  fraction of raw 64 MiB rate", p2p["send_state_fraction_of_raw_64mib"], "")
    print(f"  state bytes / raw 64 MiB bandwidth (lower bound): "
          f"{tr['lower_bound_s_at_raw_64mib_bandwidth'] * 1e6:.1f} us; migration transfer rate "
          f"is {tr['fraction_of_raw_64mib_bandwidth'] * 100:.2f} % of raw 64 MiB bandwidth "
          f"(target >= {TARGET_TRANSFER_FRACTION * 100:.0f} %)")
    loads = [x for r in result["repeats"] for x in r["loadavg_1m_before_after"]]
    print(f"  1-minute load average during the run: {min(loads):.1f} to {max(loads):.1f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.Parser("migration", __doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, help="drains, each on a fresh cluster (default 5; "
                   "smoke 1)")
    p.add_argument("--steps", type=int, help="steps of the job: the drain must land mid-run "
                   "(default 600; smoke 100)")
    p.add_argument("--step-sleep", type=float, default=0.04,
                   help="seconds of stand-in work per step (default 0.04, as the e2e test)")
    p.add_argument("--settle-seconds", type=float,
                   help="training before the drain, once every rank steps and the standbys "
                        "are connected (default 3; smoke 0.5)")
    p.add_argument("--p2p-iters", type=int,
                   help="64 MiB round trips per repeat; small sizes do 5x (default 10; smoke 3)")
    p.add_argument("--state-size", type=size_arg, metavar="SIZE",
                   help="the job's state per rank (64MiB, 1GiB, ...: examples/plain_torch/"
                        "train.py --state-size; default: the example's own, about 27 KB)")
    p.add_argument("--hand-off", choices=("ahead", "landing", "whole"), default="ahead",
                   help="the leavers send their state ahead while training goes on, then each "
                        "step's gradients (default); as ahead, the joiners applying each step "
                        "as it lands; or the whole state at the switch (train.py --hand-off)")
    p.add_argument("--smoke", action="store_true", help="a minute, not many: for the tests")
    p.outputs(keep="keep daemon logs, etcd data and timings here")
    args = p.parse(argv, {"repeats": (5, 1), "steps": (600, 100), "settle_seconds": (3.0, 0.5),
                          "p2p_iters": (10, 3)})
    if args.repeats < 1 or args.p2p_iters < 1:
        p.error("--repeats and --p2p-iters must be at least 1")
    if args.steps < 20:
        p.error(f"--steps must be at least 20 for the drain to land mid-run, got {args.steps}")
    if args.step_sleep < 0 or args.settle_seconds < 0:
        p.error("--step-sleep and --settle-seconds must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = BenchConfig(repeats=args.repeats, steps=args.steps, step_sleep=args.step_sleep,
                      settle_seconds=args.settle_seconds, p2p_iters=args.p2p_iters,
                      smoke=args.smoke, state_bytes=args.state_size, hand_off=args.hand_off)
    os.environ.update(PROCESS_ENV)  # the daemons, their workers and the p2p peers inherit it
    scratch = harness.Scratch(args.keep_dir, "understudy-bench-mig-")

    def run(i: int, base: Path) -> dict[str, Any]:
        rep = run_repeat(i, cfg, base)
        t = rep["transfers"][str(LEAVERS[0])]
        rep["p2p"] = measure_p2p(t["payload_bytes"], t["entries"], cfg.p2p_iters, base)
        print(f"  repeat {i + 1}/{cfg.repeats}: switch at step {rep['switch_step']}, "
              f"downtime {rep['downtime_s']:.3f}s, phase 1 {rep['phase1_s']:.2f}s, "
              f"transfer {t['seconds'] * 1e3:.1f} ms for {t['payload_bytes']} B; raw 64 MiB "
              f"{rep['p2p']['raw']['64MiB']['mb_per_s']:.0f} MB/s; {rep['wall_s']:.0f}s, "
              f"load {rep['loadavg_1m_before_after'][1]:.1f}", file=sys.stderr, flush=True)
        return rep

    # run_repeat stops its cluster.
    repeats = scratch.repeats("migration benchmark", cfg.repeats, run,
                              (OSError, UnderstudyError))
    if isinstance(repeats, int):
        return repeats

    result = {
        **harness.header("migration", scratch.started),
        "config": {**asdict(cfg), "tp": 2, "dp": 2, "standby": 2,
                   "job": "examples/plain_torch/train.py", "threads_per_process": 1},
        "summary": collect(repeats),
        "repeats": repeats,
    }
    harness.report(result, args.out, print_summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
