"""Values stored in etcd: versioned JSON records, validated on every read.

Anyone can write under the cluster prefix, so every value read is untrusted: a value that is not
UTF-8 JSON, is larger than :data:`MAX_VALUE_BYTES`, has another schema or kind, or has a field
of the wrong type raises :class:`RecordError` and is ignored by the reader (logged once and
counted), never acted on.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from understudy.common.errors import RecordError
from understudy.common.layout import Layout
from understudy.common.snapshot_tiers import parse_source
from understudy.common.states import NodeState

if TYPE_CHECKING:
    from understudy.common.store import KV

SCHEMA = "understudy/v1"
MAX_VALUE_BYTES = 64 * 1024

R = TypeVar("R", bound="Record")
T = TypeVar("T")


@dataclass(frozen=True)
class Record:
    KIND: ClassVar[str] = ""

    def encode(self) -> bytes:
        body = {**dataclasses.asdict(self), "schema": SCHEMA, "record": self.KIND}
        data = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        assert len(data) <= MAX_VALUE_BYTES, f"{self.KIND} record too large ({len(data)} bytes)"
        return data

    @classmethod
    def decode(cls: type[R], data: bytes) -> R:
        """Parse and validate; raises RecordError saying what is wrong with the value."""
        if len(data) > MAX_VALUE_BYTES:
            raise RecordError(f"value of {len(data)} bytes exceeds {MAX_VALUE_BYTES}")
        try:
            body = json.loads(data.decode("utf-8"), parse_constant=_not_json)
        except (UnicodeDecodeError, ValueError) as exc:
            raise RecordError(f"value is not UTF-8 JSON ({exc.__class__.__name__}: "
                              f"{str(exc)[:80]})") from None
        if not isinstance(body, dict):
            raise RecordError("value is not a JSON object")
        if body.get("schema") != SCHEMA:
            raise RecordError(f"value has schema {body.get('schema')!r}, expected {SCHEMA!r}")
        if body.get("record") != cls.KIND:
            raise RecordError(f"value is a {body.get('record')!r} record, expected {cls.KIND!r}")
        hints = _field_types(cls)
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in body:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise RecordError(f"{cls.KIND} value lacks field {f.name!r}")
                continue
            kwargs[f.name] = _check(cls.KIND, f.name, hints[f.name], body[f.name])
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as exc:
            raise RecordError(f"{cls.KIND} value is invalid: {exc}") from None


def _not_json(constant: str) -> Any:
    """``NaN`` and ``Infinity`` are Python's extension of JSON, not JSON: a deadline of NaN
    passes every comparison's ``<= 0`` check and is never reached."""
    raise ValueError(f"{constant} is not a JSON number")


#: record class -> its resolved field types
_FIELD_TYPES: dict[type, dict[str, Any]] = {}


def _field_types(cls: type) -> dict[str, Any]:
    """A record class's resolved field types. Cached: resolving the string annotations is most
    of a decode's cost (~70 % of a node record's), and the controller decodes every node's
    records on each re-list, so at 4,096 nodes it held its event loop for seconds."""
    hints = _FIELD_TYPES.get(cls)
    if hints is None:
        hints = _FIELD_TYPES[cls] = typing.get_type_hints(cls)
    return hints


