"""systemd integration: sd_notify over real sockets, the unit file, and the example config."""

from __future__ import annotations

import math
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from understudy.common import config, env
from understudy.daemon.sdnotify import SYSTEMD_ENV, Notifier

SYSTEMD_DIR = Path(__file__).resolve().parents[2] / "systemd"
UNIT = SYSTEMD_DIR / "understudyd.service"
EXAMPLE_CONFIG = SYSTEMD_DIR / "understudyd.toml.example"
EXEC_START = "/usr/local/bin/understudyd --config /etc/understudy/understudyd.toml"
#: Time the daemon needs after its drain and its workers' stop grace: close the socket, revoke
#: the lease, flush logs.
STOP_MARGIN_S = 10.0


# --- sd_notify ------------------------------------------------------------------------------


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """A datagram socket bound where systemd's would be, and its $NOTIFY_SOCKET value."""
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(5)
        yield sock, str(path)


def _received(sock: socket.socket) -> str:
    return sock.recv(4096).decode()


def test_each_message_arrives_as_one_datagram(receiver: tuple[socket.socket, str]) -> None:
    sock, address = receiver
    notifier = Notifier.from_env({env.NOTIFY_SOCKET: address})
    assert notifier.enabled

    assert notifier.ready("joined etcd as gpu-node-017")
    assert notifier.status("active, 8 workers")
    assert notifier.watchdog()
    assert notifier.extend_timeout(65)
    assert notifier.stopping("draining")
    assert notifier.ready()

    assert [_received(sock) for _ in range(6)] == [
        "READY=1\nSTATUS=joined etcd as gpu-node-017",
        "STATUS=active, 8 workers",
        "WATCHDOG=1",
        "EXTEND_TIMEOUT_USEC=65000000",
        "STOPPING=1\nSTATUS=draining",
        "READY=1",
    ]


def test_abstract_namespace_socket() -> None:
    name = f"understudy-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        notifier = Notifier.from_env({env.NOTIFY_SOCKET: "@" + name})
        assert notifier.ready()
        assert notifier.watchdog()
        assert [_received(sock) for _ in range(2)] == ["READY=1", "WATCHDOG=1"]


def test_messages_come_from_the_calling_process(receiver: tuple[socket.socket, str]) -> None:
    # NotifyAccess=main: systemd accepts a message only if its sender credentials name the main
    # PID, so the datagram must be sent by this process itself, not by a helper.
    sock, address = receiver
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    ucred = struct.Struct("iII")
    assert Notifier.from_env({env.NOTIFY_SOCKET: address}).watchdog()
    data, ancdata, _, _ = sock.recvmsg(4096, socket.CMSG_SPACE(ucred.size))
    assert data == b"WATCHDOG=1"
    creds = [
        ucred.unpack(cdata[: ucred.size])
        for level, kind, cdata in ancdata
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS
    ]
    assert creds and creds[0][0] == os.getpid()


def test_status_text_stays_on_one_line(receiver: tuple[socket.socket, str]) -> None:
    sock, address = receiver
    notifier = Notifier.from_env({env.NOTIFY_SOCKET: address})
    assert notifier.status("draining\nREADY=1\n")
    assert _received(sock) == "STATUS=draining READY=1"


@pytest.mark.parametrize(
    "environ",
    [
        {},
        {env.NOTIFY_SOCKET: ""},
        {env.NOTIFY_SOCKET: "relative.sock"},
        {env.NOTIFY_SOCKET: "@"},
        {env.NOTIFY_SOCKET: "vsock:2:1234"},
    ],
    ids=["unset", "empty", "relative", "bare-at", "vsock"],
)
def test_without_a_usable_notify_socket_every_call_is_a_no_op(environ: dict[str, str]) -> None:
    notifier = Notifier.from_env(environ)
    assert not notifier.enabled
    assert notifier.ready("x") is False
    assert notifier.status("x") is False
    assert notifier.watchdog() is False
    assert notifier.extend_timeout(1) is False
    assert notifier.stopping() is False


def test_send_failures_return_false(tmp_path: Path) -> None:
    nobody = tmp_path / "missing.sock"
    assert Notifier.from_env({env.NOTIFY_SOCKET: str(nobody)}).ready() is False

    # A socket file whose owner has gone: ECONNREFUSED.
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(stale))
    assert stale.exists()
    assert Notifier.from_env({env.NOTIFY_SOCKET: str(stale)}).watchdog() is False


