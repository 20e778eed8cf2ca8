"""Control-plane benchmark: node failure detection latency and the idle cost of the daemons.

One command, real processes: an embedded etcd and K real ``understudyd`` daemons on this machine.

1. Failure detection. N times: ``kill -9`` a non-controller active daemon and poll etcd (one
   long-lived connection, a direct read of ``<prefix>/registry/<node>`` every ``--poll-interval``)
   until the controller has written ``failed``; then restart the node and wait for it to be
   active again. Reported against the design target "lease TTL + 0.5 s" (reported, not asserted).
2. Idle load. With the K daemons idle for S seconds: etcd requests per second per node, from
   etcd's own ``grpc_server_handled_total`` (and per method) and from the daemons'
   ``understudy_etcd_requests_total``; the daemons' RSS and CPU (percent of one core).

Prints a summary table and writes JSON with the machine, the command line, the configuration and
the raw samples. Every process it starts is stopped on exit, Ctrl-C and SIGTERM included.

    .venv/bin/python benchmarks/control_plane.py [--repeats N] [--nodes K] [--ttl T]
        [--idle-seconds S] [--smoke] [--out results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

import harness
import psutil
from harness import (
    MIB,
    BenchmarkError,
    Probe,
    Table,
    by_label,
    cpu_seconds,
    delta,
    scrape,
    summarize,
)

from understudy.common import config as config_mod
from understudy.common.errors import StoreError
from understudy.common.states import NodeState
from understudy.testing.embedded_etcd import EmbeddedEtcd, EtcdStartError
from understudy.testing.localcluster import LocalCluster

#: The daemons run with the default keep-alive interval: kills are spread over one period.
KEEPALIVE_INTERVAL = config_mod.LeaseConfig().keepalive_interval
#: Design targets (docs: /work/shared/design.md, "Targets").
TARGET_DETECTION_OVER_TTL_S = 0.5
TARGET_RSS_MIB = 100.0
TARGET_CPU_PERCENT = 1.0


@dataclass(frozen=True)
class BenchConfig:
    nodes: int
    ttl: int
    repeats: int
    idle_seconds: float
    settle_seconds: float
    poll_interval: float
    seed: int
    smoke: bool

    def roles(self) -> list[tuple[str, str]]:
        """K nodes: one standby when there are at least three, the others active."""
        standby = 1 if self.nodes >= 3 else 0
        return [(f"node-{i:02d}", "standby" if i >= self.nodes - standby else "active")
                for i in range(self.nodes)]


# -- what the processes say -------------------------------------------------------------------


async def wait_until(what: str, check: Callable[[], Awaitable[bool]], timeout: float,
                     interval: float = 0.05) -> float:
    """Poll ``check`` until it holds; returns the seconds it took. Raises BenchmarkError."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if await check():
                return time.monotonic() - t0
        except StoreError:
            pass
        await asyncio.sleep(interval)
    raise BenchmarkError(f"timed out after {timeout:.0f}s waiting for {what}")


async def wait_in_service(probe: Probe, roles: list[tuple[str, str]], timeout: float) -> float:
    async def check() -> bool:
        for name, role in roles:
            want = NodeState.ACTIVE if role == "active" else NodeState.STANDBY
            if await probe.live_state(name) != want or await probe.registry_state(name) != want:
                return False
        return await probe.controller() is not None

    return await wait_until("every node in service and a controller", check, timeout)


# -- 1. failure detection ---------------------------------------------------------------------