def _check(kind: str, name: str, hint: Any, value: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for option in typing.get_args(hint):
            try:
                return _check(kind, name, option, value)
            except RecordError as exc:
                errors.append(exc)
        raise RecordError(f"{kind} field {name!r} has the wrong type ({type(value).__name__})")
    if hint is type(None):
        if value is None:
            return None
    elif origin is tuple or hint is tuple:
        args = typing.get_args(hint)
        if isinstance(value, list):
            return tuple(_check(kind, name, args[0], v) for v in value) if args else tuple(value)
    elif origin is dict:
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return value
    elif isinstance(hint, type) and issubclass(hint, enum.Enum):
        if value in hint._value2member_map_:
            return hint(value)
    elif hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(hint, type) and isinstance(value, hint):
        return value
    raise RecordError(f"{kind} field {name!r} has the wrong type ({type(value).__name__})")


@dataclass(frozen=True)
class NodeRecord(Record):
    """What a live daemon says about its node. Bound to the node's lease."""

    KIND: ClassVar[str] = "node"
    name: str
    incarnation: str
    lease: int
    state: NodeState
    role: str
    slots: int
    addresses: tuple[str, ...] = ()
    failure_domain: str = ""
    version: str = ""
    started_at: float = 0.0
    #: when this incarnation registered (wall time); later than ``started_at`` by more than a
    #: moment when the daemon lost its lease and joined again without restarting
    registered_at: float = 0.0
    state_since: float = 0.0
    reason: str = ""
    workers: int = 0
    first_failure: str = ""
    health: tuple[str, ...] = ()
    #: ``HOST:PORT`` of the daemon's probe responder (``daemon/probe.py``); empty: none
    probe: str = ""
    #: job -> what this node's standby worker for it has warmed: {"mode": str, "roles":
    #: [str], "detail": str, "since": wall time}; readers must check the shapes (see
    #: :func:`warmth_line`)
    warmth: dict[str, Any] = field(default_factory=dict)


def warmth_line(warmth: Any, now: float) -> str:
    """One line for ``understudy status`` from a node record's ``warmth``; tolerates junk."""
    parts = []
    for job, w in sorted(warmth.items()) if isinstance(warmth, dict) else ():
        if not isinstance(w, dict):
            continue
        roles = w.get("roles")
        roles_s = ",".join(str(r) for r in roles) if isinstance(roles, list) and roles else ""
        since = w.get("since")
        age = f" for {max(0.0, now - since):.0f}s" if isinstance(since, int | float) else ""
        parts.append(f"{job}: {w.get('mode', '?')}{f' [{roles_s}]' if roles_s else ''}{age}")
    return "; ".join(parts)


@dataclass(frozen=True)
class RegistryEntry(Record):
    """Persistent: the node existed, its last known state, and the operator's cordon flag."""

    KIND: ClassVar[str] = "registry"
    name: str
    incarnation: str
    state: NodeState
    updated_at: float
    cordoned: bool = False
    reason: str = ""
    #: True once the daemon has left cleanly (after a drain); no failure is declared then.
    offline: bool = False


class DrainSource(enum.StrEnum):
    """Who asks understudy to drain a node: the operator (``understudy drain``), the daemon
    (on SIGTERM, or its health checks), or a cloud's reclaim notice (``daemon/notices.py``). A
    drain request in etcd may carry another value (a foreign writer): it is kept as written."""

    OPERATOR = "operator"
    SIGTERM = "sigterm"
    HEALTH = "health"
    AWS_SPOT = "aws-spot"
    AWS_REBALANCE = "aws-rebalance"
    GCE_PREEMPTION = "gce-preemption"
    GCE_MAINTENANCE = "gce-maintenance"
    AZURE_SCHEDULED_EVENT = "azure-scheduled-event"


@dataclass(frozen=True)
class DrainRequest(Record):
    KIND: ClassVar[str] = "drain"
    node: str
    reason: str
    source: str  # a DrainSource's value, as understudy writes it
    requested_at: float
    deadline: float  # unix time by which the node must be empty
    requested_by: str = ""


@dataclass(frozen=True)
class ControllerRecord(Record):
    KIND: ClassVar[str] = "controller"
    node: str
    incarnation: str
    since: float


@dataclass(frozen=True)
class Event(Record):
    KIND: ClassVar[str] = "event"
    time: float
    kind: str
    node: str
    message: str
    details: dict[str, Any] = field(default_factory=dict)


class JobState(enum.StrEnum):
    """A job's lifecycle, changed only by the controller, and only as :meth:`can_become`
    allows::

        pending -> running -> done | failed | stopped
        pending -> failed      (cannot be placed)
        pending -> stopped     (``understudy stop`` before it was placed)
        pending -> pending     (a new reason: why it cannot be placed yet)
        running -> running     (a new reason: paused for want of a standby, resumed)

    ``done``, ``failed`` and ``stopped`` are final (:attr:`ended`): the job holds no node. A job
    with no status yet is ``pending``. Paused is a condition of a running job, not a state of
    its own (its ranks keep running and hold their state): :attr:`JobStatus.paused`.
    """

    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    STOPPED = "stopped"

    @property
    def ended(self) -> bool:
        return self in (JobState.DONE, JobState.FAILED, JobState.STOPPED)

    def can_become(self, new: JobState) -> bool:
        """Whether a job in this state may be written as ``new``."""
        return new in _JOB_TRANSITIONS[self]


_JOB_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.PENDING, JobState.RUNNING, JobState.FAILED,
                                 JobState.STOPPED}),
    JobState.RUNNING: frozenset({JobState.RUNNING, JobState.DONE, JobState.FAILED,
                                 JobState.STOPPED}),
    JobState.DONE: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.STOPPED: frozenset(),
}


JOB_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$")


