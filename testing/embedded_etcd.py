"""An etcd member on loopback, for the local demo, the tests and the benchmarks.

It runs Debian's ``etcd`` binary with a private data directory and fast raft timings, and is
ready when its ``/health`` endpoint says so (etcdctl's first dial backs off for about a second).
By default it is a cluster of its own; with ``name`` and ``initial_cluster`` it is one member of
a larger one (tests/integration/etcd_members.py starts three). Production clusters run their
own 3- or 5-member etcd; the daemon only needs its endpoints.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from understudy.common.errors import UnderstudyError


class EtcdStartError(UnderstudyError):
    """The embedded etcd could not be started."""


#: The ports ``free_port`` hands out: from here up to the kernel's ephemeral range, which
#: ``bind(host, 0)`` and outgoing connections draw from. A port of this pool is taken only by
#: another ``free_port`` caller, and those share one counter (a file in the temp directory,
#: updated under a lock), so parallel test workers, concurrent test sessions and demos get
#: different ports, and a port comes round again only after the whole pool has been handed out.
_POOL_LOW = 20000
_POOL_COUNTER = Path(tempfile.gettempdir()) / "understudy-free-ports"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing holds on ``host``, that no other ``free_port`` caller on this machine
    will be given soon (the pool above). Where the pool cannot be used (its counter file is not
    writable, or the ephemeral range starts too low), the kernel's pick of a free port, which
    another process may bind before the caller does (``EmbeddedEtcd.start`` then retries)."""
    high = _ephemeral_low()
    if high - _POOL_LOW >= 1000:
        with contextlib.suppress(OSError):
            return _from_pool(host, _POOL_LOW, high)
    return _kernel_pick(host)


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _from_pool(host: str, low: int, high: int) -> int:
    size = high - low
    fd = os.open(_POOL_COUNTER, os.O_RDWR | os.O_CREAT, 0o666)
    with os.fdopen(fd, "r+") as counter:
        fcntl.flock(counter, fcntl.LOCK_EX)  # released when the file closes
        try:
            turn = int(counter.read().strip() or 0)
        except ValueError:
            turn = 0
        for i in range(size):
            port = low + (turn + i) % size
            if _bindable(host, port):  # skips what a service or a lingering process holds
                counter.seek(0)
                counter.truncate()
                counter.write(str((turn + i + 1) % size))
                return port
    raise OSError(f"no free port from {low} to {high - 1} on {host}")


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def _kernel_pick(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class TlsFiles:
    ca: Path
    server_cert: Path
    server_key: Path


@dataclass
class EmbeddedEtcd:
    """One etcd member. ``start()`` blocks until it is healthy; ``stop()`` kills it.

    ``initial_cluster`` (etcd's ``NAME=PEER_URL,...``) must name this member with its
    ``peer_url``; left empty, the member is the whole cluster. A member of a larger cluster is
    healthy only once a quorum runs, so its peers are started with ``launch()`` and waited for
    with ``wait_healthy()``; its peer port must be fixed before any of them starts."""

    data_dir: Path | None = None
    name: str = "default"
    initial_cluster: str = ""
    host: str = "127.0.0.1"
    client_port: int = 0
    peer_port: int = 0
    metrics_port: int = 0
    #: raft timings in milliseconds; fast ones suit a lone member (it never holds an election
    #: against a peer), a cluster on a loaded machine needs slack against spurious elections
    heartbeat_ms: int = 10
    election_ms: int = 100
    tls: TlsFiles | None = None
    log_path: Path | None = None
    extra_args: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    _own_dir: bool = False

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def start(self, timeout: float = 15.0) -> EmbeddedEtcd:
        """Start and wait until healthy. Ports left at 0 are picked free here; if another
        process binds one of them before etcd does (the pick cannot reserve it), etcd exits
        with "address already in use" and is started again on fresh picks (3 tries)."""
        picked = [n for n in ("client_port", "peer_port", "metrics_port") if not getattr(self, n)]
        for attempt in range(3):
            try:
                return self._start(timeout)
            except EtcdStartError as exc:
                if not picked or "address already in use" not in str(exc) or attempt == 2:
                    raise
                for name in picked:
                    setattr(self, name, 0)
        raise AssertionError("unreachable")

    def _start(self, timeout: float) -> EmbeddedEtcd:
        self.launch()
        self.wait_healthy(timeout)
        return self

    def launch(self) -> None:
        """Start the server without waiting for it (ports left at 0 are picked free here)."""
        binary = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd")
                                          else None)
        if binary is None:
            raise EtcdStartError(
                "the etcd server is not installed: run `apt-get install etcd-server`"
            )
        if self.data_dir is None:
            self.data_dir = Path(tempfile.mkdtemp(prefix="understudy-etcd-"))
            self._own_dir = True
        self.client_port = self.client_port or free_port(self.host)
        self.peer_port = self.peer_port or free_port(self.host)
        self.metrics_port = self.metrics_port or free_port(self.host)
        client_url = f"{self.scheme}://{self.host}:{self.client_port}"
        args = [
            binary,
            "--name", self.name,
            "--data-dir", str(self.data_dir / "member-data"),
            "--listen-client-urls", client_url,
            "--advertise-client-urls", client_url,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", self.initial_cluster or f"{self.name}={self.peer_url}",
            "--listen-metrics-urls", f"http://{self.host}:{self.metrics_port}",
            f"--heartbeat-interval={self.heartbeat_ms}",
            f"--election-timeout={self.election_ms}",
            "--logger=zap",
            "--log-outputs=stderr",
        ]
        if self.tls is not None:
            args += [
                "--cert-file", str(self.tls.server_cert),
                "--key-file", str(self.tls.server_key),
                "--trusted-ca-file", str(self.tls.ca),
                "--client-cert-auth",
            ]
        args += self.extra_args
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=log,
                                         start_new_session=True)

    @property
    def log_file(self) -> Path:
        assert self.data_dir is not None, "the member has no data directory before launch()"
        return self.log_path or self.data_dir / "etcd.log"

    def wait_healthy(self, timeout: float) -> None:
        """Wait until the launched server is healthy; raises EtcdStartError (the log's tail
        included) if it exits first, or kills it and raises if ``timeout`` passes."""
        assert self.proc is not None, "wait_healthy() before launch()"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_file.read_text(errors="replace")[-2000:]
                raise EtcdStartError(f"etcd exited with code {self.proc.returncode}: {tail}")
            if self.healthy():
                return
            time.sleep(0.02)
        self.stop()
        raise EtcdStartError(f"etcd did not become healthy within {timeout}s")

    def healthy(self) -> bool:
        # The metrics listener serves /health over plain HTTP even when clients use TLS.
        url = f"http://{self.host}:{self.metrics_port}/health"
        try:
            with urllib.request.urlopen(url, timeout=0.5) as resp:
                return bool(json.loads(resp.read()).get("health") in ("true", True))
        except (OSError, ValueError, urllib.error.URLError, ssl.SSLError):
            return False

    def stop(self) -> None:
        """Kill the server (SIGKILL: tests want an abrupt loss). Data stays for restart()."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def pause(self, timeout: float = 5.0) -> None:
        """Freeze the server (SIGSTOP: alive, silent) and return once every one of its threads
        has stopped. ``kill`` returns before that: the thread chosen to take the signal starts
        the group stop when it next runs, and until then another thread (the poller woken by a
        request) can still answer one; on a loaded machine it did (a keep-alive sent after the
        SIGSTOP came back answered)."""
        assert self.proc is not None, "pause() of a server that is not running"
        os.killpg(self.proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + timeout
        tasks = Path(f"/proc/{self.proc.pid}/task")
        while True:
            states = []
            for stat in tasks.glob("*/stat"):
                with contextlib.suppress(OSError):  # a thread that ended meanwhile
                    states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
            if states and all(s in ("T", "t") for s in states):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"etcd did not stop within {timeout} s: {states}")
            time.sleep(0.001)

    def resume(self) -> None:
        """Let a paused server run again (SIGCONT)."""
        assert self.proc is not None, "resume() of a server that is not running"
        os.killpg(self.proc.pid, signal.SIGCONT)

    def restart(self, timeout: float = 15.0) -> None:
        """Start again on the same ports and data (an etcd restart, not a new cluster)."""
        self.stop()
        self.start(timeout)

    def cleanup(self) -> None:
        """Stop, then free the disk: etcd preallocates 64 MiB write-ahead-log segments (two at
        once, 128 MiB a member), which a test suite of a hundred servers kept in pytest's
        retained directories turns into gigabytes. The log stays for a failure's diagnosis
        unless the directory was made here."""
        self.stop()
        if self.data_dir is None:
            return
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        else:
            shutil.rmtree(self.data_dir / "member-data", ignore_errors=True)

    def __enter__(self) -> EmbeddedEtcd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
