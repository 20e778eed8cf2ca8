"""Helpers for the end-to-end migration scenarios (plain and Megatron jobs alike): a local
cluster of real daemons, and ways to watch its workers and events."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from understudy.testing.embedded_etcd import EmbeddedEtcd
from understudy.testing.localcluster import DaemonProcess, LocalCluster


def start(etcd: EmbeddedEtcd | str, base: Path, active: dict[str, int],
          standby: tuple[str, ...], extra: tuple[str, ...] = (),
          env: dict[str, dict[str, str]] | None = None, leader: str | None = None
          ) -> LocalCluster:
    """Daemons for ``active`` (name -> slots) and ``standby`` nodes, around ``etcd`` (a server,
    or the endpoints ``--etcd`` takes); ``env[name]`` is added to that daemon's environment
    (and so to its workers'). ``leader``: an active node started first and made the controller
    before the others start (a test that loses another node then measures no election)."""
    env = env or {}
    endpoints = etcd if isinstance(etcd, str) else etcd.endpoint
    c = LocalCluster(etcd_endpoint=endpoints, base_dir=base)
    for n, slots in sorted(active.items(), key=lambda item: item[0] != leader):
        c.add(n, "active", extra=["--slots", str(slots), *extra], env=env.get(n))
        if n == leader:
            c.wait_for(f"{n} to lead", lambda s: s.controller == leader)
    for n in standby:
        c.add(n, "standby", extra=list(extra), env=env.get(n))
    for n in active:
        c.wait_state(n, "active")
    for n in standby:
        c.wait_state(n, "standby")
    c.wait_for("a controller", lambda s: s.controller is not None)
    return c


def assert_no_tracebacks(c: LocalCluster) -> None:
    """No daemon of ``c`` logged a traceback (but for failpoints armed to raise)."""
    for name, d in c.daemons.items():
        lines = d.log_text().splitlines()
        unexpected = [i for i, line in enumerate(lines)
                      if "Traceback" in line and "failpoints.FailpointFired" not in line]
        if unexpected:
            # A JSON log line holds its whole traceback; a raw one (printed by Python itself,
            # not our logger) runs over the lines after it: show both, with what led up to it.
            first = unexpected[0]
            shown = "\n".join(line[-2000:] for line in lines[max(0, first - 3):first + 40])
            pytest.fail(f"{name} logged {len(unexpected)} traceback(s); the first:\n{shown}")


def wait_standbys(c: LocalCluster, nodes: tuple[str, ...], timeout: float = 90) -> None:
    """Until the standby worker on each of ``nodes`` reported itself warm (imports done, its
    holder up): only then does it look for plans. "Waiting to be chosen" comes earlier; on a
    loaded machine the imports after it took 11 s, past a test's 8 s migration timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(re.search(r"Standby worker of job \S+ is warm", c.daemons[n].log_text())
               for n in nodes):
            return
        time.sleep(0.1)
    raise AssertionError(f"standby workers on {nodes} never came up")


def worker_pid(d: DaemonProcess, child: str, timeout: float = 30.0) -> int:
    """The pid of the newest worker ``child`` (``mig.standby``, ``mig.r1``) of daemon ``d``,
    waiting up to ``timeout`` seconds for it to start (a node starts its ranks one after the
    other: a job that runs on every node may not run every rank yet)."""
    deadline = time.monotonic() + timeout
    while True:
        pids = [json.loads(line)["pid"] for line in d.daemon_log_text().splitlines()
                if f'"child": "{child}"' in line and "started with pid" in line]
        if pids:
            return int(pids[-1])
        assert time.monotonic() < deadline, f"{child} never started on {d.name}"
        time.sleep(0.05)


def local(pid: int) -> tuple[str | None, str | None]:
    """Worker ``pid``'s ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` (its slot on the node, and the
    node's slots), from its environment as the kernel holds it."""
    environ = psutil.Process(pid).environ()
    return environ.get("LOCAL_RANK"), environ.get("LOCAL_WORLD_SIZE")


def wait_gone(pids: list[int], timeout: float) -> None:
    """Wait until each of ``pids`` has exited (a zombie counts: nothing runs)."""
    def gone(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    deadline = time.monotonic() + timeout
    while not all(gone(p) for p in pids):
        assert time.monotonic() < deadline, f"still running after {timeout}s: " \
            f"{[p for p in pids if not gone(p)]}"
        time.sleep(0.02)


def faults_over(c: LocalCluster) -> Path:
    """The file that, once it exists, lets the cluster's job run out without its step sleep:
    a test creates it when nothing it waits for can happen any more (``_finish``)."""
    return c.base_dir / "faults-over"


def wait_log(d: DaemonProcess, text: str, timeout: float = 60, times: int = 1) -> None:
    """Wait until ``d``'s log holds ``text`` at least ``times`` times."""
    deadline = time.monotonic() + timeout
    while d.log_text().count(text) < times:
        assert time.monotonic() < deadline, f"{d.name} never logged {text!r} {times} time(s)"
        time.sleep(0.05)


def events(c: LocalCluster) -> list[dict[str, Any]]:
    """Every event of the cluster, oldest first, as ``understudy events --json`` prints them.
    Read in this process: tests poll it, and a CLI process each time kept a core busy."""
    return [{"time": e.time, "kind": e.kind, "node": e.node, "message": e.message,
             "details": e.details} for e in c.events()]
