"""Failpoints (``daemon/failpoints.py``): the spec is parsed strictly, an armed point fires once
per process, ``exit`` ends a real process at exactly that point."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from understudy.daemon import env, failpoints


def test_specs_parse_and_bad_ones_name_the_culprit() -> None:
    armed = failpoints.parse(" a.b=sleep(0.5); c-d=exit(3) ;e=raise")
    assert {k: str(v) for k, v in armed.items()} == {"a.b": "sleep(0.5)", "c-d": "exit(3)",
                                                     "e": "raise"}
    assert failpoints.parse("") == {}
    for bad, words in (("a.b", "not name=action"), ("A=sleep(1)", "not name=action"),
                       ("a=kill(1)", "not sleep(S), exit(N) or raise"), ("a=exit(1.5)", "whole"),
                       ("a=sleep(1);a=exit(1)", "armed twice"), ("a=sleep(-1)", "sleep(S)")):
        with pytest.raises(failpoints.FailpointError, match=words.replace("(", r"\(")
                           .replace(")", r"\)")):
            failpoints.parse(bad)


def test_an_armed_point_fires_once_and_others_do_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
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


def test_exit_ends_the_process_at_that_point() -> None:
    code = ("from understudy.daemon import failpoints\n"
            "print('before', flush=True)\n"
            "failpoints.hit('boom')\n"
            "print('after', flush=True)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={env.FAILPOINTS: "boom=exit(7)", "PATH": ""}, timeout=60)
    assert done.returncode == 7
    assert done.stdout.startswith("before\n") and "after" not in done.stdout
    assert "failpoint boom fired: exit(7)" in done.stdout + done.stderr
