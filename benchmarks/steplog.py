"""Downtime and step times from per-step commit records, the same way for every system.

Each rank's process appends a line per committed step (``examples/plain_torch/train.py
--step-log``, ``benchmarks/baseline/torchrun_job.py``): ``{"step", "t", "rank", "pid"}``, ``t``
the wall time just after the optimizer step. From them, pure functions (no processes, no clock):

- **Job-level completions.** A step is completed by the job when every rank has committed it.
  Steps can be committed more than once (a restart redoes the steps since the checkpoint); the
  k-th commit of step ``s`` on each rank belong together, and the job completes ``(s, k)`` at the
  latest of them. A k-th commit that some rank never made (a rank committed a step just before
  it was killed, its peers did not) is no job-level completion.
- **The interruption** an event causes: the gap between consecutive job-level completions that
  straddles a moment known to fall inside it: the event itself for a failure; for a planned
  drain the switch (understudy) or the stop (torchrun), which come after the drain request.
- **Downtime**, as the benchmark issue defines it: (first step completed after the interruption)
  - (last step completed before it) - (one normal step), the normal step being the median gap
  between consecutive completions before the event (the first few steps left out).
- **Steps redone**: the steps completed before the interruption and completed again after it.
- **Time to full strength**: from the last completion before the interruption to the completion
  of the first step beyond it (``last + 1``): the job is back where it was, every rank training.
  **Time lost** is that minus one normal step: the downtime plus the redone steps.
- **Losses**: each rank's loss at each step, to check that two systems trained the same model.
"""

from __future__ import annotations

import itertools
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

#: Steps at the start of a run left out of the normal step (the first pays for first touches).
WARMUP_STEPS = 5


@dataclass(frozen=True, order=True)
class Completion:
    """Step ``step`` completed by every rank, the ``k``-th time, at wall time ``t``."""

    t: float
    step: int
    k: int


def step_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The per-step commit lines among ``records`` (lines without a ``kind`` are commits)."""
    return [r for r in records if r.get("kind", "step") == "step"]


def taken_over(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Commit lines for the steps a rank's new process holds without having computed them.

    A rank killed after the job committed step ``s`` but before its process wrote ``s``'s
    line leaves its survivors' lines for ``s`` and a replacement that starts from the committed
    state at ``s + 1``: without a line for ``s`` from that rank the job would never complete
    ``s``. Where a rank's new process (another ``pid``) first commits a step beyond the one
    after the rank's last line, the steps between are its, at the time of that first commit
    (the earliest the lines show the replacement held them; ``taken_over``: true). A restart
    that goes back to a checkpoint skips nothing and gets no such line."""
    per_rank: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in step_records(records):
        per_rank[int(r["rank"])].append(r)
    out = []
    for rank, lines in per_rank.items():
        lines.sort(key=lambda r: float(r["t"]))
        held = int(lines[0]["step"])  # the highest step the rank's lines so far name
        for prev, cur in itertools.pairwise(lines):
            if cur.get("pid") != prev.get("pid"):
                out += [{"kind": "step", "step": step, "t": cur["t"], "rank": rank,
                         "pid": cur.get("pid"), "loss": None, "taken_over": True}
                        for step in range(held + 1, int(cur["step"]))]
            held = max(held, int(cur["step"]))
    return out


def completions(records: list[dict[str, Any]], world: int) -> list[Completion]:
    """The job-level completions (see the module docstring), in time order.

    Raises:
        ValueError: a record names a rank outside the world.
    """
    per_rank: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for r in step_records(records):
        rank = int(r["rank"])
        if not 0 <= rank < world:
            raise ValueError(f"a step record of rank {rank} in a world of {world}: {r}")
        per_rank[rank].append((float(r["t"]), int(r["step"])))
    times: dict[tuple[int, int], list[float]] = defaultdict(list)
    for rank in range(world):
        seen: dict[int, int] = defaultdict(int)
        for t, step in sorted(per_rank.get(rank, [])):
            seen[step] += 1
            times[(step, seen[step])].append(t)
    return sorted(Completion(max(ts), step, k) for (step, k), ts in times.items()
                  if len(ts) == world)


def gaps(done: list[Completion], start: float = float("-inf"),
         end: float = float("inf")) -> list[float]:
    """Gaps between consecutive completions of consecutive steps, both within [start, end]."""
    return [b.t - a.t for a, b in itertools.pairwise(done)
            if b.step == a.step + 1 and a.t >= start and b.t <= end]


def normal_step(done: list[Completion], before: float, warmup: int = WARMUP_STEPS) -> float:
    """The median gap between consecutive completions before ``before``, the first ``warmup``
    steps of the run left out.

    Raises:
        ValueError: fewer than three such gaps.
    """
    first = [c for c in done if c.k == 1 and c.step == warmup]
    start = first[0].t if first else float("-inf")
    g = gaps(done, start, before)
    if len(g) < 3:
        raise ValueError(f"only {len(g)} step gaps before the event: too few for a normal step")
    return statistics.median(g)


