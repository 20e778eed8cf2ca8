"""What every benchmark script shares, so that each one holds only what it measures.

- **The command line**: :class:`Parser`, an ``argparse`` parser whose options left out take
  their ``(full, smoke)`` default from a table by ``--smoke``, with the ``--out``, ``--png`` and
  ``--keep-dir`` every benchmark has; the side-by-side runs' shared options.
- **The run**: :class:`Scratch`, the scratch directory and the way a run ends (its processes
  stopped on failure, Ctrl-C and SIGTERM; the directory removed unless kept), and the results:
  :func:`header` (machine and command), :func:`report` (summary, JSON, chart).
- **Statistics**: :func:`summarize` and friends, :func:`rounded` for the JSON.
- **A local cluster**: an embedded etcd and ``understudyd`` daemons on this machine
  (:func:`local_cluster`, :func:`wait_done`, :func:`retire`), a direct line to its etcd
  (:func:`etcd_store`, :class:`Probe`) and its Prometheus metrics (:func:`scrape`).
- **What the processes leave behind**: the daemons' JSON logs and events (:func:`snapshot`,
  :func:`worker_pid`), the jobs' per-step lines (:class:`RecordTail`).
- **Standalone variants side by side**: the example's step time as plain processes
  (:func:`standalone_step`), variants in alternating order (:func:`alternating`) and their
  pooled overhead (:func:`pooled_overhead`).
- **Tables and charts**: :class:`Table` rows of summaries, :func:`pyplot` and
  :func:`save_chart`.

Benchmarks are scripts, not a package: each one imports this module from its own folder.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import importlib.util
import itertools
import json
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import psutil
from prometheus_client.parser import text_string_to_metric_families

from understudy.cli.cluster import JobView
from understudy.common import config as config_mod
from understudy.common.errors import RecordError, UnderstudyError
from understudy.common.keys import Keys
from understudy.common.records import ControllerRecord, NodeRecord, RegistryEntry
from understudy.common.sizes import size_arg
from understudy.common.states import NodeState
from understudy.common.store import EtcdStore
from understudy.testing.embedded_etcd import EmbeddedEtcd
from understudy.testing.localcluster import DaemonProcess, LocalCluster

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
#: The plain-PyTorch example's job, which every benchmark of a training job runs.
TRAIN = REPO / "examples" / "plain_torch" / "train.py"
#: What a smoke adds to the example's command line: torch's Adam through its functional form
#: (``--adam functional``: torch.optim.Adam's bits without the class, whose first use imports
#: ``torch._dynamo``, 1.1-1.4 CPU-s a process). A smoke checks a benchmark's plumbing; the
#: measured runs train with the class, as a user's job does.
SMOKE_EXAMPLE = ("--adam", "functional")


def example_options(smoke: bool, job_args: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The example's options for a run (``smoke`` or measured) whose own are ``job_args``
    (``ShardedJob`` steps its shards with the class whatever the run)."""
    return SMOKE_EXAMPLE if smoke and "--shard-optimizer" not in job_args else ()


#: What every process a benchmark starts is given, understudy's and the baselines' alike: one
#: thread (the benchmarks run many processes on few cores), and torch's CPU allocator on huge
#: pages, which understudy's daemon gives its workers by default (``daemon/jobs.huge_pages``):
#: torchrun and torchft then train on the same allocator (``benchmarks/huge_pages.py`` measures
#: what it changes).
PROCESS_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "THP_MEM_ALLOC_ENABLE": "1"}
MIB = 1024 * 1024

T = TypeVar("T")


class BenchmarkError(UnderstudyError):
    """A benchmark could not measure what it set out to (a node never failed, a job did not
    finish, a log line is missing...)."""


# -- the command line ------------------------------------------------------------------------