async def measure_failure_detection(cluster: LocalCluster, probe: Probe, cfg: BenchConfig,
                                    rng: random.Random) -> list[dict[str, Any]]:
    actives = [name for name, role in cfg.roles() if role == "active"]
    samples: list[dict[str, Any]] = []
    for i in range(cfg.repeats):
        await wait_in_service(probe, cfg.roles(), timeout=60)
        controller = await probe.controller()
        candidates = [n for n in actives if n != controller]
        if not candidates:
            raise BenchmarkError(f"no active node besides the controller {controller!r}")
        victim = candidates[i % len(candidates)]
        # Spread the kill over one keep-alive period: where it lands decides how much of the
        # TTL is left at etcd, and a fixed phase would bias every sample the same way.
        await asyncio.sleep(rng.uniform(0.0, KEEPALIVE_INTERVAL))
        t_kill = time.monotonic()
        cluster.daemons[victim].kill9()
        t_gone: float | None = None
        deadline = t_kill + cfg.ttl + 10
        while True:
            try:
                if t_gone is None and await probe.live_state(victim) is None:
                    t_gone = time.monotonic()
                if await probe.registry_state(victim) == NodeState.FAILED:
                    t_failed = time.monotonic()
                    break
            except StoreError:
                pass
            if time.monotonic() > deadline:
                raise BenchmarkError(f"{victim} was not declared failed within "
                                     f"{deadline - t_kill:.0f}s of its kill -9")
            await asyncio.sleep(cfg.poll_interval)
        t_gone = t_gone if t_gone is not None else t_failed
        t_restart = time.monotonic()
        cluster.add(victim, "active")

        async def back(name: str = victim) -> bool:
            return (await probe.live_state(name) == NodeState.ACTIVE
                    and await probe.registry_state(name) == NodeState.ACTIVE)

        await wait_until(f"{victim} to be active again", back, timeout=60)
        sample = {
            "repeat": i, "victim": victim, "controller": controller,
            "kill_to_failed_s": t_failed - t_kill,
            "kill_to_lease_gone_s": t_gone - t_kill,
            "lease_gone_to_failed_s": t_failed - t_gone,
            "restart_to_active_s": time.monotonic() - t_restart,
        }
        samples.append(sample)
        print(f"  repeat {i + 1}/{cfg.repeats}: kill -9 {victim} -> failed in "
              f"{sample['kill_to_failed_s']:.3f}s (lease gone {sample['kill_to_lease_gone_s']:.3f}s"
              f"); back in {sample['restart_to_active_s']:.2f}s", file=sys.stderr, flush=True)
    return samples


# -- 2. idle load and footprint ---------------------------------------------------------------


async def measure_idle(cluster: LocalCluster, etcd: EmbeddedEtcd, cfg: BenchConfig
                       ) -> dict[str, Any]:
    names = sorted(cluster.daemons)
    procs = {n: psutil.Process(cluster.daemons[n].pid) for n in names}
    assert etcd.proc is not None
    etcd_proc = psutil.Process(etcd.proc.pid)

    def daemon_ops(name: str) -> dict[str, float]:
        url = f"http://127.0.0.1:{cluster.daemons[name].metrics_port}/metrics"
        return by_label(scrape(url), "understudy_etcd_requests_total", "op")

    ops0 = {n: daemon_ops(n) for n in names}
    etcd0 = scrape(etcd.metrics_url)
    cpu0 = {n: cpu_seconds(p) for n, p in procs.items()}
    etcd_cpu0 = cpu_seconds(etcd_proc)
    psutil.cpu_percent()  # starts the machine-wide busy counter read below
    t0 = time.monotonic()
    await asyncio.sleep(cfg.idle_seconds)
    elapsed = time.monotonic() - t0
    cpu1 = {n: cpu_seconds(p) for n, p in procs.items()}
    etcd_cpu1 = cpu_seconds(etcd_proc)
    machine_busy = psutil.cpu_percent()
    etcd1 = scrape(etcd.metrics_url)
    ops1 = {n: daemon_ops(n) for n in names}
    rss = {n: p.memory_info().rss / MIB for n, p in procs.items()}
    dead = [n for n in names if not cluster.daemons[n].alive()]
    if dead:
        raise BenchmarkError(f"daemons died while idle: {', '.join(dead)}")

    k = len(names)
    handled = delta(by_label(etcd1, "grpc_server_handled_total", "grpc_method"),
                    by_label(etcd0, "grpc_server_handled_total", "grpc_method"))
    received = delta(by_label(etcd1, "grpc_server_msg_received_total", "grpc_method"),
                     by_label(etcd0, "grpc_server_msg_received_total", "grpc_method"))
    per_daemon = {n: delta(ops1[n], ops0[n]) for n in names}
    by_op: dict[str, float] = {}
    for ops in per_daemon.values():
        for op, v in ops.items():
            by_op[op] = by_op.get(op, 0.0) + v
    cpu_pct = {n: 100.0 * (cpu1[n] - cpu0[n]) / elapsed for n in names}

    def rates(counts: dict[str, float]) -> dict[str, dict[str, float]]:
        return {m: {"count": c, "per_s": c / elapsed, "per_s_per_node": c / elapsed / k}
                for m, c in sorted(counts.items(), key=lambda kv: -kv[1])}

    return {
        "window_s": elapsed,
        "nodes": k,
        "etcd": {
            "source": "grpc_server_handled_total (RPCs completed), summed over codes",
            "requests": sum(handled.values()),
            "requests_per_s_per_node": sum(handled.values()) / elapsed / k,
            "by_method": rates(handled),
            "stream_messages_note": "grpc_server_msg_received_total also counts requests sent "
                                    "on long-lived streams (watch create/cancel, and the "
                                    "keep-alives: one stream per connection)",
            "messages_received": sum(received.values()),
            "messages_received_per_s_per_node": sum(received.values()) / elapsed / k,
            "messages_by_method": rates(received),
        },
        "daemons": {
            "source": "understudy_etcd_requests_total, summed over daemons",
            "requests": sum(by_op.values()),
            "requests_per_s_per_node": sum(by_op.values()) / elapsed / k,
            "by_op": rates(by_op),
            "per_node": {n: {"requests": sum(ops.values()),
                             "per_s": sum(ops.values()) / elapsed, "by_op": ops}
                         for n, ops in per_daemon.items()},
        },
        "footprint": {
            "rss_mib": {**summarize(list(rss.values())), "per_node": rss,
                        "target_max": TARGET_RSS_MIB},
            "cpu_percent_of_one_core": {**summarize(list(cpu_pct.values())),
                                        "per_node": cpu_pct, "target_max": TARGET_CPU_PERCENT},
            "etcd": {"rss_mib": etcd_proc.memory_info().rss / MIB,
                     "cpu_percent_of_one_core": 100.0 * (etcd_cpu1 - etcd_cpu0) / elapsed},
        },
        # Other work on the machine competes with the daemons for the CPU: say how much.
        "machine_cpu_busy_percent": machine_busy,
        "loadavg_1m_after": os.getloadavg()[0],
    }


