"""``understudy``: the operator's CLI. Talks to etcd like the daemons do.

Exit codes: 0 done; 1 the request could not be carried out (etcd unreachable, unknown node or
job, a drain that did not finish in time, a stop of a job that has ended, a stop in which a
rank did not finish its step within the grace, a delete of a job that has not ended); 2 usage
error. Errors are one sentence on stderr and leave etcd unchanged.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import getpass
import json
import math
import os
import re
import socket
import sys
import time
from typing import Any

from understudy.cli import jobs
from understudy.cli import logs as logs_cmd
from understudy.cli.cluster import ClusterStatus, read_cluster, read_events
from understudy.common import config as config_mod
from understudy.common import version
from understudy.common.errors import ConfigError, UnderstudyError
from understudy.common.keys import Keys
from understudy.common.records import (
    DrainRequest,
    DrainSource,
    Event,
    JobSpec,
    JobState,
    MigrationKind,
    RegistryEntry,
    ResizeRequest,
    warmth_line,
)
from understudy.common.states import NodeState
from understudy.common.store import EtcdStore, WatchEvent

EXIT_FAILED = 1
EXIT_USAGE = 2


class CliError(UnderstudyError):
    """Shown to the operator as one sentence; exit code 1."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="understudy", description="Operate an understudy cluster.")
    p.add_argument("--version", action="version", version=version.describe("understudy"))
    _connection_options(p, suppress=False)
    # The same options after the command too (`understudy status --etcd H:P`); there they
    # default to "not given" so they never overwrite a value given before the command.
    common = argparse.ArgumentParser(add_help=False)
    _connection_options(common, suppress=True)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("status", parents=[common],
                       help="show nodes, their states and the controller")
    s.add_argument("--json", action="store_true", help="print a JSON object")

    d = sub.add_parser("drain", parents=[common], help="move all work off a node")
    d.add_argument("node")
    d.add_argument("--deadline", type=float, default=60.0,
                   help="seconds the node has to empty (default 60)")
    d.add_argument("--reason", default="operator drain")
    d.add_argument("--wait", action="store_true", help="wait until the node is drained")

    for name, text in (("undrain", "put a drained or draining node back in service"),
                       ("cordon", "place no new work on a node"),
                       ("uncordon", "allow new work on a node again")):
        c = sub.add_parser(name, parents=[common], help=text)
        c.add_argument("node")

    r = sub.add_parser("run", parents=[common], help="start a training job on the cluster",
                       usage="understudy run --job NAME --tp T --dp D [--pp P] [--standby N] "
                             "[--reshape | --restart-only [--max-restarts N]] [--env K=V] "
                             "[--cwd DIR] [--no-wait] -- COMMAND [ARGS...]")
    r.add_argument("--job", required=True, help="job name (lowercase letters, digits, '-')")
    r.add_argument("--tp", type=int, required=True, help="tensor-parallel size")
    r.add_argument("--dp", type=int, required=True, help="data-parallel size")
    r.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1)")
    r.add_argument("--standby", type=int, default=0, help="standby nodes to reserve")
    r.add_argument("--reshape", action="store_true",
                   help="the job is a slotted one (SlottedJob, --dp slots) that may shrink its "
                        "data parallelism live when a replica is lost and no standby is free, "
                        "instead of pausing (docs/reshape.md)")
    r.add_argument("--restart-only", action="store_true",
                   help="an unmodified torch.distributed script: its ranks get torchrun's "
                        "environment, and a failure, node loss or drain restarts every rank "
                        "from the script's own checkpoint (docs/restart.md)")
    r.add_argument("--max-restarts", type=int, default=None, metavar="N",
                   help="with --restart-only: restarts after failures before the job fails "
                        "(default 3; drains do not count)")
    r.add_argument("--env", action="append", default=[], metavar="K=V",
                   help="extra environment for every rank")
    r.add_argument("--cwd", default=None, help="working directory of the ranks "
                   "(default: the current directory)")
    r.add_argument("--no-wait", action="store_true", help="do not wait for the placement")
    r.add_argument("argv", nargs=argparse.REMAINDER, metavar="COMMAND",
                   help="the training command, after --")

    z = sub.add_parser("resize", parents=[common],
                       help="change the data-parallel size of a job run with --reshape, live")
    z.add_argument("job")
    z.add_argument("--dp", type=int, required=True,
                   help="data-parallel replicas to train on, 1 to the job's --dp (its slots)")

    j = sub.add_parser("jobs", parents=[common], help="list the jobs: state, epoch, layout, "
                       "nodes, standbys, steps committed, age")
    _output_option(j)

    t = sub.add_parser("stop", parents=[common],
                       help="stop a job: every rank finishes its step, the job's on_finish "
                            "runs, its nodes go back to the pool")
    t.add_argument("job")
    t.add_argument("--grace", type=float, default=60.0,
                   help="seconds the ranks have to finish (default 60); a rank still running "
                        "then is stopped as it is, and the exit code is 1")
    t.add_argument("--no-wait", action="store_true", help="do not wait for the job to stop")
    _output_option(t)

    x = sub.add_parser("delete", parents=[common],
                       help="remove a finished (done, failed or stopped) job's records")
    x.add_argument("job")
    _output_option(x)

    e = sub.add_parser("events", parents=[common], help="show the cluster's events")
    e.add_argument("--follow", "-f", action="store_true", help="keep printing new events")
    e.add_argument("--json", action="store_true", help="one JSON object per line")
    e.add_argument("--limit", type=int, default=50, help="show the newest N (default 50)")

    lg = sub.add_parser("logs", parents=[common],
                        help="show a job's ranks' own output (each rank's file on its node)")
    lg.add_argument("job")
    lg.add_argument("--rank", type=int, help="only this rank (default: every rank, each line "
                    "prefixed with its rank)")
    lg.add_argument("--follow", "-f", action="store_true",
                    help="keep printing until the ranks' processes end (or interrupted)")
    return p