class Parser(argparse.ArgumentParser):
    """A benchmark's command line. ``--smoke`` (seconds or minutes, for the tests) picks the
    second of each ``(full, smoke)`` pair in the table given to :meth:`parse` for an option left
    out; :meth:`outputs` adds ``--out`` (default ``benchmarks/results/<name>.json``; smoke
    ``<name>.smoke.tmp``, git-ignored: smoke results are throwaway), ``--png`` (default: next to
    ``--out``) and ``--keep-dir``."""

    def __init__(self, name: str, description: str) -> None:
        super().__init__(description=description)
        self.results = (RESULTS / f"{name}.json", RESULTS / f"{name}.smoke.tmp")
        self._outputs = False

    def outputs(self, keep: str = "", chart: str = "") -> None:
        """``--out``, ``--png`` if there is a ``chart`` (what it is, for the help), and
        ``--keep-dir`` if the benchmark keeps anything (``keep``: its help)."""
        full, smoke = self.results
        self.add_argument("--out", type=Path, help=f"JSON results (default "
                          f"{full.relative_to(REPO)}; smoke {smoke.relative_to(REPO)})")
        if chart:
            self.add_argument("--png", type=Path,
                              help=f"the {chart} (default: next to --out, .png)")
        if keep:
            self.add_argument("--keep-dir", type=Path, help=keep)
        self._outputs = True

    def interruptible(self) -> None:
        """``--interruptible`` (the default) / ``--no-interruptible``: understudy's job stops
        its compute at its next autograd operation once it recovers (``train.py``'s own
        option), or at its next collective, to compare."""
        self.add_argument("--interruptible", action=argparse.BooleanOptionalAction, default=True,
                          help="understudy's job stops its compute at its next autograd "
                               "operation once it recovers (train.py --interruptible, the "
                               "example's default); --no-interruptible: at its next "
                               "collective, to compare")

    def parse(self, argv: list[str] | None = None,
              defaults: Mapping[str, tuple[Any, Any]] | None = None) -> argparse.Namespace:
        """The arguments, each option of ``defaults`` that was left out set to its full or its
        smoke default, and ``--out`` and ``--png`` to theirs."""
        args = self.parse_args(argv)
        table = {**(defaults or {}), **({"out": self.results} if self._outputs else {})}
        for name, (full, smoke) in table.items():
            if getattr(args, name) is None:
                setattr(args, name, smoke if args.smoke else full)
        if getattr(args, "png", False) is None:
            out: Path = args.out
            args.png = (out.with_name(out.name.removesuffix(".tmp") + ".png.tmp")
                        if out.name.endswith(".tmp") else out.with_suffix(".png"))
        return args


def side_by_side_options(p: argparse.ArgumentParser) -> None:
    """The options of a side-by-side run's systems that :func:`check_side_by_side` checks
    besides the job's: the baseline's checkpoint mode and rendezvous keep-alive, understudy's
    lease TTL."""
    p.add_argument("--ckpt-mode", choices=("sync", "async"), default="sync",
                   help="torchrun's DCP save: dcp.save or dcp.async_save (default sync)")
    p.add_argument("--ttl", type=int, default=config_mod.LeaseConfig().ttl,
                   help="understudy's lease TTL in seconds (default: the daemon's)")
    p.add_argument("--rdzv-keepalive",
                   help="torchrun's rendezvous keep_alive_interval (s) and keep_alive_max_attempt "
                        "(default 5,3: torchrun's own; smoke 1,2, so that a node gone from the "
                        "rendezvous costs the tests seconds, not 15)")


