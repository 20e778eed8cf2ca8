"""Real daemons as separate processes on one machine, around one etcd.

Used by the demo (``scripts/demo``), the end-to-end tests and the benchmarks. Each daemon is a
real ``understudyd`` process with its own run directory, metrics port and log file.

Two settings differ from a production daemon's defaults, both for the harness's sake and both
visible in each daemon's command line: failpoints are enabled (``--enable-failpoints``: fault
tests arm them through a daemon's environment, ``add(env=...)``), and the workers' socket
admits the harness's own group (``--socket-group``, the effective group of the process that
builds the cluster), so that a test or a demo can talk to a daemon's socket as its workers do.
Pass ``failpoints=False`` or ``socket_group=""`` for daemons as production runs them.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from understudy.cli.cluster import ClusterStatus, read_cluster, read_events
from understudy.common import config as config_mod
from understudy.common.config import EtcdConfig
from understudy.common.errors import RecordError, StoreError, UnderstudyError
from understudy.common.keys import Keys
from understudy.common.records import Event, NodeRecord, RegistryEntry
from understudy.common.store import EtcdStore

T = TypeVar("T")


class ClusterTimeout(UnderstudyError):
    """A local-cluster condition did not become true in time."""


class _LogFiles:
    """The text of log files that only grow, each byte read once: a call reads what was
    appended since the last (a file replaced or truncated is read afresh; one gone is empty).
    Tests poll the logs up to twenty times a second while they wait; reading every file whole
    each time kept a core busy through a long wait."""

    def __init__(self) -> None:
        self._files: dict[Path, tuple[int, int, str, codecs.IncrementalDecoder]] = {}
        self._lock = threading.Lock()

    def text(self, path: Path) -> str:
        with self._lock:
            try:
                with open(path, "rb") as f:
                    st = os.fstat(f.fileno())
                    known = self._files.get(path)
                    if known is None or known[0] != st.st_ino or st.st_size < known[1]:
                        known = (st.st_ino, 0, "",
                                 codecs.getincrementaldecoder("utf-8")(errors="replace"))
                    ino, size, text, decoder = known
                    f.seek(size)
                    new = f.read()
            except OSError:  # not there yet, or rotated away meanwhile
                self._files.pop(path, None)
                return ""
            text += decoder.decode(new)
            self._files[path] = (ino, size + len(new), text, decoder)
            return text


@dataclass
class DaemonProcess:
    name: str
    argv: list[str]
    run_dir: Path
    log_path: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    #: what was read of each log file: tests poll the logs many times a second
    _logs: _LogFiles = field(default_factory=lambda: _LogFiles(), repr=False)

    def start(self) -> DaemonProcess:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env, start_new_session=True)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(sig)

    def kill9(self) -> None:
        """kill -9 of the daemon and everything in its session (its workers): a node crash."""
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def log_text(self) -> str:
        """What the node logged: the daemon's own log, then its workers' (each process's file
        under ``<run_dir>/logs``, the default ``rank_logs.dir``: ``daemon/ranklogs.py``)."""
        parts = [self.daemon_log_text()]
        for f in sorted((self.run_dir / "logs").rglob("*.log*")):
            parts.append(self._logs.text(f))
        return "".join(p if p.endswith("\n") or not p else p + "\n" for p in parts)

    def daemon_log_text(self) -> str:
        """The daemon's own log alone."""
        return self._logs.text(self.log_path)

    @property
    def metrics_port(self) -> int:
        """The port the daemon's metrics endpoint bound (it asks the kernel for a free one, so
        no other process can take it between a choice and the bind), from its log."""
        for line in reversed(self.daemon_log_text().splitlines()):
            if '"Metrics endpoint is up."' in line:
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    return int(json.loads(line)["port"])
        raise UnderstudyError(f"{self.name} has not logged its metrics port (yet)")