def test_a_full_receiver_queue_drops_the_message_instead_of_blocking(
    receiver: tuple[socket.socket, str],
) -> None:
    _, address = receiver  # never read: its queue fills up
    notifier = Notifier.from_env({env.NOTIFY_SOCKET: address})
    start = time.monotonic()
    results = []
    for _ in range(100_000):
        results.append(notifier.watchdog())
        if not results[-1]:
            break
    assert results[0] is True
    assert results[-1] is False, "the receiver's queue never filled"
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("seconds", [0, -1, math.nan, math.inf])
def test_extend_timeout_rejects_a_meaningless_duration(seconds: float) -> None:
    with pytest.raises(ValueError, match="extend_timeout"):
        Notifier.from_env({env.NOTIFY_SOCKET: "/nonexistent"}).extend_timeout(seconds)


@pytest.mark.parametrize(
    ("usec", "pid", "expected"),
    [
        ("30000000", None, 15.0),
        ("30000000", "self", 15.0),
        ("30000000", "other", None),
        ("1000", None, 0.0005),
        (None, None, None),
        ("0", None, None),
        ("-5", None, None),
        ("30s", None, None),
        ("", None, None),
        (None, "self", None),
    ],
)
def test_watchdog_interval(usec: str | None, pid: str | None, expected: float | None) -> None:
    environ = {}
    if usec is not None:
        environ[env.WATCHDOG_USEC] = usec
    if pid == "self":
        environ[env.WATCHDOG_PID] = str(os.getpid())
    elif pid == "other":
        environ[env.WATCHDOG_PID] = str(os.getpid() + 1)
    assert Notifier.from_env(environ).watchdog_interval() == expected


def test_children_are_told_which_variables_to_drop() -> None:
    assert set(SYSTEMD_ENV) == {env.NOTIFY_SOCKET, env.WATCHDOG_USEC, env.WATCHDOG_PID}


# --- the unit file --------------------------------------------------------------------------


