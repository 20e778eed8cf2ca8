"""Failpoints (``common/failpoints.py``): the spec is parsed strictly, an armed point fires once
per process, ``exit`` ends a real process at exactly that point, and nothing is armed unless
the daemon's configuration enables failpoints (a stray variable logs one warning)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from understudy.common import env, failpoints


def test_specs_parse_and_bad_ones_name_the_culprit() -> None:
    armed = failpoints.parse(" a.b=sleep(0.5); c-d=exit(3) ;e=raise; f=3*raise")
    assert {k: str(v) for k, v in armed.items()} == {"a.b": "sleep(0.5)", "c-d": "exit(3)",
                                                     "e": "raise", "f": "3*raise"}
    assert failpoints.parse("") == {}
    for bad, words in (("a.b", "not name=action"), ("A=sleep(1)", "not name=action"),
                       ("a=kill(1)", "not sleep(S), exit(N) or raise"), ("a=exit(1.5)", "whole"),
                       ("a=sleep(1);a=exit(1)", "armed twice"), ("a=sleep(-1)", "sleep(S)"),
                       ("a=0*raise", "N* before it"), ("a=*raise", "N* before it")):
        with pytest.raises(failpoints.FailpointError, match=words.replace("(", r"\(")
                           .replace(")", r"\)")):
            failpoints.parse(bad)


def test_an_armed_point_fires_once_and_others_do_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.FAILPOINTS_ENABLED, "1")  # as a daemon with failpoints on says
    monkeypatch.setenv(env.FAILPOINTS, "here=sleep(0.3)")
    monkeypatch.setattr(failpoints, "_armed", None)
    t0 = time.monotonic()
    failpoints.hit("elsewhere")
    assert time.monotonic() - t0 < 0.1
    failpoints.hit("here")
    assert time.monotonic() - t0 >= 0.3
    t1 = time.monotonic()
    failpoints.hit("here")  # fired already
    assert time.monotonic() - t1 < 0.1
    monkeypatch.setenv(env.FAILPOINTS, "bug=raise")
    monkeypatch.setattr(failpoints, "_armed", None)
    with pytest.raises(failpoints.FailpointFired, match="failpoint bug"):
        failpoints.hit("bug")
    failpoints.hit("bug")
    monkeypatch.setenv(env.FAILPOINTS, "bug=3*raise")  # the first three hits
    monkeypatch.setattr(failpoints, "_armed", None)
    for _ in range(3):
        with pytest.raises(failpoints.FailpointFired, match="failpoint bug"):
            failpoints.hit("bug")
    failpoints.hit("bug")



def test_an_awaited_point_sleeps_its_caller_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ahit`` (the daemon's event loop): a sleep suspends the coroutine that hit it while the
    loop's other tasks run on; raise acts as in ``hit``."""
    monkeypatch.setenv(env.FAILPOINTS_ENABLED, "1")
    monkeypatch.setenv(env.FAILPOINTS, "daemon.spawn=sleep(0.3);daemon.bug=raise")
    monkeypatch.setattr(failpoints, "_armed", None)

    async def run() -> tuple[float, int]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        ticker = asyncio.create_task(tick())
        t0 = time.monotonic()
        await failpoints.ahit("daemon.spawn")
        took = time.monotonic() - t0
        ticker.cancel()
        with pytest.raises(failpoints.FailpointFired):
            await failpoints.ahit("daemon.bug")
        await failpoints.ahit("daemon.spawn")  # fired already
        return took, ticks

    took, ticks = asyncio.run(run())
    assert took >= 0.3 and ticks >= 10, (took, ticks)

def test_exit_ends_the_process_at_that_point() -> None:
    code = ("from understudy.common import failpoints\n"
            "print('before', flush=True)\n"
            "failpoints.hit('boom')\n"
            "print('after', flush=True)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={env.FAILPOINTS: "boom=exit(7)", env.FAILPOINTS_ENABLED: "1",
                               "PATH": ""}, timeout=60)
    assert done.returncode == 7
    assert done.stdout.startswith("before\n") and "after" not in done.stdout
    assert "failpoint boom fired: exit(7)" in done.stdout + done.stderr


@pytest.mark.parametrize("enabled", [None, "0", "yes"])
def test_without_the_daemons_word_the_variable_arms_nothing_and_says_so_once(
        enabled: str | None) -> None:
    """A worker started by a daemon whose configuration leaves failpoints off (``"0"``), or a
    process no daemon started: the variable is ignored, with one warning, however often the
    points are hit."""
    code = ("from understudy.common import failpoints\n"
            "assert failpoints.check() == {}\n"
            "for _ in range(3):\n"
            "    failpoints.hit('boom')\n"
            "print('survived', flush=True)\n")
    child_env = {env.FAILPOINTS: "boom=exit(7)", "PATH": ""}
    if enabled is not None:
        child_env[env.FAILPOINTS_ENABLED] = enabled
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=child_env, timeout=60)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "survived" in done.stdout and "fired" not in out
    warnings = [line for line in out.splitlines() if "UNDERSTUDY_FAILPOINTS is set" in line]
    assert len(warnings) == 1, out
    assert "failpoints are not enabled by the daemon that started this process" in warnings[0]


def test_the_daemons_configuration_decides_for_the_daemon(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``configure`` (what understudyd calls at start) wins over the workers' variable, which
    the daemon's own environment might carry too; a malformed spec matters only when enabled."""
    monkeypatch.setenv(env.FAILPOINTS_ENABLED, "1")
    monkeypatch.setenv(env.FAILPOINTS, "controller.round=raise")
    monkeypatch.setattr(failpoints, "_armed", None)
    assert failpoints.configure(False, "this daemon's configuration (failpoints_enabled)") == {}
    failpoints.hit("controller.round")  # nothing fires
    err = capsys.readouterr()
    assert "failpoints are not enabled by this daemon's configuration" in err.out + err.err
    assert set(failpoints.configure(True, "config")) == {"controller.round"}
    with pytest.raises(failpoints.FailpointFired):
        failpoints.hit("controller.round")
    monkeypatch.setenv(env.FAILPOINTS, "nonsense")
    assert failpoints.configure(False, "config") == {}
    with pytest.raises(failpoints.FailpointError, match="not name=action"):
        failpoints.configure(True, "config")
