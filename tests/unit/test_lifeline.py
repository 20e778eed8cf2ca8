"""A worker dies with its daemon: real processes, a real SIGKILL of the parent."""

from __future__ import annotations

import signal
import subprocess
import sys

import psutil
import pytest

from tests.integration.scenarios import wait_gone
from understudy.common import env
from understudy.worker.lifeline import LifelineError, tie_to_daemon

CHILD = ("import time; from understudy.worker.lifeline import tie_to_daemon; "
         "assert tie_to_daemon(); print('tied', flush=True); time.sleep(120)")
# The "daemon": starts the worker with its own pid in the environment, says the worker's pid,
# and waits.
PARENT = ("import os, subprocess, sys, time; "
          f"p = subprocess.Popen([sys.executable, '-c', {CHILD!r}], "
          f"env={{**os.environ, {env.DAEMON_PID!r}: str(os.getpid())}}); "
          "print(p.pid, flush=True); time.sleep(120)")


def test_a_worker_is_killed_the_moment_its_daemon_dies() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "tied"  # the child's output, inherited
        assert psutil.pid_exists(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        wait_gone([child], timeout=5)
    finally:
        parent.kill()
        parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()


def test_a_worker_whose_daemon_is_already_gone_refuses_to_start(
        monkeypatch: pytest.MonkeyPatch) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    monkeypatch.setenv(env.DAEMON_PID, str(dead.pid))
    with pytest.raises(LifelineError, match=f"pid {dead.pid}.*is gone"):
        tie_to_daemon()
    monkeypatch.setenv(env.DAEMON_PID, "not-a-pid")
    with pytest.raises(LifelineError, match="not a pid"):
        tie_to_daemon()


def test_outside_a_daemon_nothing_is_tied(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(env.DAEMON_PID, raising=False)
    assert tie_to_daemon() is False