async def _entries_match_records(store: EtcdStore, keys: Keys) -> bool:
    """Whether every node record's state and incarnation are in its registry entry."""
    records, _ = await store.get_prefix(keys.nodes)
    entries = {kv.key: kv.value for kv in (await store.get_prefix(keys.registry))[0]}
    for kv in records:
        name = Keys.name_of(kv.key, keys.nodes)
        value = entries.get(keys.registry_entry(name))
        try:
            rec = NodeRecord.decode(kv.value)
            entry = RegistryEntry.decode(value) if value is not None else None
        except RecordError:
            return False
        if entry is None or (entry.state, entry.incarnation) != (rec.state, rec.incarnation):
            return False
    return True


@dataclass
class LocalCluster:
    etcd_endpoint: str
    base_dir: Path
    prefix: str = "/understudy"
    lease_ttl: int = 3
    extra_args: Sequence[str] = ()
    python: str = sys.executable
    daemons: dict[str, DaemonProcess] = field(default_factory=dict)
    #: start the daemons with ``--enable-failpoints``
    failpoints: bool = True
    #: the ``--socket-group`` of the daemons ("": none, only their workers use the socket)
    socket_group: str = field(default_factory=lambda: str(os.getegid()))
    #: the harness's own etcd client and the event loop it lives on, kept across reads (a
    #: fresh connection per poll cost twice the CPU); dropped after an error, closed by
    #: :meth:`stop_all`
    _reader: tuple[asyncio.AbstractEventLoop, EtcdStore] | None = field(
        default=None, init=False, repr=False, compare=False)
    _reader_lock: threading.Lock = field(default_factory=threading.Lock, init=False,
                                         repr=False, compare=False)

    def daemon_argv(self, name: str, role: str, run_dir: Path,
                    extra: Sequence[str] = ()) -> list[str]:
        return [
            self.python, "-m", "understudy.daemon.main",
            "--node", name, "--etcd", self.etcd_endpoint, "--prefix", self.prefix,
            "--role", role, "--run-dir", str(run_dir),
            "--metrics-listen", "127.0.0.1:0", "--address", "127.0.0.1",
            "--lease-ttl", str(self.lease_ttl), "--log-format", "json",
            *(["--enable-failpoints"] if self.failpoints else []),
            *(["--socket-group", self.socket_group] if self.socket_group else []),
            *self.extra_args, *extra,
        ]

    def add(self, name: str, role: str = "active", extra: Sequence[str] = (),
            env: dict[str, str] | None = None, wrap: Sequence[str] = ()) -> DaemonProcess:
        """Start a daemon. ``wrap`` prefixes the command (e.g. ``ip netns exec NS``)."""
        run_dir = self.base_dir / name
        argv = [*wrap, *self.daemon_argv(name, role, run_dir, extra)]
        d = DaemonProcess(name=name, argv=argv, run_dir=run_dir,
                          log_path=self.base_dir / f"{name}.log",
                          env={**os.environ, **(env or {})})
        self.daemons[name] = d.start()
        return d

    def cli(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.python, "-m", "understudy.cli.main", "--etcd", self.etcd_endpoint,
             "--prefix", self.prefix, *args],
            capture_output=True, text=True, timeout=timeout,
        )

    def status(self) -> ClusterStatus:
        return self._read(read_cluster)

    def events(self) -> list[Event]:
        """Every event, oldest first, as ``understudy events`` shows them, read in this process
        (a test polling the events starts no CLI process each time)."""
        return self._read(read_events)[0]

    def kv_keys(self, job: str) -> list[str]:
        """The keys under the job's ``kv/<job>/`` (its groups' bootstrap namespaces, its
        migrations' reports...), relative to it, without their values."""

        async def read(store: EtcdStore, keys: Keys) -> list[str]:
            base = keys.kv(job)
            return [k.removeprefix(base) for k in await store.keys(base)]

        return self._read(read)

    def etcd_config(self) -> EtcdConfig:
        """How the harness's own reads (``status``, ``events``) reach etcd; a cluster behind TLS
        or a login says so here."""
        return config_mod.load(overrides={"etcd.endpoints": self.etcd_endpoint,
                                          "etcd.prefix": self.prefix},
                               environ={}, require_node=False).etcd

    def _read(self, read: Callable[[EtcdStore, Keys], Awaitable[T]]) -> T:
        """``read`` on the harness's own client, made on first use; any error drops it (an
        etcd restarted or cut off gets a fresh connection on the next read). A read that fails
        is tried once more on a fresh connection: it changes nothing, and a connection the
        server closed between two reads (a benchmark's harness once got GOAWAY from etcd while
        it waited a minute on log lines) must not end a run."""
        with self._reader_lock:
            for attempt in (1, 2):
                if self._reader is None:
                    loop = asyncio.new_event_loop()
                    self._reader = (loop, EtcdStore(self.etcd_config()))
                loop, store = self._reader
                try:
                    return loop.run_until_complete(read(store, Keys(self.prefix)))
                except StoreError:
                    self._close_reader()
                    if attempt == 2:
                        raise
                except BaseException:
                    self._close_reader()
                    raise
            raise AssertionError("unreachable")

    def _close_reader(self) -> None:
        if self._reader is None:
            return
        loop, store = self._reader
        self._reader = None
        with contextlib.suppress(Exception):
            loop.run_until_complete(store.close())
        loop.close()

    def wait_for(self, what: str, predicate: Callable[[ClusterStatus], bool],
                 timeout: float = 30.0, interval: float = 0.1) -> float:
        """Poll until ``predicate(status)`` holds; returns the seconds it took."""
        t0 = time.monotonic()
        last: ClusterStatus | None = None
        while time.monotonic() - t0 < timeout:
            try:
                last = self.status()
                if predicate(last):
                    return time.monotonic() - t0
            except StoreError:
                pass
            time.sleep(interval)
        states = {n.name: n.state for n in last.nodes} if last else "etcd unreachable"
        raise ClusterTimeout(f"timed out after {timeout}s waiting for {what}; states: {states}")

    def wait_settled(self, timeout: float = 30.0) -> None:
        """Wait for an idle cluster's start-up writes to end, so that a test comparing revisions
        across a refused command takes its first one after them: the controller writes its key,
        then its "controller-elected" event; a joining node writes its record, then its
        registry entry (a second write, which a loaded machine once put after the election's:
        every record's state and incarnation must be in its entry too)."""
        deadline = time.monotonic() + timeout
        while not any(e.kind == "controller-elected" for e in self.events()) or \
                not self._read(_entries_match_records):
            if time.monotonic() > deadline:
                raise ClusterTimeout(f"the cluster did not settle in {timeout}s")
            time.sleep(0.05)

    def wait_state(self, node: str, state: str, timeout: float = 30.0) -> float:
        return self.wait_for(
            f"{node} to be {state}",
            lambda s: (n := s.node(node)) is not None and n.state == state, timeout)

    def stop_all(self, timeout: float = 20.0, drain: bool = True) -> None:
        """Stop every daemon, SIGKILL to those still up after ``timeout`` seconds (0: at once).
        ``drain``: each first drains its node, as systemd's stop does; without it each gets a
        second signal, which skips the drain (a test's teardown: nothing is left to save)."""
        with self._reader_lock:
            self._close_reader()
        for d in self.daemons.values():
            if d.alive():
                d.signal(signal.SIGKILL if timeout <= 0 else signal.SIGTERM)
                if timeout > 0 and not drain:
                    d.signal(signal.SIGINT)  # another signal than the first: never merged
        deadline = time.monotonic() + max(timeout, 0.1)  # one for all: they stop side by side
        for d in self.daemons.values():
            if d.proc is not None:
                try:
                    d.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    d.kill9()
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(d.proc.pid, signal.SIGKILL)