def _directives(text: str) -> dict[str, dict[str, list[str]]]:
    """Section -> key -> values, in order (keys such as After= may repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"directive outside a section: {line!r}"
        key, sep, value = line.partition("=")
        assert sep, f"not KEY=VALUE: {line!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


_UNITS_S = {"us": 1e-6, "ms": 1e-3, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hr": 3600}


def _timespan(value: str) -> float:
    """Seconds in a systemd time span such as ``90s``, ``1min 30s`` or ``90`` (seconds)."""
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value)
    assert parts and re.fullmatch(r"(\s*\d+(\.\d+)?\s*[a-z]*)+\s*", value), value
    return sum(float(number) * _UNITS_S[unit or "s"] for number, unit in parts)


def _service() -> dict[str, list[str]]:
    return _directives(UNIT.read_text())["Service"]


def test_unit_runs_the_daemon_as_a_notify_service_that_drains_on_stop() -> None:
    service = _service()
    assert service["ExecStart"] == [EXEC_START]
    assert service["Type"] == ["notify"]
    assert service["NotifyAccess"] == ["main"]
    assert service["KillMode"] == ["mixed"]
    assert service["Restart"] == ["on-failure"]
    assert service["LimitMEMLOCK"] == ["infinity"]
    assert _timespan(service["WatchdogSec"][0]) > 0


@pytest.mark.parametrize(
    "directive",
    [
        "PrivateDevices",
        "DevicePolicy",
        "DeviceAllow",
        "ProtectClock",
        "MemoryDenyWriteExecute",
        "SystemCallFilter",
    ],
)
def test_unit_keeps_gpus_rdma_and_jit_reachable_for_workers(directive: str) -> None:
    # Each of these is inherited by the training workers and breaks CUDA, RDMA or JIT compilers
    # (the unit's comments say how).
    assert directive not in _service()


def test_unit_takes_away_what_no_training_job_needs() -> None:
    """The security review's systemd section: the kernel log (Xids come from NVML), the host
    name, the 32-bit system call ABIs and capabilities no job uses are out; those that GPUs,
    RDMA, containers and profilers use stay."""
    service = _service()
    assert service["ProtectKernelLogs"] == ["yes"] and service["ProtectHostname"] == ["yes"]
    assert service["SystemCallArchitectures"] == ["native"]
    dropped = {cap for line in service["CapabilityBoundingSet"]
               for cap in line.removeprefix("~").split()}
    assert all(line.startswith("~") for line in service["CapabilityBoundingSet"])
    assert {"CAP_SYS_BOOT", "CAP_SYS_TIME", "CAP_SYS_MODULE", "CAP_SYSLOG"} <= dropped
    assert not dropped & {"CAP_SYS_ADMIN", "CAP_SYS_PTRACE", "CAP_NET_ADMIN", "CAP_NET_RAW",
                          "CAP_IPC_LOCK", "CAP_MKNOD", "CAP_BPF", "CAP_SYS_RESOURCE"}

def test_example_config_loads_and_fits_the_unit() -> None:
    cfg = config.load(EXAMPLE_CONFIG, environ={})
    assert len(cfg.etcd.endpoints) == 3
    service = _service()
    stop_timeout = _timespan(service["TimeoutStopSec"][0])
    needed = cfg.drain.deadline + cfg.drain.stop_grace + STOP_MARGIN_S
    assert needed <= stop_timeout, (
        f"TimeoutStopSec={stop_timeout:g}s leaves no room for drain.deadline "
        f"({cfg.drain.deadline:g}s) + drain.stop_grace ({cfg.drain.stop_grace:g}s) + "
        f"{STOP_MARGIN_S:g}s: systemd would SIGKILL the node mid-drain"
    )
    assert Path("/run", *service["RuntimeDirectory"]) == cfg.run_dir


# --- systemd-analyze verify ------------------------------------------------------------------

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_systemd_analyze = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None,
    reason="systemd-analyze is not installed (apt-get install systemd): unit file not verified",
)


def _verifiable_unit(tmp_path: Path, text: str | None = None) -> Path:
    """A copy of the unit whose ExecStart points at the installed console script.

    verify refuses an ExecStart binary that does not exist, and /usr/local/bin/understudyd is
    not installed on a development machine; nothing else in the unit is changed.
    """
    daemon = Path(sys.prefix) / "bin" / "understudyd"
    if not os.access(daemon, os.X_OK):
        pytest.skip(f"{daemon} is not installed (pip install -e .): unit file not verified")
    text = UNIT.read_text() if text is None else text
    text, count = re.subn(
        r"^ExecStart=/usr/local/bin/understudyd ", f"ExecStart={daemon} ", text, flags=re.M
    )
    assert count == 1
    copy = tmp_path / UNIT.name
    copy.write_text(text)
    return copy


def _verify(unit: Path) -> list[str]:
    """Problems ``systemd-analyze verify`` reports for ``unit``: its lines that name the unit,
    plus its exit status when that is not 0.

    Unknown directives and unparsable values are logged warnings ("..., ignoring.") that plain
    verify does not count as errors; --recursive-errors=no (systemd >= 250) makes them fail the
    exit status while ignoring problems in the host's other units (network-online.target...).
    """
    assert SYSTEMD_ANALYZE is not None
    help_text = subprocess.run(
        [SYSTEMD_ANALYZE, "--help"], capture_output=True, text=True, timeout=30, check=False
    ).stdout
    args = [SYSTEMD_ANALYZE, "verify", "--man=no"]
    if "--recursive-errors" in help_text:
        args.append("--recursive-errors=no")
    proc = subprocess.run(
        [*args, str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=unit.parent,
        # An inherited quieter level would hide exactly the warnings this test looks for.
        env={**os.environ, "SYSTEMD_LOG_LEVEL": "info", "SYSTEMD_LOG_COLOR": "0"},
    )
    output = proc.stdout + proc.stderr
    problems = [line for line in output.splitlines() if unit.name in line]
    if proc.returncode != 0:
        problems.append(f"exit status {proc.returncode}" + ("" if problems else f": {output}"))
    return problems


@needs_systemd_analyze
def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    assert _verify(_verifiable_unit(tmp_path)) == []


@needs_systemd_analyze
@pytest.mark.parametrize(
    ("good", "bad"),
    [
        ("KillMode=mixed", "KillMod=mixed"),
        ("Type=notify", "Type=notfiy"),
        ("TimeoutStopSec=90s", "TimeoutStopSec=90 parsecs"),
        ("[Service]", "[Servic]"),
    ],
    ids=["misspelled-directive", "bad-value", "bad-timespan", "misspelled-section"],
)
def test_systemd_analyze_verify_rejects_a_broken_unit(tmp_path: Path, good: str, bad: str) -> None:
    # Proves the check above can fail: the same copy, one line broken.
    text = UNIT.read_text()
    assert re.search(rf"^{re.escape(good)}$", text, flags=re.M)
    broken = re.sub(rf"^{re.escape(good)}$", bad, text, count=1, flags=re.M)
    assert _verify(_verifiable_unit(tmp_path, broken))