def check_side_by_side(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The options every side-by-side run (``downtime.py``, ``goodput.py``) shares (the
    baseline's checkpoint cadence and rendezvous keep-alive, the job's step sleep,
    understudy's lease TTL): exit 2 with a sentence on a bad one; ``args.keepalive`` becomes
    ``(interval, attempts)``. Without ``--rdzv-keepalive``: torchrun's own 5,3, or 1,2 with
    ``--smoke`` (a node gone from the rendezvous then costs the tests seconds, not 15)."""
    if args.rdzv_keepalive is None:
        args.rdzv_keepalive = "1,2" if args.smoke else "5,3"
    if args.ckpt_every < 1 or args.step_sleep < 0:
        p.error("--ckpt-every must be at least 1 and --step-sleep >= 0")
    if args.ttl < 3:
        p.error(f"--ttl must be at least 3, got {args.ttl}")
    try:
        interval, attempts = (int(x) for x in args.rdzv_keepalive.split(","))
    except ValueError:
        p.error(f"--rdzv-keepalive takes two integers, got {args.rdzv_keepalive!r}")
    if interval < 1 or attempts < 1:
        p.error(f"--rdzv-keepalive values must be at least 1, got {args.rdzv_keepalive!r}")
    args.keepalive = (interval, attempts)


# -- the run ---------------------------------------------------------------------------------


class Scratch:
    """A run's scratch directory (``keep_dir``, or a fresh temporary one) and the way the run
    ends. Made at the start of a run: from then on SIGTERM takes the Ctrl-C path, so that the
    ``finally`` blocks of the run stop every process it started."""

    def __init__(self, keep_dir: Path | None, prefix: str) -> None:
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        self.base = keep_dir or Path(tempfile.mkdtemp(prefix=prefix))
        self.base.mkdir(parents=True, exist_ok=True)
        #: the directory outlives the run: asked for, or a failure's logs are in it
        self.keep = keep_dir is not None
        self.started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")

    def run(self, what: str, errors: tuple[type[BaseException], ...],
            work: Callable[[], T]) -> T | int:
        """``work()``'s result, or the exit code: 1 when it raised one of ``errors`` (said in
        a sentence on stderr, the directory kept for its logs), 130 when interrupted. The
        directory is removed afterwards unless :attr:`keep`."""
        try:
            return work()
        except errors as exc:
            print(f"{what} failed: {exc} (logs in {self.base})", file=sys.stderr)
            self.keep = True
            return 1
        except KeyboardInterrupt:
            print(f"{what} interrupted; its processes are stopped", file=sys.stderr)
            # Where it was and what the daemons last said: a run cut short by a test's timeout
            # in CI leaves nothing else behind.
            print("".join(traceback.format_exc(limit=-6)), file=sys.stderr)
            print(log_tails(self.base), file=sys.stderr)
            return 130
        finally:
            # A second Ctrl-C must not cut the clean-up short; once it is done, Ctrl-C and
            # SIGTERM stop the command again (a command that then hung, writing its results or
            # at exit, ignored SIGTERM: a broken 1,024-node scale run needed SIGKILL).
            handlers = {sig: signal.signal(sig, signal.SIG_IGN)
                        for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                if not self.keep:
                    shutil.rmtree(self.base, ignore_errors=True)
            finally:
                for sig, handler in handlers.items():
                    signal.signal(sig, handler)

    def repeats(self, what: str, count: int, run: Callable[[int, Path], dict[str, Any]],
                errors: tuple[type[BaseException], ...]) -> list[dict[str, Any]] | int:
        """``run(i, base / "repeat<i>")`` for each repeat, as :meth:`run`."""
        return self.run(what, errors,
                        lambda: [run(i, self.base / f"repeat{i}") for i in range(count)])


def log_tails(base: Path, lines: int = 8, width: int = 400) -> str:
    """The last ``lines`` lines of every log under ``base`` (each cut to ``width`` characters),
    the most recently written last."""
    logs = sorted(base.rglob("*.log"), key=lambda f: f.stat().st_mtime)
    out = []
    for log in logs:
        try:
            tail = log.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            continue
        out.append(f"--- {log.relative_to(base)}")
        out += [line[:width] for line in tail]
    return "\n".join(out)


def machine(torch: bool = False) -> dict[str, Any]:
    """The machine, the versions and the commit a result comes from (``torch``: its version
    too)."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    etcd_version = "unknown"
    binary = shutil.which("etcd") or "/usr/bin/etcd"
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
        etcd_version = out.stdout.splitlines()[0].split(":", 1)[1].strip()
    except (OSError, IndexError, subprocess.TimeoutExpired):
        pass
    commit, dirty = _git_state(REPO)
    # The code measured is the `understudy` package this process imports: another checkout's
    # when PYTHONPATH names one (the code before a change, timed by this harness).
    spec = importlib.util.find_spec("understudy.common")
    code = Path(spec.origin).resolve().parents[1] if spec and spec.origin else REPO
    return {
        "platform": platform.platform(), "machine": platform.machine(), "cpu_model": model,
        "cpu_count": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)),
        "memory_gib": round(psutil.virtual_memory().total / 1024**3, 1),
        "python": platform.python_version(), "etcd_version": etcd_version,
        "git_commit": commit, "git_dirty": dirty,
        **({} if code == REPO.resolve() else {"code_under_test": {
            "dir": str(code), **dict(zip(("git_commit", "git_dirty"), _git_state(code),
                                         strict=True))}}),
        **({"torch": importlib.metadata.version("torch")} if torch else {}),
    }


def _git_state(repo: Path) -> tuple[str, bool | None]:
    """``repo``'s commit and whether tracked files differ from it ("", None: no git)."""
    commit, dirty = "", None
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "-C", str(repo), "status", "--porcelain",
                                     "--untracked-files=no"],
                                    capture_output=True, text=True, timeout=10).stdout.strip())
    return commit, dirty


def header(name: str, started: str, torch: bool = False) -> dict[str, Any]:
    """The first keys of every result: the benchmark, when, the command line, the machine."""
    return {"benchmark": name, "started_at": started, "command": shlex.join(sys.orig_argv),
            "machine": machine(torch)}


def report(result: dict[str, Any], out: Path, summary: Callable[[dict[str, Any]], None],
           chart: Callable[[dict[str, Any], Path], None] | None = None,
           png: Path | None = None) -> None:
    """Print ``result``'s summary, write it to ``out``, draw its ``chart`` at ``png`` if it has
    one, and say where they are."""
    summary(result)
    write_results(result, out)
    if chart is None or png is None:
        print(f"\nresults written to {out}")
        return
    chart(result, png)
    print(f"\nresults written to {out}, chart to {png}")