def interruption(done: list[Completion], event_t: float, normal: float,
                 inside_t: float | None = None) -> dict[str, Any]:
    """The figures of the interruption an event at ``event_t`` causes (see the module
    docstring): the gap between consecutive completions that straddles ``inside_t``, a moment
    known to fall inside the interruption (default: the event itself, right for a failure; for
    a planned drain, the moment the job switched or stopped, which comes later). Times in the
    result are seconds; ``*_event_s`` ones are relative to the event.

    Raises:
        ValueError: no completion before ``inside_t``, none after it, or the job never got
            past the last step completed before it.
    """
    inside = event_t if inside_t is None else inside_t
    before = [i for i, c in enumerate(done) if c.t < inside]
    if not before:
        raise ValueError("no step was completed before the interruption")
    if before[-1] == len(done) - 1:
        raise ValueError("no step was completed after the interruption")
    last, first = done[before[-1]], done[before[-1] + 1]
    # Full strength: the first completion past the last step before, wherever it falls (the
    # step right after may never complete job-wide: a rank killed with it in flight whose
    # replacement resumed past it; seen once in the goodput smoke's crash under load).
    full = next((c for c in done[before[-1] + 1:] if c.step > last.step), None)
    if full is None:
        raise ValueError(f"the job never got past step {last.step} after the interruption")
    return {
        "last_step_before": last.step,
        "first_step_after": first.step,
        "normal_step_s": normal,
        "gap_s": first.t - last.t,
        "downtime_s": first.t - last.t - normal,
        "steps_redone": max(0, last.step - first.step + 1),
        "time_to_full_strength_s": full.t - last.t,
        "time_lost_s": full.t - last.t - normal,
        "last_step_before_event_s": last.t - event_t,
        "first_step_after_event_s": first.t - event_t,
        "full_strength_after_event_s": full.t - event_t,
        "at": {"last_step": last.t, "first_step": first.t, "full_strength": full.t},
    }


def failure_inside(records: list[dict[str, Any]], event_t: float,
                   lost_ranks: list[int]) -> float:
    """A moment inside the interruption a failure at ``event_t`` causes, for
    :func:`interruption`: the event itself, or just after the job-level completion of the step
    the lost ranks committed last before they died, where their peers' processes from before
    the event committed it only after it (they were a moment behind when it struck). That
    completion is work from before the failure, not the first step after it; a completion
    that needs a process started after the event is not.
    """
    commits = sorted(step_records(records), key=lambda r: float(r["t"]))
    old_pids = {r.get("pid") for r in commits if float(r["t"]) < event_t}
    inside = event_t
    for rank in lost_ranks:
        mine = [int(r["step"]) for r in commits if int(r["rank"]) == rank
                and float(r["t"]) < event_t]
        if not mine:
            continue
        last, k = mine[-1], mine.count(mine[-1])
        per_rank: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for r in commits:
            if int(r["step"]) == last:
                per_rank[int(r["rank"])].append(r)
        kth = [rs[k - 1] for rs in per_rank.values() if len(rs) >= k]
        if (len(kth) == len(per_rank) and {int(r["rank"]) for r in commits} <= set(per_rank)
                and all(r.get("pid") in old_pids for r in kth)):
            inside = max(inside, max(float(r["t"]) for r in kth) + 1e-6)
    return inside


def steady_steps(done: list[Completion], warmup: int = WARMUP_STEPS) -> dict[str, float]:
    """Step times of an uninterrupted run: the gaps between consecutive completions after the
    first ``warmup`` steps. ``median_s`` is a typical step; ``mean_s`` (the window over the steps
    in it) includes every slower one, checkpoints included.

    Raises:
        ValueError: the run was interrupted (a step completed twice), or had too few steps.
    """
    if any(c.k > 1 for c in done):
        raise ValueError("the run redid steps: it was not uninterrupted")
    steady = [c for c in done if c.step >= warmup]
    g = gaps(steady)
    if len(g) < 3:
        raise ValueError(f"only {len(g)} steady steps")
    g_sorted = sorted(g)
    return {"steps": len(g), "median_s": statistics.median(g),
            "mean_s": (steady[-1].t - steady[0].t) / (steady[-1].step - steady[0].step),
            "p10_s": g_sorted[len(g) // 10], "p90_s": g_sorted[(len(g) * 9) // 10],
            "max_s": g_sorted[-1]}


def losses(records: list[dict[str, Any]]) -> dict[str, float]:
    """``"rank:step" -> loss`` of the newest commit of each step on each rank."""
    out: dict[str, tuple[float, float]] = {}
    for r in step_records(records):
        key = f"{r['rank']}:{r['step']}"
        if r.get("loss") is not None and r["t"] >= out.get(key, (0.0, 0.0))[0]:
            out[key] = (r["t"], r["loss"])
    return {k: v for k, (_, v) in out.items()}


def compare_losses(a: dict[str, float], b: dict[str, float]) -> dict[str, Any]:
    """How many steps two runs of the same job (:func:`losses`) both committed, and how many
    of those had the same loss, bit for bit."""
    common = sorted(set(a) & set(b))
    same = sum(a[k] == b[k] for k in common)
    return {"compared": len(common), "identical": same,
            "first_difference": next((k for k in common if a[k] != b[k]), None)}