@dataclass(frozen=True)
class JobSpec(Record):
    """What ``understudy run`` asked for. Written once, never changed."""

    KIND: ClassVar[str] = "job"
    name: str
    argv: tuple[str, ...]
    cwd: str
    tp: int
    dp: int
    standby: int
    created_at: float
    created_by: str = ""
    env: dict[str, Any] = field(default_factory=dict)
    #: pipeline stages (1: no pipeline parallelism)
    pp: int = 1
    #: the job is a slotted one (``SlottedJob``: ``dp`` data-parallel slots) that may change
    #: its data-parallel size live (``understudy run --reshape``): a lost replica with no
    #: standby free shrinks the job instead of pausing it (``docs/reshape.md``)
    reshape: bool = False
    #: an unmodified torch.distributed script (``understudy run --restart-only``): its ranks get
    #: the environment torchrun gives its workers, and a failure, a node loss or a drain restarts
    #: every rank from the script's own checkpoint instead of moving one live
    #: (``docs/restart.md``)
    restart_only: bool = False
    #: a restart-only job: restarts after a failure (a rank's or a node's) before the job fails;
    #: a drain's restart does not count (as torchrun's membership changes do not)
    max_restarts: int = 3

    @property
    def world_size(self) -> int:
        return self.tp * self.dp * self.pp

    @property
    def layout(self) -> Layout:
        return Layout(self.world_size, self.tp, self.pp)

    def __post_init__(self) -> None:
        if not JOB_NAME_RE.match(self.name):
            raise ValueError(f"job name {self.name!r} must be 1-40 lowercase letters, digits "
                             "or '-'")
        if self.tp < 1 or self.dp < 1 or self.pp < 1 or self.standby < 0:
            raise ValueError(f"tp ({self.tp}), dp ({self.dp}) and pp ({self.pp}) must be >= 1, "
                             f"standby ({self.standby}) >= 0")
        if not self.argv:
            raise ValueError("a job needs a command")
        if self.restart_only and self.reshape:
            raise ValueError("a restart-only job cannot reshape: a plain script restarts at the "
                             "size it was started with")
        if not 0 <= self.max_restarts <= 1000:
            raise ValueError(f"max restarts ({self.max_restarts}) must be 0 to 1000")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()):
            raise ValueError("job environment must map strings to strings")


@dataclass(frozen=True)
class Assignment(Record):
    """Which node holds each rank, and which standby nodes serve the job. Written by the
    controller by compare-and-swap; every change of a rank's node raises ``epoch`` (a standby
    added to the pool does not: no rank moves)."""

    KIND: ClassVar[str] = "assignment"
    job: str
    epoch: int
    ranks: tuple[str, ...]
    standbys: tuple[str, ...]
    reason: str
    updated_at: float
    #: a restart-only job: the restarts after failures so far (``TORCHELASTIC_RESTART_COUNT``
    #: of the epoch's ranks)
    restarts: int = 0
    #: the migration (recovery, reshape, restart) that made this epoch; empty for the job's
    #: first. A rank that lags can see the job's next migration planned before it saw its own
    #: committed: this says its own was (``worker.migration.committed``)
    migration: str = ""

    def ranks_on(self, node: str) -> list[int]:
        return [r for r, n in enumerate(self.ranks) if n == node]


@dataclass(frozen=True)
class JobStatus(Record):
    """The controller's word on a job. ``paused``: the job is running but waits for standbys
    to recover a lost rank (its survivors keep their state in memory meanwhile; the planner
    writes it, workers and tools read it); ``reason`` says why, for people."""

    KIND: ClassVar[str] = "job-status"
    job: str
    state: JobState
    reason: str
    updated_at: float
    paused: bool = False

    def __post_init__(self) -> None:
        if self.paused and self.state != JobState.RUNNING:
            raise ValueError(f"only a running job can be paused, not a {self.state} one")


#: how a paused job's status reason begins (for people: :attr:`JobStatus.paused` says it)
PAUSED = "paused: "


#: how the reason of a job stopped cleanly ends: every rank ended at the step they agreed on,
#: ``on_finish`` run (``understudy stop`` exits 0 on it), it was never placed, or (a
#: restart-only job) every rank ended by itself after its SIGTERM
STOPPED_CLEANLY = ("every rank finished its last step", "before it was placed",
                   "every rank ended after its SIGTERM")


def stopped_cleanly(status: JobStatus) -> bool:
    """Whether ``status`` says a job stopped with nothing cut short."""
    return status.state == JobState.STOPPED and status.reason.endswith(STOPPED_CLEANLY)


@dataclass(frozen=True)
class RankExit(Record):
    """Written by a node's daemon when one of its ranks' processes ends."""

    KIND: ClassVar[str] = "rank-exit"
    job: str
    rank: int
    epoch: int
    node: str
    returncode: int
    failed: bool
    description: str
    time: float
    #: the exception class the rank's process recorded when it exited with an error of its own
    #: (``module.Class``, or the builtin's name); empty: none recorded, or killed by a signal
    error_type: str = ""

    @property
    def own_error(self) -> bool:
        """The job's own code failed (an exception the training script raised, not a signal,
        a lost node or one of understudy's errors): running the rank elsewhere would fail the
        same way."""
        return self.failed and self.returncode > 0 and bool(self.error_type) and \
            not self.error_type.startswith("understudy.")


