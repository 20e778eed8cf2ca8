"""Lifecycles, one enum each, with their legal transitions.

NodeState (changed only by ``NodeLifecycle.transition`` in the node's own daemon, except
``FAILED``, which the controller writes into the registry when the node's lease has expired)::

    joining  -> standby | active | draining
    standby  -> active | draining
    active   -> standby | draining
    draining -> drained | standby | active        (back to its role: drain cancelled)
    drained  -> standby | active | joining        (undrain)
    any      -> failed                            (lease lost; the node re-joins as joining)
    failed   -> joining

``cordoned`` is a flag beside the state (no new work is placed there), not a state.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class NodeState(enum.StrEnum):
    JOINING = "joining"
    STANDBY = "standby"
    ACTIVE = "active"
    DRAINING = "draining"
    DRAINED = "drained"
    FAILED = "failed"


_NODE_TRANSITIONS: dict[NodeState, frozenset[NodeState]] = {
    NodeState.JOINING: frozenset({NodeState.STANDBY, NodeState.ACTIVE, NodeState.DRAINING}),
    NodeState.STANDBY: frozenset({NodeState.ACTIVE, NodeState.DRAINING}),
    NodeState.ACTIVE: frozenset({NodeState.STANDBY, NodeState.DRAINING}),
    NodeState.DRAINING: frozenset({NodeState.DRAINED, NodeState.STANDBY, NodeState.ACTIVE}),
    NodeState.DRAINED: frozenset({NodeState.STANDBY, NodeState.ACTIVE, NodeState.JOINING}),
    NodeState.FAILED: frozenset({NodeState.JOINING}),
}


class IllegalTransition(AssertionError):
    """An internal bug: code asked for a transition the lifecycle does not allow."""


def can_transition(old: NodeState, new: NodeState) -> bool:
    return new == NodeState.FAILED or new in _NODE_TRANSITIONS[old]


@dataclass
class NodeLifecycle:
    """The one place a node's state changes. Returns the (old, new) pair for logging."""

    state: NodeState = NodeState.JOINING
    since: float = 0.0
    reason: str = ""

    def transition(self, new: NodeState, now: float, reason: str) -> tuple[NodeState, NodeState]:
        old = self.state
        if old == new:
            return old, new
        if not can_transition(old, new):
            raise IllegalTransition(f"node cannot go from {old} to {new} ({reason})")
        self.state, self.since, self.reason = new, now, reason
        return old, new
