"""The controller's decisions, as a pure function of what etcd holds and the time.

No I/O and no clock reads here: the controller (``controller.py``) lists etcd, calls
:func:`plan` with ``now``, and carries out the returned actions with compare-and-swap. Losing a
race is normal: the next round plans again from fresh state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from understudy.daemon.records import NodeRecord, RegistryEntry
from understudy.daemon.states import NodeState


@dataclass(frozen=True)
class MarkFailed:
    """Write ``failed`` into the node's registry entry, if it is still at ``mod_revision``."""

    node: str
    mod_revision: int
    reason: str


@dataclass(frozen=True)
class PruneEvents:
    keys: tuple[str, ...]
    reason: str


Action = MarkFailed | PruneEvents


@dataclass(frozen=True)
class ClusterView:
    #: node name -> (registry entry, its mod revision)
    registry: Mapping[str, tuple[RegistryEntry, int]]
    #: node name -> live record (present only while the node's lease is alive)
    live: Mapping[str, NodeRecord]
    #: event keys, oldest first
    event_keys: tuple[str, ...] = ()


def plan(view: ClusterView, now: float, max_events: int = 1000) -> list[Action]:
    """Decide what the controller does next. Deterministic in ``view`` and ``now``."""
    actions: list[Action] = []
    for name in sorted(view.registry):
        entry, rev = view.registry[name]
        if name in view.live or entry.offline or entry.state == NodeState.FAILED:
            continue
        # The node record is bound to the node's lease: it is gone only when the lease expired
        # (or was revoked by a daemon that did not leave cleanly).
        actions.append(MarkFailed(
            node=name, mod_revision=rev,
            reason=f"lease expired: node was {entry.state} with no keep-alive for a full TTL",
        ))
    excess = len(view.event_keys) - max_events
    if excess > 0:
        actions.append(PruneEvents(view.event_keys[:excess],
                                   f"keeping the newest {max_events} events"))
    return actions