def _output_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", choices=("text", "json"), default="text",
                   help="text (default) or json")


def _connection_options(p: argparse.ArgumentParser, suppress: bool) -> None:
    """Options for reaching etcd; with ``suppress``, an option not given sets nothing."""
    kw: dict[str, Any] = {"default": argparse.SUPPRESS} if suppress else {}
    p.add_argument("--etcd", help="HOST:PORT[,HOST:PORT...] (or UNDERSTUDY_ETCD)", **kw)
    p.add_argument("--prefix", help="cluster key prefix (default /understudy)", **kw)
    p.add_argument("--config", help="read etcd settings from this understudyd TOML file", **kw)
    p.add_argument("--ca", help="etcd CA certificate (TLS)", **kw)
    p.add_argument("--cert", help="client certificate for etcd", **kw)
    p.add_argument("--key", help="client key for etcd", **kw)
    p.add_argument("--user", help="etcd user (password from UNDERSTUDY_ETCD_PASSWORD)", **kw)
    p.add_argument("--timeout", type=float, help="per-request timeout, seconds", **kw)


def _store(args: argparse.Namespace) -> tuple[EtcdStore, Keys]:
    cfg = config_mod.load(args.config, require_node=False, overrides={
        "etcd.endpoints": args.etcd, "etcd.prefix": args.prefix, "etcd.ca": args.ca,
        "etcd.cert": args.cert, "etcd.key": args.key, "etcd.user": args.user,
        "etcd.timeout": args.timeout,
    })
    return EtcdStore(cfg.etcd), Keys(cfg.etcd.prefix)


