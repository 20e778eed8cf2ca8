"""Jittered retry waits (common/backoff.py): bounded, growing to the cap, spread over a fleet."""

from __future__ import annotations

import random
import statistics

import pytest

from understudy.common.backoff import Backoff


def test_each_wait_lies_between_half_its_bound_and_the_bound_which_doubles_up_to_the_cap() -> None:
    b = Backoff(first=0.1, cap=1.0, rng=random.Random(7))
    bounds = [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]
    for bound in bounds:
        assert bound / 2 <= b.next() <= bound
    b.reset()
    assert 0.05 <= b.next() <= 0.1
    # far past any float's range of doublings: still the cap
    b.attempt = 10_000
    assert 0.5 <= b.next() <= 1.0


def test_a_fleet_that_failed_at_the_same_instant_retries_spread_out() -> None:
    # 1,000 daemons whose calls failed together: a fixed wait would retry them together at
    # every attempt. With jitter, by the fifth retry they are spread over most of the cap.
    fleet = [Backoff(first=0.1, cap=1.0, rng=random.Random(seed)) for seed in range(1000)]
    at = [sum(b.next() for _ in range(5)) for b in fleet]
    assert max(at) - min(at) > 0.8
    assert statistics.pstdev(at) > 0.15
    # and no daemon came back in less than half the waits' bounds
    assert min(at) >= (0.1 + 0.2 + 0.4 + 0.8 + 1.0) / 2


@pytest.mark.parametrize(("first", "cap"), [(0.0, 1.0), (-1.0, 1.0), (2.0, 1.0)])
def test_a_backoff_that_cannot_wait_is_refused(first: float, cap: float) -> None:
    with pytest.raises(ValueError, match="0 < first <= cap"):
        Backoff(first=first, cap=cap)
