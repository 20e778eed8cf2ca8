"""A volatile trace and what it costs, for the goodput benchmark: pure functions (no processes,
no clock), so that the schedule and the figures can be checked on their own.

- :func:`schedule`: a seeded list of interruptions at offsets from the start of the measured
  window, each a planned drain (with notice) or a crash (a rank's worker killed, no notice),
  the gaps between them drawn uniformly from ``[0.5, 1.5] x mean``.
- :func:`goodput`: from a run's job-level completions (``steplog.completions``), the window and
  the events as they were fired and served, the figures of the run (definitions in
  docs/benchmarks.md, "Goodput over a volatile trace"):

  - **useful steps**: the distinct steps whose *last* completion falls inside the window: a
    step done again later (after a restart from a checkpoint) counts once, at its redo, and a
    step completed inside the window but redone after it does not count;
  - **normal step**: the median gap between consecutive completions of consecutive steps in the
    window (the events' gaps are a few among thousands and do not move the median);
  - **goodput** = useful steps x normal step / window;
  - per event, **downtime**: the longest gap between consecutive completions from the event
    until it was served, minus one normal step; **steps redone** by it, and **time lost**
    (downtime plus the redone steps, ``steplog.interruption``).
"""

from __future__ import annotations

import itertools
import random
import statistics
from dataclasses import asdict, dataclass
from typing import Any

import steplog

KINDS = ("drain", "crash")


@dataclass(frozen=True)
class Event:
    """One interruption: ``at`` seconds after the window starts. A ``crash`` kills ``rank``'s
    worker; a ``drain`` hits a node holding ranks (which one is the system's to find: ranks
    move under understudy), so its ``rank`` is unused (-1)."""

    index: int
    at: float
    kind: str
    rank: int = -1

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def schedule(seed: int, duration: float, mean_interval: float, drain_fraction: float,
             world: int, max_events: int | None = None) -> list[Event]:
    """Interruptions over ``[0, duration)``: gaps uniform in ``[0.5, 1.5] x mean_interval``
    (the first one too), each a drain with probability ``drain_fraction``, else a crash of a
    rank drawn uniformly. Deterministic in its arguments.

    Raises:
        ValueError: a non-positive duration or interval, or a fraction outside [0, 1].
    """
    if duration <= 0 or mean_interval <= 0:
        raise ValueError(f"duration and mean_interval must be positive, got {duration}, "
                         f"{mean_interval}")
    if not 0 <= drain_fraction <= 1:
        raise ValueError(f"drain_fraction must be within [0, 1], got {drain_fraction}")
    rng = random.Random(seed)
    events: list[Event] = []
    t = 0.0
    while max_events is None or len(events) < max_events:
        t += rng.uniform(0.5 * mean_interval, 1.5 * mean_interval)
        if t >= duration:
            break
        drain = rng.random() < drain_fraction
        rank = rng.randrange(world)  # drawn for both kinds: the sequence does not depend on it
        events.append(Event(len(events), t, "drain" if drain else "crash",
                            -1 if drain else rank))
    return events


def last_completions(done: list[steplog.Completion]) -> dict[int, float]:
    """Step -> the time of its last job-level completion (the one the final state holds)."""
    out: dict[int, float] = {}
    for c in done:
        out[c.step] = max(out.get(c.step, 0.0), c.t)
    return out


def event_figures(done: list[steplog.Completion], fired_at: float, served_at: float,
                  normal: float) -> dict[str, Any]:
    """One event's interruption: the longest gap between consecutive completions from
    ``fired_at`` to ``served_at`` (both the system's: the kill or the drain request, and the
    moment every rank trained again), as ``steplog.interruption`` measures it.

    Raises:
        ValueError: no completion before the event or none after it was served.
    """
    before = [c for c in done if c.t <= fired_at]
    if not before:
        raise ValueError("no step was completed before the event")
    inside = [c for c in done if fired_at < c.t <= served_at]
    after = [c for c in done if c.t > served_at]
    if not after and not inside:
        raise ValueError("no step was completed after the event")
    seq = [before[-1], *inside, *after[:1]]
    a, b = max(itertools.pairwise(seq), key=lambda p: p[1].t - p[0].t)
    return steplog.interruption(done, fired_at, normal, inside_t=(a.t + b.t) / 2)


def goodput(done: list[steplog.Completion], start: float, end: float,
            events: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's figures over the window ``(start, end]`` (see the module docstring).
    ``events``: the fired ones, each with ``fired_at`` and ``served_at`` (wall times; None when
    it was never served).

    Raises:
        ValueError: an empty window, or too few steps in it for a normal step.
    """
    if end <= start:
        raise ValueError(f"the window ({start}, {end}] is empty")
    window = end - start
    inside = [c for c in done if start < c.t <= end]
    g = steplog.gaps(inside)
    if len(g) < 3:
        raise ValueError(f"only {len(g)} step gaps in the window")
    normal = statistics.median(g)
    last = last_completions(done)
    useful = sum(1 for t in last.values() if start < t <= end)
    per_event = []
    for ev in events:
        figures: dict[str, Any] = {"index": ev["index"], "kind": ev["kind"]}
        if ev.get("served_at") is not None:
            try:
                figures.update(event_figures(done, ev["fired_at"], ev["served_at"], normal))
            except ValueError as exc:
                figures["error"] = str(exc)
        per_event.append(figures)
    measured = [e for e in per_event if "downtime_s" in e]
    return {
        "window_s": window,
        "normal_step_s": normal,
        "useful_steps": useful,
        "useful_step_time_s": useful * normal,
        "goodput": useful * normal / window,
        "completions_in_window": len(inside),
        "steps_redone": sum(1 for c in inside if c.k > 1),
        "distinct_steps_in_window": len({c.step for c in inside}),
        "first_step_in_window": min((c.step for c in inside), default=None),
        "last_step_in_window": max((c.step for c in inside), default=None),
        "events_fired": len(events),
        "events_served": sum(1 for e in events if e.get("served_at") is not None),
        "total_downtime_s": sum(e["downtime_s"] for e in measured),
        "total_time_lost_s": sum(e["time_lost_s"] for e in measured),
        # What the window lost beyond the interruptions (their part inside it): slower steps
        # (checkpoints, a standby warming up on the same CPUs, ...), by difference.
        "other_loss_s": window - useful * normal - sum(
            max(0.0, min(e["at"]["full_strength"], end) - max(e["at"]["last_step"], start)
                - normal) for e in measured),
        "events": per_event,
    }


def step_split(points: list[tuple[float, int]], start: float, end: float,
               busy: list[tuple[float, float]], down: list[tuple[float, float]]
               ) -> dict[str, dict[str, float] | None]:
    """Where the window's slower steps were: the gaps between consecutive completions of
    consecutive steps (``points``: (time, step), in time order) inside ``(start, end]``, split by
    whether the gap began inside one of the ``busy`` spans (under understudy: an event served,
    its fresh standbys still warming up on the same machine) or not; gaps that end inside a
    ``down`` span (an event until it was served: its downtime, counted there) are left out.
    Per part: the number of steps and their mean, or None when there are none."""
    parts: dict[str, list[float]] = {"while_busy": [], "elsewhere": []}
    for (t0, s0), (t1, s1) in itertools.pairwise(points):
        if s1 != s0 + 1 or t0 <= start or t1 > end or any(a < t1 <= b for a, b in down):
            continue
        part = "while_busy" if any(a <= t0 < b for a, b in busy) else "elsewhere"
        parts[part].append(t1 - t0)
    return {k: {"steps": len(v), "mean_s": statistics.fmean(v)} if v else None
            for k, v in parts.items()}