#: C0 and C1 control characters, DEL included: a terminal acts on them (ESC starts a sequence)
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _safe(text: str) -> str:
    """``text`` with its control characters written as escapes (``\\x1b``). What the status
    and event lines show comes from etcd, where workers and other nodes write it (a rank's first
    failure, a health check's message, a standby's warmth, an event's message): none of it may
    move the operator's cursor or recolour the terminal."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _fmt_time(t: float) -> str:
    if not t:
        return "-"
    return datetime.datetime.fromtimestamp(t).strftime("%H:%M:%S")


def _print_status(status: ClusterStatus) -> None:
    print(f"controller: {status.controller or '(none)'}")
    rows: list[tuple[str, ...]] = [("NODE", "STATE", "ROLE", "WORKERS", "SINCE", "NOTE")]
    for n in status.nodes:
        notes = []
        if not n.online:
            notes.append("offline")
        if n.cordoned:
            notes.append("cordoned")
        if n.drain is not None:
            notes.append(f"drain by {n.drain.source}")
        if n.first_failure:
            notes.append(f"first failure: {n.first_failure}")
        if n.health:
            notes.append(f"health: {'; '.join(n.health)}")
        if n.online and (warm := warmth_line(n.warmth, time.time())):
            notes.append(f"warm: {warm}")
        if n.reason and not n.online:
            notes.append(n.reason)
        rows.append(tuple(_safe(c) for c in (
            n.name, n.state, n.role or "-", str(n.workers) if n.online else "-",
            _fmt_time(n.since), ", ".join(notes))))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r[:5], widths, strict=True)) + "  " + r[5])
    if status.ignored:
        print(_safe(f"({len(status.ignored)} unreadable value(s) ignored: "
                    f"{', '.join(status.ignored)})"))


def _print_jobs(status: ClusterStatus) -> None:
    if not status.jobs:
        return
    print()
    rows: list[tuple[str, ...]] = [("JOB", "STATE", "EPOCH", "LAYOUT", "RANKS")]
    for j in status.jobs:
        a = j.assignment
        placement = ""
        if a is not None:
            by_node: dict[str, list[str]] = {}
            for rank, node in enumerate(a.ranks):
                by_node.setdefault(node, []).append(str(rank))
            placement = "  ".join(f"{n}: {','.join(r)}" for n, r in by_node.items())
            if a.standbys:
                placement += f"  standby: {','.join(a.standbys)}"
        elif j.status is not None:
            placement = j.status.reason
        dp = f"{j.dp_now}/{j.spec.dp}" if j.dp_now != j.spec.dp else str(j.spec.dp)
        rows.append(tuple(_safe(c) for c in (
            j.spec.name, j.shown_state, str(a.epoch) if a else "-",
            f"tp{j.spec.tp}xdp{dp}" + (f"xpp{j.spec.pp}" if j.spec.pp > 1 else ""),
            placement)))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r[:4], widths, strict=True)) + "  " + r[4])
    for j in status.jobs:
        m = j.migration
        if m is not None and m.active:
            moves = ", ".join(f"rank {r} {ln or '(new)'} -> {jn}" for r, ln, jn in
                              zip(m.ranks, m.leavers, m.joiners, strict=True))
            if m.kind == MigrationKind.RESHAPE:
                moves = (f"DP {m.from_dp} -> {len(m.replicas)}" + (f"; {moves}" if moves
                                                                   else ""))
            elif m.kind == MigrationKind.RESTART:
                moved = [f"rank {r} {ln} -> {jn}" for r, ln, jn in
                         zip(m.ranks, m.leavers, m.joiners, strict=True) if ln != jn]
                moves = "restart of every rank" + (f"; {', '.join(moved)}" if moved else "")
            print(_safe(f"  migration {m.id} of {j.spec.name}: {m.phase} ({m.reason}): "
                        f"{moves}"))
    for j in status.jobs:
        if j.logs:
            places = "; ".join(f"{node}:{where}/ (ranks {','.join(map(str, ranks))})"
                               for node, (where, ranks) in j.log_places().items())
            print(f"  logs of {j.spec.name} (`understudy logs {j.spec.name} [--rank R]`): "
                  f"{places}")


def _print_event(ev: Event, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"time": ev.time, "kind": ev.kind, "node": ev.node,
                          "message": ev.message, "details": ev.details}), flush=True)
    else:
        stamp = datetime.datetime.fromtimestamp(ev.time).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
        print(_safe(f"{stamp}  {ev.kind:<20} {ev.node:<16} {ev.message}"), flush=True)
        timings = ev.details.get("timings") if ev.kind.startswith("migration-") else None
        if isinstance(timings, dict):
            phases = sorted(((v, k) for k, v in timings.items() if isinstance(v, int | float)))
            print(" " * 25 + "phases, seconds after planned: " +
                  ", ".join(f"{k} {v:.3f}" for v, k in phases), flush=True)


async def _require_node(store: EtcdStore, keys: Keys, name: str) -> ClusterStatus:
    status = await read_cluster(store, keys)
    if status.node(name) is None:
        known = ", ".join(n.name for n in status.nodes) or "none"
        raise CliError(f"no node named {name!r} in this cluster (known: {known})")
    return status


async def _set_cordon(store: EtcdStore, keys: Keys, name: str, value: bool) -> str:
    await _require_node(store, keys, name)
    for _ in range(10):
        kv = await store.get(keys.registry_entry(name))
        if kv is None:
            raise CliError(f"node {name!r} has no registry entry yet; try again")
        try:
            entry = RegistryEntry.decode(kv.value)
        except UnderstudyError as exc:
            raise CliError(f"the registry entry of {name!r} is unreadable ({exc})") from exc
        if entry.cordoned == value:
            return f"node {name} was already {'cordoned' if value else 'uncordoned'}"
        new = RegistryEntry(**{**entry.__dict__, "cordoned": value})
        if await store.cas(keys.registry_entry(name), new.encode(), kv.mod_revision):
            return f"node {name} {'cordoned' if value else 'uncordoned'}"
    raise CliError(f"node {name!r} kept changing; try again")


async def _drain(store: EtcdStore, keys: Keys, args: argparse.Namespace) -> int:
    status = await _require_node(store, keys, args.node)
    node = status.node(args.node)
    assert node is not None
    if not node.online and node.drain is None:
        raise CliError(f"node {args.node!r} is offline ({node.state}); nothing to drain")
    if node.drain is None:
        now = time.time()
        req = DrainRequest(node=args.node, reason=args.reason, source=DrainSource.OPERATOR,
                           requested_at=now, deadline=now + args.deadline,
                           requested_by=f"{getpass.getuser()}@{socket.gethostname()}")
        if await store.cas(keys.drain(args.node), req.encode(), 0):
            print(f"drain of {args.node} requested (deadline {args.deadline:g}s)", flush=True)
        else:
            print(f"node {args.node} is already being drained", flush=True)
    else:
        print(f"node {args.node} is already being drained ({node.drain.source})", flush=True)
    if not args.wait:
        return 0
    deadline = time.monotonic() + args.deadline + 10
    last = None
    while time.monotonic() < deadline:
        status = await read_cluster(store, keys)
        node = status.node(args.node)
        state = node.state if node else "gone"
        line = f"{args.node}: {state}" + (f", {node.workers} worker(s)" if node else "")
        if line != last:
            print(line, flush=True)
            last = line
        if node is None or node.state in (NodeState.DRAINED, NodeState.FAILED) or \
                not node.online:
            return 0 if node is not None and node.state == NodeState.DRAINED else EXIT_FAILED
        await asyncio.sleep(0.2)
    raise CliError(f"node {args.node!r} did not finish draining in time")


async def _resize(store: EtcdStore, keys: Keys, name: str, dp: int) -> str:
    """Ask the controller to reshape job ``name`` to ``dp`` replicas (``docs/reshape.md``).
    Refused, with nothing written, for an unknown job, one not run with ``--reshape``, one
    not running, or a size outside 1 to its ``--dp``."""
    job = (await read_cluster(store, keys)).require_job(name)
    if not job.spec.reshape:
        raise CliError(f"job {name!r} was not run with --reshape: its data-parallel size is "
                       f"fixed at {job.spec.dp}")
    if job.state != JobState.RUNNING:
        raise CliError(f"job {name!r} is {job.state}: only a running job can be resized")
    if not 1 <= dp <= job.spec.dp:
        raise CliError(f"job {name!r} can train on 1 to {job.spec.dp} data-parallel replicas "
                       f"(its slots), not {dp}")
    req = ResizeRequest(job=name, dp=dp, requested_at=time.time(),
                        requested_by=f"{getpass.getuser()}@{socket.gethostname()}")
    await store.put(keys.job_resize(name), req.encode())
    now = job.dp_now
    if dp == now:
        return f"job {name} trains at DP {dp} already; it will stay there"
    more = "" if dp < now else " (as standby nodes are free: a replica takes " \
        f"{job.spec.tp * job.spec.pp} of them)"
    return f"job {name}: resize from DP {now} to DP {dp} requested{more}"


async def _undrain(store: EtcdStore, keys: Keys, name: str) -> str:
    status = await _require_node(store, keys, name)
    node = status.node(name)
    assert node is not None
    if node.drain is None:
        kv = await store.get(keys.drain(name))
        if kv is None:
            return f"node {name} is not drained"
    await store.delete(keys.drain(name))
    return f"node {name} is back in service" + ("" if node.online else " when it rejoins")


async def _run_job(store: EtcdStore, keys: Keys, args: argparse.Namespace) -> int:
    argv = list(args.argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    env: dict[str, str] = {}
    for item in args.env:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise CliError(f"--env {item!r} is not KEY=VALUE")
        env[k] = v
    if args.max_restarts is not None and not args.restart_only:
        raise CliError("--max-restarts counts a --restart-only job's restarts; a job on the "
                       "worker API moves its ranks live instead")
    restarts = {} if args.max_restarts is None else {"max_restarts": args.max_restarts}
    try:
        spec = JobSpec(name=args.job, argv=tuple(argv), cwd=args.cwd or os.getcwd(),
                       tp=args.tp, dp=args.dp, pp=args.pp, standby=args.standby,
                       reshape=args.reshape, restart_only=args.restart_only, **restarts,
                       created_at=time.time(),
                       created_by=f"{getpass.getuser()}@{socket.gethostname()}", env=env)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    status = await read_cluster(store, keys)
    free = sum(max(n.slots - _ranks_on(status, n.name), 0) for n in status.nodes
               if n.online and n.state == NodeState.ACTIVE and not n.cordoned)
    if free < spec.world_size:
        raise CliError(f"cannot place job {spec.name!r}: it needs {spec.world_size} slots on "
                       f"active nodes and {free} are free")
    # A standby node another running job holds in reserve is not free (the planner's rule,
    # daemon/planner.py ClusterView.reserved_standbys: a job the CLI let through would wait
    # unplaced).
    reserved = {n for j in status.jobs if j.assignment is not None and not j.state.ended
                for n in j.assignment.standbys}
    online = [n for n in status.nodes
              if n.online and n.state == NodeState.STANDBY and not n.cordoned]
    standbys = [n for n in online if n.name not in reserved]
    if len(standbys) < spec.standby:
        held = len(online) - len(standbys)
        raise CliError(f"cannot place job {spec.name!r}: it needs {spec.standby} standby "
                       f"nodes and {len(standbys)} are free"
                       + (f" ({held} more held in reserve by other jobs)" if held else ""))
    if not await store.txn(compare=[("create", keys.job_spec(spec.name), 0)],
                           success=[("put", keys.job_spec(spec.name), spec.encode(), None)]):
        raise CliError(f"a job named {spec.name!r} already exists")
    pp = f" x pp {spec.pp}" if spec.pp > 1 else ""
    print(f"job {spec.name} submitted: {spec.world_size} ranks (tp {spec.tp} x dp {spec.dp}{pp}), "
          f"{spec.standby} standby{', may reshape' if spec.reshape else ''}"
          + (f", restart-only (at most {spec.max_restarts} restarts after failures)"
             if spec.restart_only else ""), flush=True)
    if args.no_wait:
        return 0
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        job = (await read_cluster(store, keys)).job(spec.name)
        if job is not None and job.assignment is not None:
            placement = ", ".join(f"rank {r} on {n}" for r, n in enumerate(job.assignment.ranks))
            print(f"job {spec.name} placed (epoch {job.assignment.epoch}): {placement}"
                  + (f"; standby {', '.join(job.assignment.standbys)}"
                     if job.assignment.standbys else ""))
            return 0
        await asyncio.sleep(0.1)
    raise CliError(f"job {spec.name!r} was submitted but not placed within 15s "
                   "(is a controller running?)")


def _ranks_on(status: ClusterStatus, node: str) -> int:
    return sum(1 for j in status.jobs if j.assignment is not None
               and not j.state.ended for n in j.assignment.ranks if n == node)


async def _events(store: EtcdStore, keys: Keys, args: argparse.Namespace) -> int:
    events, rev = await read_events(store, keys)
    for ev in events[-args.limit:] if args.limit > 0 else events:
        _print_event(ev, args.json)
    if not args.follow:
        return 0
    stop = asyncio.Event()
    async for item in store.watch_prefix(keys.events, rev + 1, stop):
        if isinstance(item, WatchEvent) and item.kind == "put":
            with contextlib.suppress(UnderstudyError):
                _print_event(Event.decode(item.kv.value), args.json)
    return 0


async def _run(args: argparse.Namespace) -> int:
    store, keys = _store(args)
    try:
        if args.command == "status":
            status = await read_cluster(store, keys)
            if args.json:
                print(json.dumps(status.as_json(), indent=2))
            else:
                _print_status(status)
                _print_jobs(status)
            return 0
        if args.command == "run":
            return await _run_job(store, keys, args)
        if args.command == "drain":
            return await _drain(store, keys, args)
        if args.command == "undrain":
            print(await _undrain(store, keys, args.node))
            return 0
        if args.command in ("cordon", "uncordon"):
            print(await _set_cordon(store, keys, args.node, args.command == "cordon"))
            return 0
        if args.command == "events":
            return await _events(store, keys, args)
        if args.command == "logs":
            return await logs_cmd.show(store, keys, args.job, args.rank, args.follow)
        if args.command == "resize":
            print(await _resize(store, keys, args.job, args.dp))
            return 0
        if args.command == "jobs":
            return await jobs.list_jobs(store, keys, args.output)
        if args.command == "stop":
            return await jobs.stop(store, keys, args.job, args.grace, not args.no_wait,
                                   args.output)
        if args.command == "delete":
            return await jobs.delete(store, keys, args.job, args.output)
        raise AssertionError(args.command)
    finally:
        await store.close()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0 < getattr(args, "deadline", 1.0) < math.inf:  # NaN too: no comparison holds
        parser.error("--deadline must be a positive number of seconds")
    if not 0 < getattr(args, "grace", 1.0) <= 1e6:
        parser.error("--grace must be positive seconds, at most 1e6")
    if args.command == "run" and not [a for a in args.argv if a != "--"]:
        parser.error("run needs the training command after --")
    try:
        return asyncio.run(_run(args))
    except ConfigError as exc:
        print(f"understudy: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except UnderstudyError as exc:
        print(f"understudy: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