# -- the run ----------------------------------------------------------------------------------


async def run_async(cluster: LocalCluster, etcd: EmbeddedEtcd, cfg: BenchConfig,
                    rng: random.Random) -> dict[str, Any]:
    probe = Probe(etcd.endpoint, cluster.prefix)
    try:
        for name, role in cfg.roles():
            cluster.add(name, role)
        joined = await wait_in_service(probe, cfg.roles(), timeout=60)
        print(f"{cfg.nodes} daemons in service after {joined:.2f}s; settling "
              f"{cfg.settle_seconds:.0f}s, then idle for {cfg.idle_seconds:.0f}s",
              file=sys.stderr, flush=True)
        # Idle first, on the daemons as started: the failure runs restart nodes and write events.
        await asyncio.sleep(cfg.settle_seconds)
        idle = await measure_idle(cluster, etcd, cfg)
        print(f"failure detection: {cfg.repeats} kill -9, TTL {cfg.ttl}s", file=sys.stderr,
              flush=True)
        load_before = os.getloadavg()[0]
        samples = await measure_failure_detection(cluster, probe, cfg, rng)
        load_after = os.getloadavg()[0]
    finally:
        await probe.close()
    latencies = [s["kill_to_failed_s"] for s in samples]
    target = cfg.ttl + TARGET_DETECTION_OVER_TTL_S
    return {
        "failure_detection": {
            "what": "kill -9 of a non-controller active daemon to its registry entry reading "
                    "'failed' in etcd",
            "poll_interval_s": cfg.poll_interval,
            "target_s": target,
            "summary": summarize(latencies),
            "lease_gone": summarize([s["kill_to_lease_gone_s"] for s in samples]),
            "controller_reaction": summarize([s["lease_gone_to_failed_s"] for s in samples]),
            "within_target": sum(1 for v in latencies if v <= target),
            "loadavg_1m_before_after": [load_before, load_after],
            "samples": samples,
        },
        "idle": idle,
    }


