"""The fault soak's decisions, as pure functions: no processes, no clock (``benchmarks/soak.py``
carries them out and reports them).

- :func:`schedule`: the seeded list of faults, each a kind of :data:`KINDS`, the quiet gap
  before it and a seed of its own for its targets. The kinds come from a shuffled deck holding
  each kind equally often, so a 50-fault run has every one of the ten kinds five times; the
  smoke schedule is the fixed mix :data:`SMOKE_KINDS`, its gaps and targets seeded all the same.
- :func:`pick` and :func:`second`: the hits a fault makes, given where the job's ranks are
  (:class:`Picture`) and the fault's own random generator. No fault takes every data-parallel
  replica of a rank (:func:`keeps_a_replica`): the job's state would then be gone from memory,
  and a failed job the right outcome, not a bug. Faults that kill a node's daemon spare the
  controller's node (``controller-kill`` is the kind that hits it), so that each kind measures
  one thing.
- :func:`by_kind`: each kind's count and downtime figures.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from harness import summarize

from understudy.common.layout import Layout

KINDS = ("worker-kill", "daemon-kill", "node-loss", "silent-node", "drain", "two-at-once",
         "during-migration", "while-paused", "etcd-restart", "controller-kill")
#: The short schedule of ``--smoke``: several kinds, the ones the issue names first.
SMOKE_KINDS = ("worker-kill", "node-loss", "drain", "two-at-once", "etcd-restart",
               "while-paused", "daemon-kill")
#: Hits that are fired within milliseconds of each other (a drain goes through the CLI, a
#: silent node needs waking): what ``two-at-once`` and the second fault of a pair draw from.
SWIFT = ("kill-worker", "kill-daemon", "kill-node")
#: The hit each single kind makes.
SINGLE = {"worker-kill": "kill-worker", "daemon-kill": "kill-daemon", "node-loss": "kill-node",
          "silent-node": "freeze-node", "drain": "drain"}
#: What the first fault of ``during-migration`` is drawn from (each one plans a migration).
MIGRATING = ("kill-worker", "kill-daemon", "kill-node", "drain")


@dataclass(frozen=True)
class Planned:
    """Fault ``index`` of the schedule: ``kind``, after ``gap_s`` seconds of normal training."""

    index: int
    kind: str
    gap_s: float
    seed: int


def schedule(seed: int, count: int, gap: tuple[float, float], smoke: bool) -> list[Planned]:
    """``count`` faults (see the module docstring). Deterministic in its arguments.

    Raises:
        ValueError: a count below one, or a gap range that is negative or upside down.
    """
    if count < 1:
        raise ValueError(f"a schedule needs at least one fault, got {count}")
    if not 0 <= gap[0] <= gap[1]:
        raise ValueError(f"the gap range must be 0 <= min <= max, got {gap}")
    rng = random.Random(seed)
    if smoke:
        kinds = [SMOKE_KINDS[i % len(SMOKE_KINDS)] for i in range(count)]
    else:
        deck = list(KINDS) * math.ceil(count / len(KINDS))
        rng.shuffle(deck)
        kinds = deck[:count]
    return [Planned(i, kind, rng.uniform(*gap), rng.randrange(2**31))
            for i, kind in enumerate(kinds)]


@dataclass(frozen=True)
class Picture:
    """Where the job stands when a fault is chosen: the node of each rank, the controller."""

    ranks: tuple[str, ...]
    controller: str | None
    layout: Layout

    def nodes(self) -> list[str]:
        """The nodes holding ranks, sorted."""
        return sorted(set(self.ranks))

    def ranks_on(self, node: str) -> tuple[int, ...]:
        return tuple(r for r, n in enumerate(self.ranks) if n == node)


@dataclass(frozen=True)
class Hit:
    """One thing done to the cluster. ``action``: ``kill-worker`` (kill -9 of ``rank``'s
    process), ``kill-daemon`` (kill -9 of ``node``'s daemon: its processes die with it),
    ``kill-node`` (kill -9 of the daemon and its processes at once), ``freeze-node`` (SIGSTOP
    of all of them, SIGCONT later), ``drain``, ``kill-joiner`` (kill -9 of the standby worker
    on ``node``, chosen as a joiner), ``restart-etcd``. ``lost``: the ranks whose processes
    die."""

    action: str
    node: str = ""
    rank: int = -1
    lost: tuple[int, ...] = ()

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def keeps_a_replica(lost: Iterable[int], layout: Layout) -> bool:
    """Every rank in ``lost`` keeps a data-parallel replica outside ``lost``."""
    gone = set(lost)
    return all(any(d not in gone for d in layout.replicas(r)) for r in gone)


def _hits(action: str, pic: Picture, lost_before: tuple[int, ...],
          avoid: frozenset[str]) -> list[Hit]:
    """Every hit of ``action`` on a node outside ``avoid`` that, with ``lost_before``, keeps a
    replica of every rank (the controller's node is never a daemon kill's target)."""
    out: list[Hit] = []
    for node in pic.nodes():
        if node in avoid:
            continue
        held = pic.ranks_on(node)
        if action == "kill-worker":
            out += [Hit(action, node, r, (r,)) for r in held if r not in lost_before
                    and keeps_a_replica((*lost_before, r), pic.layout)]
        elif action == "drain":
            out.append(Hit(action, node))
        elif node != pic.controller and keeps_a_replica((*lost_before, *held), pic.layout):
            out.append(Hit(action, node, -1, held))
    return out


def pick(kind: str, pic: Picture, rng: random.Random) -> tuple[Hit, ...]:
    """The hits of fault ``kind`` fired at once (for ``during-migration`` and ``while-paused``
    the first of two: :func:`second` picks the other later, from the picture then).

    Raises:
        ValueError: an unknown kind, or no target keeps a replica of every rank.
    """
    if kind == "etcd-restart":
        return (Hit("restart-etcd"),)
    if kind == "controller-kill":
        if pic.controller is None:
            raise ValueError("the cluster has no controller to kill")
        held = pic.ranks_on(pic.controller)
        if not keeps_a_replica(held, pic.layout):
            raise ValueError(f"the controller's node {pic.controller} holds ranks {held}, "
                             "every replica of one of them")
        return (Hit("kill-node", pic.controller, -1, held),)
    if kind == "two-at-once":
        pairs = [(a, b) for a, b in itertools.combinations(
                 [h for action in SWIFT for h in _hits(action, pic, (), frozenset())], 2)
                 if a.node != b.node and keeps_a_replica((*a.lost, *b.lost), pic.layout)]
        if not pairs:
            raise ValueError(f"no two nodes can fail at once without losing every replica of "
                             f"a rank: ranks on {pic.ranks}")
        return rng.choice(pairs)
    if kind in SINGLE:
        actions: tuple[str, ...] = (SINGLE[kind],)
    elif kind == "during-migration":
        actions = MIGRATING
    elif kind == "while-paused":
        actions = SWIFT
    else:
        raise ValueError(f"unknown fault kind {kind!r}; known: {', '.join(KINDS)}")
    hits = [h for action in actions for h in _hits(action, pic, (), frozenset())]
    if kind in ("during-migration", "while-paused"):  # ... leaving room for a second
        hits = [h for h in hits if _seconds(pic, (h,))]
    if not hits:
        raise ValueError(f"no target for {kind}: ranks on {pic.ranks}, controller "
                         f"{pic.controller}")
    return (rng.choice(hits),)


def _seconds(pic: Picture, first: tuple[Hit, ...]) -> list[Hit]:
    """The swift hits that may follow ``first`` (see :func:`second`)."""
    lost = tuple(r for h in first for r in h.lost)
    avoid = frozenset(h.node for h in first)
    return [h for action in SWIFT for h in _hits(action, pic, lost, avoid)]


def second(pic: Picture, first: tuple[Hit, ...], rng: random.Random,
           joiners: tuple[str, ...] = ()) -> Hit:
    """The second fault of a pair, on a node the first did not hit: a swift hit that, with
    what the first lost, keeps a replica of every rank; or, while a migration is planned, the
    kill of one of its ``joiners``.

    Raises:
        ValueError: no such hit.
    """
    avoid = frozenset(h.node for h in first)
    hits = _seconds(pic, first) + [Hit("kill-joiner", n) for n in joiners if n not in avoid]
    if not hits:
        raise ValueError(f"no second fault keeps a replica of every rank: ranks on "
                         f"{pic.ranks}, {[r for h in first for r in h.lost]} lost already")
    return rng.choice(hits)


def by_kind(faults: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per kind, in :data:`KINDS` order: how many were fired and survived, and the summaries
    (``harness.summarize``) of the downtime, the time lost and the steps redone of those
    measured."""
    out: dict[str, dict[str, Any]] = {}
    for kind in KINDS:
        mine = [f for f in faults if f["kind"] == kind]
        if not mine:
            continue
        measured = [f for f in mine if f.get("downtime_s") is not None]

        def summary(key: str, of: list[dict[str, Any]] = measured) -> dict[str, float] | None:
            return summarize([float(f[key]) for f in of]) if of else None

        out[kind] = {"count": len(mine), "survived": sum(1 for f in mine if f["survived"]),
                     "measured": len(measured), "downtime_s": summary("downtime_s"),
                     "time_lost_s": summary("time_lost_s"),
                     "steps_redone": summary("steps_redone"),
                     "fault_to_served_s": summary("fault_to_served_s")}
    return out
