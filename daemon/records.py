"""Values stored in etcd: versioned JSON records, validated on every read.

Anyone can write under the cluster prefix, so every value read is untrusted: a value that is not
UTF-8 JSON, is larger than :data:`MAX_VALUE_BYTES`, has another schema or kind, or has a field
of the wrong type raises :class:`RecordError` and is ignored by the reader (logged once and
counted), never acted on.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from understudy.daemon.errors import RecordError
from understudy.daemon.states import NodeState

SCHEMA = "understudy/v1"
MAX_VALUE_BYTES = 64 * 1024

R = TypeVar("R", bound="Record")


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
            body = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise RecordError(f"value is not UTF-8 JSON ({exc.__class__.__name__})") from None
        if not isinstance(body, dict):
            raise RecordError("value is not a JSON object")
        if body.get("schema") != SCHEMA:
            raise RecordError(f"value has schema {body.get('schema')!r}, expected {SCHEMA!r}")
        if body.get("record") != cls.KIND:
            raise RecordError(f"value is a {body.get('record')!r} record, expected {cls.KIND!r}")
        hints = typing.get_type_hints(cls)
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
    elif isinstance(hint, type) and issubclass(hint, NodeState):
        if value in NodeState._value2member_map_:
            return NodeState(value)
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
    state_since: float = 0.0
    reason: str = ""
    workers: int = 0
    first_failure: str = ""
    health: tuple[str, ...] = ()


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


@dataclass(frozen=True)
class DrainRequest(Record):
    KIND: ClassVar[str] = "drain"
    node: str
    reason: str
    source: str  # operator, sigterm, health, aws-spot, gce-preemption, ...
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


def event_id(time_s: float, node: str, seq: int) -> str:
    """Sortable event key: time first, so a prefix read is chronological."""
    return f"{int(time_s * 1e9):020d}-{node}-{seq:06d}"