def write_results(result: dict[str, Any], out: Path) -> None:
    """``result`` as JSON at ``out`` (floats :func:`rounded`), written whole or not at all."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")  # git-ignored should the run die mid-write
    tmp.write_text(json.dumps(rounded(result), indent=1) + "\n")
    tmp.replace(out)


# -- statistics -------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), ``q`` in [0, 100].

    Raises:
        ValueError: no values.
    """
    if not values:
        raise ValueError("percentile of no values")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values), "median": statistics.median(values), "min": min(values),
        "max": max(values), "p90": percentile(values, 90), "spread": max(values) - min(values),
    }


def summarize_some(values: list[float]) -> dict[str, float] | None:
    """:func:`summarize`, or None for no values (a figure never recorded)."""
    return summarize(values) if values else None


def ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def rounded(value: Any) -> Any:
    """Floats to microseconds: the JSON stays small and diffable."""
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return value


# -- a local cluster ---------------------------------------------------------------------------


def new_cluster(base: Path, lease_ttl: int = 3,
                nodes: str = "nodes") -> tuple[EmbeddedEtcd, LocalCluster]:
    """An etcd (its data in ``base/etcd``) and a cluster of daemons on it (their directories
    and logs in ``base/<nodes>``), neither started yet: :func:`start_etcd` starts etcd, the
    caller adds the daemons."""
    etcd = EmbeddedEtcd(data_dir=base / "etcd")
    cluster = LocalCluster(etcd_endpoint="", base_dir=base / nodes, lease_ttl=lease_ttl)
    return etcd, cluster


def start_etcd(etcd: EmbeddedEtcd, cluster: LocalCluster) -> None:
    etcd.start()
    cluster.etcd_endpoint = etcd.endpoint


def stop_cluster(etcd: EmbeddedEtcd, cluster: LocalCluster) -> None:
    """Stop the daemons, any worker they left behind (workers run in sessions of their own, out
    of reach of the daemon's process group), then etcd (its data freed, its log kept)."""
    workers: list[psutil.Process] = []
    for d in cluster.daemons.values():
        if d.alive():
            with contextlib.suppress(psutil.Error):
                workers += psutil.Process(d.pid).children(recursive=True)
    cluster.stop_all(timeout=5)
    for p in workers:
        with contextlib.suppress(psutil.Error):
            if p.is_running():
                p.kill()
    psutil.wait_procs(workers, timeout=10)
    etcd.cleanup()


@contextlib.contextmanager
def local_cluster(base: Path, lease_ttl: int = 3,
                  nodes: str = "nodes") -> Iterator[tuple[EmbeddedEtcd, LocalCluster]]:
    """:func:`new_cluster` with etcd started; on the way out every process is stopped
    (:func:`stop_cluster`), whatever happened."""
    etcd, cluster = new_cluster(base, lease_ttl, nodes)
    try:
        start_etcd(etcd, cluster)
        yield etcd, cluster
    finally:
        stop_cluster(etcd, cluster)


def wait_done(cluster: LocalCluster, job: str, timeout: float,
              interval: float = 0.5) -> JobView:
    """Wait for ``job`` to end; returns it, done. Every figure comes from the records, events
    and logs, not from when this returns, so it polls twice a second: each poll reads the whole
    cluster's state (about 5 Range requests), and at 20 Hz a 4-daemon cluster with a running
    job saw 108 Range requests a second instead of 4.4, with the harness's own decoding on the
    cores the job is measured on.

    Raises:
        BenchmarkError: it failed or is gone. ClusterTimeout: it ran past ``timeout``.
    """
    cluster.wait_for("the job to finish", lambda s: (j := s.job(job)) is not None
                     and j.state in ("done", "failed", "stopped"), timeout=timeout,
                     interval=interval)
    view = cluster.status().job(job)
    if view is None or view.state != "done":
        raise BenchmarkError(f"the job did not finish: {view.status if view else 'gone'}")
    return view


def etcd_store(endpoint: str, prefix: str) -> EtcdStore:
    """A connection to the cluster's etcd, as the CLI opens one (no node of its own)."""
    cfg = config_mod.load(overrides={"etcd.endpoints": endpoint, "etcd.prefix": prefix},
                          environ={}, require_node=False)
    return EtcdStore(cfg.etcd)


class Probe:
    """Direct reads of the cluster's keys over one long-lived etcd connection."""

    def __init__(self, endpoint: str, prefix: str) -> None:
        self.store = etcd_store(endpoint, prefix)
        self.keys = Keys(prefix)

    async def _read(self, key: str, decode: Callable[[bytes], T]) -> T | None:
        """The record at ``key``; None if there is none or it does not decode."""
        kv = await self.store.get(key)
        if kv is None:
            return None
        try:
            return decode(kv.value)
        except RecordError:
            return None

    async def registry_state(self, node: str) -> NodeState | None:
        entry = await self._read(self.keys.registry_entry(node), RegistryEntry.decode)
        return None if entry is None else entry.state

    async def live_state(self, node: str) -> NodeState | None:
        """The state in the node's lease-bound record; None once the lease has gone."""
        record = await self._read(self.keys.node(node), NodeRecord.decode)
        return None if record is None else record.state

    async def controller(self) -> str | None:
        record = await self._read(self.keys.controller, ControllerRecord.decode)
        return None if record is None else record.node

    async def close(self) -> None:
        await self.store.close()