class MigrationPhase(enum.StrEnum):
    """A migration's lifecycle, changed only by the controller, and only as
    :meth:`Migration.can_become` allows (the table below and the kind's shortcuts)::

        planned -> preparing -> ready -> switching -> done
        ready -> done                      (the joiners took over before the switch was seen)
        any but done -> aborted            (joiner died, deadline passed: the leaver stays)

    A recovery, rollback or reshape (:attr:`Migration.recovery`: the job is stopped
    already) may go ``preparing -> done``: the joiners take the state from data-parallel
    replicas (``donors``) or snapshots instead of the leaver, and there is no switch to agree
    on. A reshape that adds no replica binds no joiner and may go ``planned -> done``.

    A restart (``kind="restart"``, a restart-only job's: ``docs/restart.md``) goes ``planned
    -> done``: planned, every daemon stops the job's ranks (SIGTERM, SIGKILL after the stop
    grace); done, once every rank of the old epoch has ended or lost its node, commits the new
    assignment, whose ranks the daemons start afresh. Aborted when a node chosen for it is gone.

    planned: joiners bind to their ranks; preparing: every member of a group that contains a
    leaver builds that group's next version in the background (phase 1); ready: all reported
    prepared; switching: the ranks agreed (by the step vote) on the boundary where the state
    moves and the new versions take over (phase 2); done: the new assignment is committed.
    """

    PLANNED = "planned"
    PREPARING = "preparing"
    READY = "ready"
    SWITCHING = "switching"
    DONE = "done"
    ABORTED = "aborted"


_PHASE_STEPS: dict[MigrationPhase, frozenset[MigrationPhase]] = {
    MigrationPhase.PLANNED: frozenset({MigrationPhase.PREPARING, MigrationPhase.DONE,
                                       MigrationPhase.ABORTED}),
    MigrationPhase.PREPARING: frozenset({MigrationPhase.READY, MigrationPhase.DONE,
                                         MigrationPhase.ABORTED}),
    MigrationPhase.READY: frozenset({MigrationPhase.SWITCHING, MigrationPhase.DONE,
                                     MigrationPhase.ABORTED}),
    MigrationPhase.SWITCHING: frozenset({MigrationPhase.DONE, MigrationPhase.ABORTED}),
    MigrationPhase.DONE: frozenset(),
    MigrationPhase.ABORTED: frozenset(),
}


class MigrationKind(enum.StrEnum):
    """What a migration does (:class:`Migration`)."""

    #: a drain or a notice: the leaver is alive and hands its state off
    PLANNED = "planned"
    #: the leaver is gone; a data-parallel replica gives the joiner its state
    RECOVERY = "recovery"
    #: the leaver is gone and no replica holds its state: every rank loads a snapshot
    ROLLBACK = "rollback"
    #: the job's data-parallel size changes
    RESHAPE = "reshape"
    #: a restart-only job's ranks start afresh from the script's checkpoint
    RESTART = "restart"


MIGRATION_KINDS = tuple(MigrationKind)


class Report(enum.StrEnum):
    """What a migration's workers report, as keys under ``<job>/migration/<id>/`` in their
    key-value service; the controller turns them into phase changes. Per rank
    (``Report.PREPARED.of(3)`` is ``prepared/3``) unless said otherwise."""

    #: the joiner for the rank has built the model for it
    BOUND = "bound"
    #: phase 1 done on the rank: its rebuilt groups' next versions are up
    PREPARED = "prepared"
    #: phase 1 done on the joiner for the rank
    JOINER_PREPARED = "joiner-prepared"
    #: once: the ranks agreed on the switch boundary (by the step vote)
    SWITCHING = "switching"
    #: the rank's state reached its joiner (:data:`TRANSFER_OK`), or why it did not
    TRANSFERRED = "transferred"
    #: the joiner for the rank holds the state and the new groups
    SWITCHED = "switched"
    #: once: the migration was called off (the value says why)
    ABORTED = "aborted"
    #: a reshape: the rank (numbered as before it) holds its groups of the new shape
    RESHAPED = "reshaped"
    #: how long the job did not train for the migration, as a rank saw it (seconds, text):
    #: a drain's switch on the first rank that stays, a recovery's or reshape's from the
    #: abort of the failed step to the recovered groups on the first survivor
    DOWNTIME = "downtime"

    def of(self, rank: int) -> str:
        return f"{self.value}/{rank}"


