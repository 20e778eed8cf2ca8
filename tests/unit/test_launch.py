"""The worker's start-up runs with the cyclic garbage collector paused, and leaves it as the
script had it."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from understudy.worker.launch import _collector_paused


@pytest.fixture(autouse=True)
def _restore_collector() -> Iterator[None]:
    enabled = gc.isenabled()
    yield
    if enabled:
        gc.enable()
    else:
        gc.disable()


def test_the_collector_is_paused_inside_and_running_again_after() -> None:
    gc.enable()
    with _collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_failing_start_up_turns_the_collector_back_on() -> None:
    gc.enable()
    with pytest.raises(RuntimeError, match="build failed"), _collector_paused():
        raise RuntimeError("build failed")
    assert gc.isenabled()


def test_a_script_that_turned_the_collector_off_keeps_it_off() -> None:
    gc.disable()
    with _collector_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()