def wait(what: str, check: Callable[[], bool], timeout: float, interval: float = 0.1,
         error: type[Exception] = BenchmarkError) -> float:
    """Poll ``check`` until it holds; returns the seconds it took.

    Raises:
        error: it did not within ``timeout`` seconds (default BenchmarkError).
    """
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if check():
            return time.monotonic() - t0
        time.sleep(interval)
    raise error(f"timed out after {timeout:.0f}s waiting for {what}")


# -- what the daemons say ----------------------------------------------------------------------


def log_records(text: str) -> list[dict[str, Any]]:
    """The JSON lines of a daemon log (its workers' lines included); other lines are skipped."""
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def wall(record: dict[str, Any]) -> float:
    """A log record's time, in seconds since the epoch."""
    return datetime.datetime.fromisoformat(record["timestamp"]).timestamp()


def wait_log(d: DaemonProcess, text: str, timeout: float) -> float:
    """Wait until daemon ``d``'s log holds ``text``; returns the seconds it took.

    Raises:
        BenchmarkError: it did not within ``timeout`` seconds.
    """
    return wait(f"{d.name} to log {text!r}", lambda: text in d.log_text(), timeout,
                interval=0.02)


def worker_pid(d: DaemonProcess, child: str) -> int:
    """The pid of the newest worker ``child`` (``mig.r1``) of daemon ``d``, from its log: the
    newest started under that name, or renamed to it (a standby promoted into the rank keeps
    its process: "Worker mig.standby is now mig.r1").

    Raises:
        BenchmarkError: no such worker ever started.
    """
    pids = [rec["pid"] for rec in log_records(d.log_text())
            if rec.get("child") == child and rec.get("pid") is not None and (
                "started with pid" in (event := str(rec.get("event", ""))) or
                event.endswith(f" is now {child}."))]
    if not pids:
        raise BenchmarkError(f"{child} never started on {d.name}")
    return int(pids[-1])


def retire(d: DaemonProcess) -> None:
    """Daemon ``d``'s node leaves the cluster: SIGTERM (a daemon leaves on it, once drained),
    SIGKILL if it is still there a minute later."""
    d.signal(signal.SIGTERM)
    try:
        d.wait(timeout=60)
    except subprocess.TimeoutExpired:
        d.kill9()


def tracebacks(cluster: LocalCluster) -> dict[str, int]:
    """Per daemon, the tracebacks in its log: each one a finding."""
    return {n: d.log_text().count("Traceback") for n, d in cluster.daemons.items()}


def snapshot(cluster: LocalCluster, limit: int = 0) -> dict[str, Any]:
    """What the cluster has to say: its newest ``limit`` events (0: all) as ``understudy
    events --json`` prints them, every daemon's JSON log records, and their tracebacks."""
    events = [json.loads(line) for line in
              cluster.cli("events", "--json", "--limit", str(limit)).stdout.splitlines()]
    logs = {n: log_records(d.log_text()) for n, d in cluster.daemons.items()}
    return {"events": events, "logs": logs, "tracebacks": sum(tracebacks(cluster).values())}


def scrape(url: str, timeout: float = 5.0) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus samples by sample name: ``{name: [(labels, value), ...]}``."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        text = resp.read().decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return samples


def by_label(samples: dict[str, list[tuple[dict[str, str], float]]], name: str,
             label: str) -> dict[str, float]:
    """Sum one metric's samples grouped by one label."""
    out: dict[str, float] = {}
    for labels, value in samples.get(name, []):
        out[labels.get(label, "")] = out.get(labels.get(label, ""), 0.0) + value
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in sorted(after)
            if after[k] - before.get(k, 0.0) != 0}


def cpu_seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system)


# -- the jobs' step lines ----------------------------------------------------------------------


def read_records(directory: Path) -> list[dict[str, Any]]:
    """Every JSON line of the ``*.jsonl`` files under ``directory``."""
    tail = RecordTail(directory)
    tail.poll()
    return tail.records