#: begins the :attr:`Report.ABORTED` value of a reshape that a rank cannot take part in (its job
#: is not a slotted one): the next plan for the job pauses it instead
CANNOT_RESHAPE = "cannot reshape: "
#: the value of a :attr:`Report.TRANSFERRED` report whose state arrived
TRANSFER_OK = b"ok"
#: begins the :attr:`Report.ABORTED` value of a recovery whose donor keeps no copy of the lost
#: rank's state (its job shards state over DP and the copy is gone too): the next plan for
#: those ranks uses no replica
NO_REPLICA_COPY = "no replica keeps a copy: "


@dataclass(frozen=True)
class Migration(Record):
    """Moves ``ranks[i]`` from node ``leavers[i]`` to the standby on node ``joiners[i]``.

    ``kind`` is ``planned`` (drain, notice: the leaver is alive and hands its state off),
    ``recovery`` (the leaver is gone: rank ``donors[i]``, a data-parallel replica of
    ``ranks[i]``, gives the joiner the state of the last committed step) or ``rollback`` (the
    leaver is gone and no replica holds its state: every rank, joiners included, loads its
    snapshot of ``snapshot_step``, rank ``r``'s from ``snapshot_from[r]``: ``storage`` or
    ``memory:<node>:<holder id>``, each followed by ``@<epoch>``, the epoch the copy was
    written under, see ``snapshot_tiers.py``; empty: all from storage).

    A ``reshape`` changes the job's data-parallel size (``docs/reshape.md``): replica ``d`` of
    the new shape is replica ``replicas[d]`` of the old one, its ranks renumbered to their new
    place and keeping their processes and state; a replica not named leaves (a shrink: its ranks
    are gone or end). A replica that is :data:`NEW_REPLICA` (a grow) is made of standbys:
    ``joiners[i]`` takes ``ranks[i]`` (numbered in the new shape) with the state of rank
    ``donors[i]`` (of the new shape too, a replica kept); ``leavers`` are empty strings.

    A ``restart`` (a restart-only job) names every rank: rank ``r`` ran on ``leavers[r]`` and
    starts afresh on ``joiners[r]`` (the same node, or a standby where that node is lost or
    draining), from the script's own checkpoint.
    """

    KIND: ClassVar[str] = "migration"
    job: str
    id: str
    from_epoch: int
    to_epoch: int
    ranks: tuple[int, ...]
    leavers: tuple[str, ...]
    joiners: tuple[str, ...]
    phase: MigrationPhase
    reason: str
    created_at: float
    deadline: float
    updated_at: float
    #: phase name -> wall time it was entered, and measured durations reported by workers
    timings: dict[str, Any] = field(default_factory=dict)
    kind: MigrationKind = MigrationKind.PLANNED
    donors: tuple[int, ...] = ()
    #: rollback: the step of the snapshot every rank goes back to
    snapshot_step: int = -1
    #: rollback: where each rank's copy of that snapshot comes from (by rank)
    snapshot_from: tuple[str, ...] = ()
    #: aborted: why (the controller's reason, or a rank's report)
    outcome: str = ""
    #: reshape: the old data-parallel index of each replica of the new shape, in its order, or
    #: :data:`NEW_REPLICA` for one that standbys (``joiners``) make up
    replicas: tuple[int, ...] = ()
    #: reshape: the data-parallel size before it
    from_dp: int = 0
    #: restart: the job's restarts after failures once it commits (``Assignment.restarts``)
    restarts: int = 0

    def __post_init__(self) -> None:
        if self.kind not in MIGRATION_KINDS:
            raise ValueError(f"kind {self.kind!r} is not one of {', '.join(MIGRATION_KINDS)}")
        object.__setattr__(self, "kind", MigrationKind(self.kind))
        if self.kind == MigrationKind.RESHAPE:
            kept = [d for d in self.replicas if d != NEW_REPLICA]
            if not kept or min(kept) < 0 or len(set(kept)) != len(kept) or \
                    max(kept) >= self.from_dp:
                raise ValueError(f"a reshape keeps at least one replica and names each once, "
                                 f"each below its size before ({self.from_dp})")
            if not len(self.ranks) == len(self.leavers) == len(self.joiners) == \
                    len(self.donors) or any(self.leavers):
                raise ValueError("a reshape's joiners each take a rank of a new replica, from a "
                                 "donor, with no leaver")
        elif self.replicas or self.from_dp:
            raise ValueError("only a reshape names replicas")
        elif not len(self.ranks) == len(self.leavers) == len(self.joiners) > 0:
            raise ValueError("a migration moves at least one rank, with a leaver and a joiner "
                             "for each")
        if self.kind == MigrationKind.RESTART and (
                self.ranks != tuple(range(len(self.ranks))) or self.donors):
            raise ValueError("a restart names every rank, in order, and no donors")
        if self.restarts and self.kind != MigrationKind.RESTART:
            raise ValueError("only a restart counts restarts")
        if self.to_epoch != self.from_epoch + 1:
            raise ValueError("a migration raises the epoch by exactly one")
        if self.kind == MigrationKind.RECOVERY and len(self.donors) != len(self.ranks):
            raise ValueError("a recovery names one donor rank for each rank it replaces")
        if self.kind not in (MigrationKind.RECOVERY, MigrationKind.RESHAPE) and self.donors:
            raise ValueError(f"a {self.kind} migration names no donors")
        if (self.kind == MigrationKind.ROLLBACK) != (self.snapshot_step >= 0):
            raise ValueError("a rollback, and only a rollback, names the snapshot step")
        if self.snapshot_from and self.kind != MigrationKind.ROLLBACK:
            raise ValueError("only a rollback names where the snapshots come from")
        for source in self.snapshot_from:
            parse_source(source)
        if set(self.donors) & set(self.ranks):
            raise ValueError("a rank being replaced cannot be a donor")

    @property
    def group_version(self) -> int:
        """The version this attempt builds its groups at (:func:`group_version`)."""
        return group_version(self.created_at)

    @property
    def recovery(self) -> bool:
        """The job stopped for it: a recovery from a replica, a rollback to a snapshot, or a
        reshape (every rank that stays settles on the last committed step first)."""
        return self.kind in (MigrationKind.RECOVERY, MigrationKind.ROLLBACK, MigrationKind.RESHAPE)

    def renumbering(self, tp: int, pp: int) -> dict[int, int]:
        """A reshape's ranks that stay, by their rank before it -> their rank after it."""
        return renumbering(Layout(self.from_dp * tp * pp, tp, pp), self.replicas)

    @property
    def active(self) -> bool:
        return self.phase not in (MigrationPhase.DONE, MigrationPhase.ABORTED)

    def can_become(self, phase: MigrationPhase) -> bool:
        """Whether this migration may move from its phase to ``phase`` (see
        :class:`MigrationPhase`)."""
        if phase not in _PHASE_STEPS[self.phase]:
            return False
        if phase == MigrationPhase.DONE and self.phase == MigrationPhase.PLANNED:
            return self.kind in (MigrationKind.RESTART, MigrationKind.RESHAPE)
        if phase == MigrationPhase.DONE and self.phase == MigrationPhase.PREPARING:
            return self.recovery
        return True