def print_summary(result: dict[str, Any]) -> None:
    fd, idle = result["failure_detection"], result["idle"]
    cfg, m = result["config"], result["machine"]
    print(f"\ncontrol plane: {cfg['nodes']} daemons ({cfg['active']} active, {cfg['standby']} "
          f"standby), lease TTL {cfg['ttl']}s, on {m['cpus_usable']} CPUs, etcd "
          f"{m['etcd_version']}, Python {m['python']}")

    table = Table(34, columns=("median", "min", "p90", "max", "spread"), column_width=9)
    table.header(f"failure detection (n={fd['summary']['n']})")
    table.row("kill -9 -> failed in etcd", fd["summary"], "s")
    table.row("  kill -9 -> lease gone", fd["lease_gone"], "s")
    table.row("  lease gone -> failed", fd["controller_reaction"], "s")
    verdict = "meets" if fd["summary"]["median"] <= fd["target_s"] else "misses"
    print(f"  target TTL + 0.5 s = {fd['target_s']:.1f}s: median {verdict} it; "
          f"{fd['within_target']}/{fd['summary']['n']} samples within")

    e, d = idle["etcd"], idle["daemons"]
    print(f"\n  idle load over {idle['window_s']:.1f}s        requests/s per node")
    print(f"  {'etcd grpc_server_handled_total':<34}{e['requests_per_s_per_node']:>9.2f}")
    for method, r in e["by_method"].items():
        print(f"    {method:<32}{r['per_s_per_node']:>9.2f}")
    print(f"  {'etcd msgs received (incl. streams)':<34}"
          f"{e['messages_received_per_s_per_node']:>9.2f}")
    for method, r in e["messages_by_method"].items():
        print(f"    {method:<32}{r['per_s_per_node']:>9.2f}")
    print(f"  {'daemons understudy_etcd_requests':<34}{d['requests_per_s_per_node']:>9.2f}")
    for op, r in d["by_op"].items():
        print(f"    {op:<32}{r['per_s_per_node']:>9.2f}")

    fp = idle["footprint"]
    rss, cpu = fp["rss_mib"], fp["cpu_percent_of_one_core"]
    print(f"\n  {'daemon footprint, idle':<34}{'median':>9}{'max':>9}{'target':>9}")
    print(f"  {'RSS (MiB)':<34}{rss['median']:>9.1f}{rss['max']:>9.1f}{'<= 100':>9}")
    print(f"  {'CPU (% of one core)':<34}{cpu['median']:>9.2f}{cpu['max']:>9.2f}{'<= 1':>9}")
    print(f"  {'etcd (RSS MiB, % core)':<34}{fp['etcd']['rss_mib']:>9.1f}"
          f"{fp['etcd']['cpu_percent_of_one_core']:>9.2f}")
    print(f"  machine busy during the idle window: {idle['machine_cpu_busy_percent']:.0f}% of "
          f"all CPUs; 1-minute load average after it {idle['loadavg_1m_after']:.2f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.Parser("control_plane", __doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, help="kill -9 repetitions (default 10; smoke 1)")
    p.add_argument("--nodes", type=int, help="daemons (default 4: 3 active + 1 standby; "
                   "smoke 2 active)")
    p.add_argument("--ttl", type=int, default=3,
                   help="lease TTL in seconds (default 3; the daemon's defaults need >= 3)")
    p.add_argument("--idle-seconds", type=float, help="idle window (default 30; smoke 2)")
    p.add_argument("--settle-seconds", type=float,
                   help="wait after start-up before the idle window (default 5; smoke 1)")
    p.add_argument("--poll-interval", type=float, default=0.01,
                   help="seconds between etcd reads while waiting for 'failed' (default 0.01)")
    p.add_argument("--seed", type=int, default=1, help="seed for the kill timing (default 1)")
    p.add_argument("--smoke", action="store_true", help="seconds, not minutes: for the tests")
    p.outputs(keep="keep daemon logs and etcd data here")
    args = p.parse(argv, {"repeats": (10, 1), "nodes": (4, 2), "idle_seconds": (30.0, 2.0),
                          "settle_seconds": (5.0, 1.0)})
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.nodes < 2:
        p.error(f"--nodes must be at least 2 (a controller and a node to kill), got {args.nodes}")
    if args.ttl < 3:
        p.error(f"--ttl must be at least 3: the daemon's etcd timeout (1 s) must be at most "
                f"TTL/3, got {args.ttl}")
    if args.idle_seconds <= 0 or args.settle_seconds < 0 or args.poll_interval <= 0:
        p.error("--idle-seconds and --poll-interval must be positive, --settle-seconds >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = BenchConfig(nodes=args.nodes, ttl=args.ttl, repeats=args.repeats,
                      idle_seconds=args.idle_seconds, settle_seconds=args.settle_seconds,
                      poll_interval=args.poll_interval, seed=args.seed, smoke=args.smoke)
    scratch = harness.Scratch(args.keep_dir, "understudy-bench-")

    def work() -> tuple[dict[str, Any], dict[str, int]]:
        with harness.local_cluster(scratch.base, cfg.ttl) as (etcd, cluster):
            measured = asyncio.run(run_async(cluster, etcd, cfg, random.Random(cfg.seed)))
            return measured, harness.tracebacks(cluster)

    outcome = scratch.run("control-plane benchmark",
                          (BenchmarkError, EtcdStartError, StoreError, OSError, psutil.Error),
                          work)
    if isinstance(outcome, int):
        return outcome
    measured, tracebacks = outcome

    roles = cfg.roles()
    result = {
        **harness.header("control_plane", scratch.started),
        "config": {**asdict(cfg), "active": sum(1 for _, r in roles if r == "active"),
                   "standby": sum(1 for _, r in roles if r == "standby"),
                   "keepalive_interval_s": KEEPALIVE_INTERVAL},
        **measured,
        "daemon_log_tracebacks": tracebacks,
    }
    harness.report(result, args.out, print_summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