def standalone_step(base: Path, label: str, cfg: Mapping[str, Any], ranks: int,
                    job_args: tuple[str, ...],
                    env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """One standalone run of the plain example (``ranks`` processes bootstrapped through a file
    store, no daemons) with ``job_args`` added (and ``env``): rank 0's median interval between
    committed steps (``step_s``) and the intervals, the first ``cfg["warmup"]`` left out.
    ``cfg`` gives ``steps``, ``state_size``, ``warmup``, ``smoke`` and ``timeout`` (seconds)."""
    base.mkdir(parents=True, exist_ok=True)
    steps = base / "steps"
    procs = []
    for rank in range(ranks):
        with open(base / f"rank{rank}.log", "wb") as log:
            procs.append(subprocess.Popen(
                [sys.executable, str(TRAIN), "--rank", str(rank), "--world-size", str(ranks),
                 "--store", str(base / "store"), "--steps", str(cfg["steps"]),
                 "--state-size", str(cfg["state_size"]), "--step-log", str(steps), *job_args,
                 *example_options(cfg["smoke"], job_args)],
                env={**os.environ, **PROCESS_ENV, **(env or {})}, stdout=subprocess.DEVNULL,
                stderr=log))
    codes, peaks = zip(*(reap(p, cfg["timeout"]) for p in procs), strict=True)
    if any(codes):
        tail = (base / "rank0.log").read_text(errors="replace")[-1500:]
        raise BenchmarkError(f"{label}: the job exited {list(codes)}: {tail}")
    times = sorted(r["t"] for r in read_records(steps)
                   if r.get("rank") == 0 and r.get("kind", "step") == "step")
    intervals = [b - a for a, b in itertools.pairwise(times)][cfg["warmup"]:]
    if not intervals:
        raise BenchmarkError(f"{label}: too few steps logged ({len(times)})")
    return {"step_s": statistics.median(intervals), "intervals": intervals,
            "peak_rss_mib": [peak / MIB for peak in peaks]}


def reap(proc: subprocess.Popen[bytes], timeout: float | None = None) -> tuple[int, int]:
    """Wait for ``proc`` to end: its exit code (``-N`` for signal N) and its peak resident
    memory in bytes (the kernel's ``ru_maxrss`` of that one child, from ``wait4``).
    ``timeout``: seconds, polled every 50 ms; None waits in ``wait4`` itself (a kill's reap,
    timed to the moment).

    Raises:
        subprocess.TimeoutExpired: it ran past ``timeout`` (it is left running).
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, 0 if deadline is None else os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, usage.ru_maxrss * 1024
        if deadline is not None and time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(proc.args, timeout or 0.0)
        time.sleep(0.05)


def reference_run(base: Path, world: int, tp: int, steps: int, smoke: bool,
                  job_args: tuple[str, ...] = ()) -> Path:
    """The uninterrupted run a benchmark's final state is held to: the plain example on
    ``world`` plain processes (no daemons, no step sleep), as the tests' ``standalone_run``
    (tests/integration/test_migration.py) starts it, ``steps`` steps, ``job_args`` added;
    returns the directory of every rank's ``--save``.

    Raises:
        BenchmarkError: a process failed or ran past its time.
    """
    base.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for r in range(world):
            with open(base / f"r{r}.log", "wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, str(TRAIN), "--steps", str(steps), "--step-sleep", "0",
                     "--save", str(base / "out"), "--rank", str(r), "--world-size", str(world),
                     "--tp", str(tp), "--pp", "1", "--store", str(base / "store"), *job_args,
                     *example_options(smoke, job_args)],
                    env={**os.environ, **PROCESS_ENV}, stdout=subprocess.DEVNULL,
                    stderr=log))
        deadline = time.monotonic() + 120 + 0.1 * steps
        for r, p in enumerate(procs):
            code = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            if code != 0:
                tail = (base / f"r{r}.log").read_text(errors="replace")[-2000:]
                raise BenchmarkError(f"reference rank {r} exited with {code}: {tail}")
    except subprocess.TimeoutExpired as exc:
        raise BenchmarkError(f"the reference run took longer than {exc.timeout:.0f} s") from exc
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return base / "out"


def compare_states(expected: Path, actual: Path, world: int) -> dict[str, Any]:
    """Whether every rank's final state is bitwise the reference's (the tests' comparison):
    ``equal``, and the first difference said."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from tests.integration.bitwise import assert_bitwise_equal  # imports torch: only here

    try:
        assert_bitwise_equal(expected, actual, world=world)
    except AssertionError as exc:
        return {"equal": False, "difference": str(exc)[:2000]}
    except (OSError, RuntimeError) as exc:  # a state file missing or unreadable
        return {"equal": False, "difference": f"{type(exc).__name__}: {exc}"[:2000]}
    return {"equal": True, "difference": ""}


def alternating(repeats: int, base: Path, variants: Mapping[str, T],
                run: Callable[[Path, str, T], dict[str, Any]], measured: str, baseline: str,
                says: Callable[[int, dict[str, Any]], str]) -> list[dict[str, Any]]:
    """``repeats`` repeats of every variant side by side, the order alternating from repeat to
    repeat; each repeat's ``overhead`` is ``measured / baseline - 1`` of the runs' ``step_s``,
    and ``says(i, repeat)`` is printed after it."""
    out = []
    for i in range(repeats):
        order = list(variants) if i % 2 == 0 else list(reversed(variants))
        runs: dict[str, Any] = {v: run(base / f"repeat{i}" / v.replace(" ", "-"), v,
                                       variants[v]) for v in order}
        runs["overhead"] = runs[measured]["step_s"] / runs[baseline]["step_s"] - 1
        print(says(i, runs), flush=True)
        out.append({"order": order, **runs})
    return out


def pooled_overhead(repeats: list[dict[str, Any]], measured: str, baseline: str) -> float:
    """``measured / baseline - 1`` of the medians of all intervals of each variant over every
    repeat (less sensitive to one repeat's noise on a shared machine)."""
    def median(variant: str) -> float:
        return statistics.median(i for r in repeats for i in r[variant]["intervals"])
    return median(measured) / median(baseline) - 1


def overhead_parser(name: str, doc: str, dp_help: str) -> Parser:
    """The command line of a side-by-side overhead benchmark of standalone runs (state size,
    DP, repeats, steps, warm-up, smoke, outputs); :func:`overhead_args` parses it."""
    p = Parser(name, doc)
    p.add_argument("--state-size", type=size_arg, help="state per rank, replicated-equivalent "
                   "(default 256MiB; smoke 1MiB)")
    p.add_argument("--dp", type=int, default=2, help=dp_help)
    p.add_argument("--repeats", type=int, help="runs of each variant (default 3; smoke 1)")
    p.add_argument("--steps", type=int, help="steps per run (default 14; smoke 6)")
    p.add_argument("--warmup", type=int, help="first step intervals left out (default 4; "
                   "smoke 1)")
    p.add_argument("--smoke", action="store_true", help="seconds, not minutes: for the tests")
    p.outputs(keep="keep the runs' logs and step logs here")
    return p


def overhead_args(p: Parser, argv: list[str] | None, why_dp: str) -> argparse.Namespace:
    args = p.parse(argv, {"state_size": (256 << 20, 1 << 20), "repeats": (3, 1),
                          "steps": (14, 6), "warmup": (4, 1)})
    if args.dp < 2 or args.repeats < 1 or args.warmup < 0 or args.steps < args.warmup + 2:
        p.error(f"--dp >= 2 ({why_dp}), --repeats >= 1, --warmup >= 0 and "
                "--steps >= --warmup + 2")
    return args


def overhead_summary(result: dict[str, Any], rows: tuple[tuple[str, str], ...], overhead: str,
                     target: str) -> None:
    """The summary of an overhead benchmark: ``rows`` of (label, summary key) of step times,
    the overhead per repeat and pooled, and the target, in words."""
    s, cfg = result["summary"], result["config"]
    table = Table(label_width=34, repeats=cfg["repeats"])
    table.header(f"state {cfg['state_size']} B/rank, DP {cfg['dp']}")
    for label, key in rows:
        table.row(label, s[key], "s")
    table.row(overhead, s["overhead"], "%", scale=100, fmt=".1f")
    print(f"  pooled (medians of every interval): {100 * s['pooled_overhead']:+.1f} %")
    print(f"  target: {target}")


def overhead_run(args: argparse.Namespace, name: str, label: str, variants: tuple[str, str],
                 measure: Callable[[dict[str, Any], Path], list[dict[str, Any]]],
                 config: dict[str, Any], summary: Callable[[dict[str, Any]], None],
                 more: Callable[[list[dict[str, Any]]], dict[str, Any]] | None = None) -> int:
    """Run an overhead benchmark (``measure(cfg, base)``: its repeats, from
    :func:`alternating`) and report it; ``variants`` is (measured, baseline); ``more(repeats)``
    adds to the summary."""
    measured, baseline = variants
    cfg = {"state_size": args.state_size, "dp": args.dp, "repeats": args.repeats,
           "steps": args.steps, "warmup": args.warmup, "smoke": args.smoke,
           "timeout": 120 if args.smoke else 1800}
    scratch = Scratch(args.keep_dir, f"understudy-bench-{label.split()[0]}-")
    repeats = scratch.run(f"{label} benchmark", (OSError, UnderstudyError,
                                                 subprocess.TimeoutExpired),
                          lambda: measure(cfg, scratch.base))
    if isinstance(repeats, int):
        return repeats
    result = {
        **header(name, scratch.started, torch=True),
        "config": {**cfg, "tp": 1, "threads_per_process": 1, **config},
        "summary": {measured: summarize([r[measured]["step_s"] for r in repeats]),
                    baseline: summarize([r[baseline]["step_s"] for r in repeats]),
                    "overhead": summarize([r["overhead"] for r in repeats]),
                    "pooled_overhead": pooled_overhead(repeats, measured, baseline),
                    **(more(repeats) if more is not None else {})},
        "repeats": repeats,
    }
    report(result, args.out, summary)
    return 0


class RecordTail:
    """The JSON lines of the ``*.jsonl`` files under ``directory`` (each process of a job
    appends a line per committed step, and the baselines' workers others: ``start``, ``init``,
    ``saved``...), read incrementally (polling must not load the machine it measures). A line
    still being written is left for the next poll; one cut short by a kill is skipped."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.records: list[dict[str, Any]] = []
        #: per rank, (time, step) of the newest committed step
        self.newest: dict[int, tuple[float, int]] = {}
        self._offsets: dict[Path, int] = {}

    def poll(self) -> list[dict[str, Any]]:
        """Read what was appended since the last poll; returns the new records."""
        new: list[dict[str, Any]] = []
        for path in sorted(self.directory.glob("*.jsonl")):
            offset = self._offsets.get(path, 0)
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
            end = data.rfind(b"\n") + 1
            self._offsets[path] = offset + end
            for line in data[:end].splitlines():
                with contextlib.suppress(json.JSONDecodeError, UnicodeDecodeError):
                    new.append(json.loads(line))
        for r in new:
            if r.get("kind", "step") == "step" and r["t"] >= self.newest.get(r["rank"], (0, 0))[0]:
                self.newest[r["rank"]] = (r["t"], r["step"])
        self.records += new
        return new


# -- tables and charts -------------------------------------------------------------------------


@dataclass(frozen=True)
class Table:
    """Rows of :func:`summarize` figures, one column per statistic, under a header."""

    #: characters of the label column
    label_width: int
    columns: tuple[str, ...] = ("median", "min", "max", "spread")
    column_width: int = 10
    #: what a row says for a figure never recorded
    missing: str = f"{'(none)':>10}"
    #: a row whose count differs from this says so, ``(n=N)``
    repeats: int | None = None
    #: every row says its count
    count_always: bool = False

    def header(self, title: str = "") -> None:
        print(f"\n  {title:<{self.label_width}}"
              + "".join(f"{c:>{self.column_width}}" for c in self.columns))

    def row(self, label: str, v: dict[str, float] | None, unit: str, scale: float = 1.0,
            fmt: str = ".3f") -> None:
        if v is None:
            print(f"  {label:<{self.label_width}}{self.missing}")
            return
        shown = self.count_always or (self.repeats is not None and v["n"] != self.repeats)
        print(f"  {label:<{self.label_width}}"
              + "".join(f"{v[k] * scale:>{self.column_width}{fmt}}" for k in self.columns)
              + f"  {unit}" + (f" (n={v['n']})" if shown else ""))


# -- two processes joined by gloo (the transfer figures) ----------------------------------------


def gloo_pair(store_path: str, rank: int, timeout_s: float) -> tuple[Any, Any]:
    """Two 2-rank gloo groups between this process and its peer, bootstrapped through a file
    store: ``(raw, transport)``, one for raw sends (the bandwidth reference) and one under a
    ``PairGroupTransport`` (what a migration's state transfer uses)."""
    import torch.distributed as dist

    from understudy.worker.transfer import PairGroupTransport

    store = dist.FileStore(store_path, 2)
    timeout = datetime.timedelta(seconds=timeout_s)
    # Any: the stubs of ProcessGroupGloo lack the send/recv it inherits at run time.
    raw: Any = dist.ProcessGroupGloo(dist.PrefixStore("raw", store), rank, 2, timeout)
    transport = PairGroupTransport(
        dist.ProcessGroupGloo(dist.PrefixStore("pair", store), rank, 2, timeout),
        timeout_s=timeout_s)
    return raw, transport


def round_trip(raw: Any, rank: int, pieces: list[Any], reply: Any,
               tags: tuple[int, int] = (0, 0)) -> None:
    """Rank 0 sends ``pieces`` (every send posted at once) and waits for ``reply``; rank 1
    receives them into its own ``pieces`` and answers ``reply``: a raw send + ack."""
    peer = 1 - rank
    if rank == 0:
        works = [raw.send([p], peer, tags[0]) for p in pieces]
    else:
        works = [raw.recv([p], peer, tags[0]) for p in pieces]
    for w in works:
        w.wait()
    if rank == 0:
        raw.recv([reply], peer, tags[1]).wait()
    else:
        raw.send([reply], peer, tags[1]).wait()


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (no display), imported only when a chart is
    drawn: a benchmark that draws none does not pay for it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_chart(fig: Any, path: Path, dpi: int = 110) -> None:
    """Write ``fig`` as a PNG at ``path`` and free it."""
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=dpi)
    pyplot().close(fig)