#: a reshape's replica that is new (a grow): standbys make it up
NEW_REPLICA = -1


def group_version(created_at: float) -> int:
    """The group version of the migration attempt created at wall time ``created_at``: its
    milliseconds, unique per attempt (an abandoned attempt burns its number) and above the
    epoch numbers the job's first versions have."""
    return int(created_at * 1000)


def renumbering(layout: Layout, replicas: tuple[int, ...]) -> dict[int, int]:
    """The ranks of ``layout`` whose data-parallel index is in ``replicas`` -> their rank in
    the shape whose replica ``d`` is ``replicas[d]`` (TP index and stage kept)."""
    new = reshaped(layout, len(replicas))
    out = {}
    for r in range(layout.world_size):
        t, d, s = layout.coordinates(r)
        if d in replicas:
            out[r] = new.rank_of(t, replicas.index(d), s)
    return out


def reshaped_nodes(layout: Layout, nodes: tuple[str, ...], replicas: tuple[int, ...],
                   ranks: tuple[int, ...] = (), joiners: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The node of every rank after a reshape from ``layout``, whose rank ``r`` was on
    ``nodes[r]``: a kept rank's node under its new number, a new replica's rank ``ranks[i]``
    on ``joiners[i]``.

    Raises:
        ValueError: a rank of the new shape would have no node (the joiners do not make up the
            new replicas).
    """
    after = [""] * (len(replicas) * layout.tp * layout.pp)
    for old, new in renumbering(layout, replicas).items():
        after[new] = nodes[old]
    for r, joiner in zip(ranks, joiners, strict=True):
        if not 0 <= r < len(after) or after[r]:
            raise ValueError(f"a joiner cannot take rank {r} of the new shape")
        after[r] = joiner
    if not all(after):
        raise ValueError(f"ranks {[r for r, n in enumerate(after) if not n]} of the new shape "
                         "have no node")
    return tuple(after)


def current_layout(spec: JobSpec, assignment: Assignment) -> Layout:
    """The job's layout now: its submitted TP and PP, and as many data-parallel replicas as
    its assignment places (fewer than submitted after a reshape shrank it).

    Raises:
        ValueError: the assignment's rank count does not fit the spec (a foreign write).
    """
    layout = Layout(len(assignment.ranks), spec.tp, spec.pp)
    if layout.dp > spec.dp:
        raise ValueError(f"job {spec.name}'s assignment places {layout.dp} replicas, more than "
                         f"its {spec.dp} slots")
    return layout


def reshaped(layout: Layout, dp: int) -> Layout:
    """``layout`` with ``dp`` data-parallel replicas."""
    return Layout(dp * layout.tp * layout.pp, layout.tp, layout.pp)


@dataclass(frozen=True)
class ResizeRequest(Record):
    """``understudy resize JOB --dp N``: the data-parallel size the operator wants a
    ``--reshape`` job to train at, from 1 to its slot count (the ``--dp`` it was run with).
    The controller shrinks or grows the job to it, and grows it back after a loss no further;
    the next request replaces it."""

    KIND: ClassVar[str] = "resize"
    job: str
    dp: int
    requested_at: float
    requested_by: str = ""

    def __post_init__(self) -> None:
        if self.dp < 1:
            raise ValueError(f"dp ({self.dp}) must be >= 1")


@dataclass(frozen=True)
class StopRequest(Record):
    """``understudy stop JOB``: every rank finishes the step it is in, the ranks agree on the
    last step (the step vote), the job's ``on_finish`` runs and the ranks end; the controller
    then marks the job stopped and its nodes go back to the pool. A rank that has not ended
    ``grace`` seconds after ``requested_at`` is stopped as it is (the job's status names it).
    Written once (a second stop finds it there)."""

    KIND: ClassVar[str] = "stop"
    job: str
    requested_at: float
    grace: float
    requested_by: str = ""

    def __post_init__(self) -> None:
        if not 0 < self.grace <= 1e6:
            raise ValueError(f"grace ({self.grace}) must be positive seconds, at most 1e6")


@dataclass(frozen=True)
class Rendezvous(Record):
    """Where a restart-only job's ranks of ``epoch`` meet: rank 0's script hosts the env://
    TCPStore at ``addr:port`` (``MASTER_ADDR``/``MASTER_PORT``). Written by the daemon of the
    node holding rank 0 at that epoch (its single writer), before it starts rank 0; the other
    daemons start their ranks of that epoch only once they read it. A fresh port each epoch, so
    a rank of an older epoch cannot reach the new ranks' store."""

    KIND: ClassVar[str] = "rendezvous"
    job: str
    epoch: int
    node: str
    addr: str
    port: int

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536 or not self.addr:
            raise ValueError(f"rendezvous {self.addr!r}:{self.port} is not an address and port")


@dataclass(frozen=True)
class ProgressReport(Record):
    """How far a job has got: the steps committed, as the process holding rank 0 said at
    ``at`` under ``epoch`` (``worker/progress.py``). Written by a worker through its daemon to
    the workers' key-value service (:data:`PROGRESS_NAMESPACE`, key ``0``); ``understudy jobs``
    reads it. Untrusted: a value that does not decode is shown as no report."""

    KIND: ClassVar[str] = "progress"
    job: str
    step: int
    epoch: int
    at: float

    def __post_init__(self) -> None:
        if self.step < 0 or self.epoch < 0:
            raise ValueError(f"step ({self.step}) and epoch ({self.epoch}) must be >= 0")


#: the workers' key-value namespace of a job's progress reports
PROGRESS_NAMESPACE = "{job}/progress"


@dataclass(frozen=True)
class StuckReport(Record):
    """A rank that has waited ``waited`` seconds in one collective (``what``), at step ``step``
    of ``epoch``, as it said at ``at``: written by the worker through its daemon to
    :data:`STUCK_NAMESPACE`, key ``<rank>``, while the wait lasts past half the job's
    collective timeout, and deleted when it ends (``worker/stuck.py``). The controller reads
    them to find a rank that hangs: the one its peers wait on (``daemon/planner.py``,
    ``hung_ranks``). Untrusted: a value that does not decode is no report."""

    KIND: ClassVar[str] = "stuck"
    job: str
    rank: int
    epoch: int
    step: int
    waited: float
    what: str
    at: float
    #: after how long a wait this rank reports it (half its collective timeout)
    after: float

    def __post_init__(self) -> None:
        if min(self.rank, self.epoch, self.step) < 0:
            raise ValueError("rank, epoch and step must be >= 0")
        if not 0 < self.after < 1e7:
            raise ValueError(f"after ({self.after}) must be a positive number of seconds")
        if not 0 <= self.waited < 1e7 or not math.isfinite(self.at):
            raise ValueError(f"waited ({self.waited}) and at ({self.at}) must be finite times")
        if len(self.what) > 200:
            raise ValueError("what must be at most 200 characters")


#: the workers' key-value namespace of a job's stuck reports
STUCK_NAMESPACE = "{job}/stuck"


#: what a job keeps under ``jobs/<job>/``: key name -> record (``exits/<epoch>/<rank>`` hold
#: :class:`RankExit` records, read by the controller alone)
JOB_RECORDS: dict[str, type[Record]] = {
    "spec": JobSpec,
    "assignment": Assignment,
    "status": JobStatus,
    "migration": Migration,
    "resize": ResizeRequest,
    "stop": StopRequest,
    "rendezvous": Rendezvous,
}


def decode_job_record(path: str, value: bytes) -> tuple[str, str, Record] | None:
    """``path`` is a key under ``jobs/`` (``<job>/<name>``): the job, the name and its record,
    or None for a name that is not in :data:`JOB_RECORDS`. The one reader of job records: the
    controller, every node's job runner and the CLI use it.

    Raises:
        RecordError: the value is not a valid record of its kind, or names another job.
    """
    job, _, name = path.partition("/")
    kind = JOB_RECORDS.get(name)
    if kind is None:
        return None
    record = kind.decode(value)
    named = record.name if isinstance(record, JobSpec) else getattr(record, "job", job)
    if named != job:
        raise RecordError(f"{name} under {job!r} names job {named!r}")
    return job, name, record


@dataclass(frozen=True)
class _Undecodable:
    why: str


class DecodedRecords:
    """Values read from etcd, each decoded once per revision of its key, for a reader that
    looks at a whole prefix again and again: the controller's relist (every record of every
    node and job, every 10 s), a job runner's view at each reconcile. Decoding was most of what
    those cost (the controller's relist: 0.28-0.31 s at 4,096 nodes, 73-79 ms now;
    docs/benchmarks.md, "The controller's round and re-list"); now only what changed since the
    last look is decoded. A value that did not decode is remembered
    as its error, raised again at each look (its reader counts a bad value once per revision).

    Remembered by key, mod revision and the bytes themselves: an etcd restored from a backup
    or built afresh can hold another value at a revision seen before. A pass (``begin`` ...
    ``end``) forgets the keys it did not see, so what is kept is bounded by what etcd holds."""

    def __init__(self) -> None:
        self._memo: dict[str, tuple[int, bytes, Any]] = {}
        self._seen: set[str] | None = None

    def __len__(self) -> int:
        return len(self._memo)

    def decode(self, kv: KV, decode: Callable[[bytes], T]) -> T:
        """``decode(kv.value)``, or what it returned (or raised) for the same value before."""
        if self._seen is not None:
            self._seen.add(kv.key)
        memo = self._memo.get(kv.key)
        if memo is None or memo[0] != kv.mod_revision or memo[1] != kv.value:
            try:
                memo = (kv.mod_revision, kv.value, decode(kv.value))
            except RecordError as exc:
                memo = (kv.mod_revision, kv.value, _Undecodable(str(exc)))
            self._memo[kv.key] = memo
        if isinstance(memo[2], _Undecodable):
            raise RecordError(memo[2].why)  # a fresh one: a raised error keeps its traceback
        result: T = memo[2]
        return result

    def forget(self, key: str) -> None:
        """``key`` was deleted."""
        self._memo.pop(key, None)

    def begin(self) -> None:
        """A pass over everything begins: the keys it does not decode are forgotten at its
        ``end``."""
        self._seen = set()

    def end(self) -> None:
        seen, self._seen = self._seen, None
        if seen is not None and len(seen) < len(self._memo):  # else it saw every key
            self._memo = {k: v for k, v in self._memo.items() if k in seen}


def job_misfit(spec: JobSpec, assignment: Assignment | None,
               migration: Migration | None) -> str | None:
    """What makes a job's records, each valid alone, impossible together (None: nothing). Each
    record is checked when it is decoded; this checks them against each other, so that a
    schema-valid but inconsistent write (an assignment with more ranks than the job has, a
    migration naming a rank past it) is a bad value a daemon ignores, not an index error that
    stops it (the security review's H4)."""
    group = spec.tp * spec.pp
    if assignment is not None:
        n = len(assignment.ranks)
        if not 0 < n <= spec.world_size or n % group:
            return (f"its assignment places {n} rank(s); the job has {spec.world_size}, in "
                    f"replicas of {group}")
    if migration is not None:
        if migration.kind == MigrationKind.RESHAPE:
            size = len(migration.replicas) * group
            if size > spec.world_size:
                return (f"its reshape makes {len(migration.replicas)} replica(s) of {group}; "
                        f"the job has {spec.world_size} rank(s)")
        else:
            size = len(assignment.ranks) if assignment is not None else spec.world_size
        named = (*migration.ranks, *migration.donors)
        if any(not 0 <= r < size for r in named):
            return (f"its migration names rank(s) {sorted(set(named))} of a world of {size}")
    return None


def event_id(time_s: float, node: str, seq: int) -> str:
    """Sortable event key: time first, so a prefix read is chronological."""
    return f"{int(time_s * 1e9):020d}-{node}-{seq:06d}"
