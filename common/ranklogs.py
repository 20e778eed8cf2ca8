"""Per-rank logs: how a rank's own output is named on its node, indexed in etcd, asked for by
``understudy logs`` and answered by the node's daemon (``daemon/ranklogs.py``,
``daemon/logserver.py``, ``cli/logs.py``).

Each process a daemon starts for a rank writes its stdout and stderr to a file of its own,
``<rank_logs.dir>/<job>/rank<R>.<epoch>-<pid>.log`` (the epoch from which the process held the
rank: a standby promoted into it, or a rank renumbered by a reshape, starts a new file under
its new name and epoch). A standby worker's output goes to ``<job>/standby.<pid>.log`` until it
is promoted. Files are capped and rotated (``.1``, ``.2``...; ``rank_logs.max_bytes`` and
``rank_logs.files``).

The CLI reaches only etcd, so a file is read through its node's daemon: the CLI writes a
:class:`LogRequest` under its own lease, the daemon answers with :class:`LogChunk` values (at
most :data:`CHUNK_BYTES` each, at most :data:`WINDOW` unread at a time) under the same lease,
which the CLI deletes as it prints them. When the CLI goes, its lease takes the request and
every chunk with it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import ClassVar

from understudy.common.errors import RecordError
from understudy.common.records import JOB_NAME_RE, SCHEMA, Record

#: the most log bytes one chunk carries (etcd takes 1.5 MiB a request by default)
CHUNK_BYTES = 256 * 1024
#: chunks of one request written and not yet deleted by the reader, at most
WINDOW = 4
#: the most requests one daemon sends at a time (more wait; a follower waiting for its process
#: to write more does not count): with :data:`WINDOW` and :data:`CHUNK_BYTES`, 8 MiB of one
#: node's logs on their way at once, besides what quiet followers' readers have not yet taken
MAX_SERVING = 8
_HEADER_MAX = 1024
_REQUEST_RE = re.compile(r"^[0-9a-f]{8,32}$")
_NODE_RE = re.compile(r"^[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?$")


def rank_file(rank: int, epoch: int, pid: int) -> str:
    """The file name of a rank's process, under its job's directory."""
    return f"rank{rank}.{epoch}-{pid}.log"


def standby_file(pid: int) -> str:
    """The file name of a standby worker (until it is promoted), under its job's directory."""
    return f"standby.{pid}.log"


def rotated(name: str, i: int) -> str:
    """The ``i``-th older file of ``name`` (0: ``name`` itself)."""
    return name if i == 0 else f"{name}.{i}"


@dataclass(frozen=True)
class LogFile(Record):
    """Where the output of one process that held a rank is: written by the node's daemon when
    it starts the process (or the process takes the rank: a promotion, a renumbering). Never
    changed; kept after the process ends, as its file is."""

    KIND: ClassVar[str] = "log-file"
    job: str
    rank: int
    node: str
    #: the assignment epoch from which the process held the rank
    epoch: int
    pid: int
    started_at: float
    #: the file on ``node`` (absolute)
    path: str

    @property
    def incarnation(self) -> str:
        return f"{self.epoch}-{self.pid}"

    def __post_init__(self) -> None:
        _check_target(self.job, self.rank, self.node, self.epoch, self.pid)


@dataclass(frozen=True)
class LogRequest(Record):
    """``understudy logs`` asks ``node`` for the file of rank ``rank``'s process ``pid`` from
    epoch ``epoch``, from byte ``offset`` on (counted from the oldest file kept); with
    ``follow``, also what the process writes later, until it ends. Bound to the CLI's lease
    ``lease``; the answer's chunks are bound to it too."""

    KIND: ClassVar[str] = "log-request"
    id: str
    job: str
    rank: int
    node: str
    epoch: int
    pid: int
    lease: int
    follow: bool
    requested_at: float
    offset: int = 0
    requested_by: str = ""

    def __post_init__(self) -> None:
        if not _REQUEST_RE.match(self.id):
            raise ValueError(f"request id {self.id!r} is not 8-32 hexadecimal digits")
        _check_target(self.job, self.rank, self.node, self.epoch, self.pid)
        if self.offset < 0 or self.lease <= 0:
            raise ValueError(f"offset ({self.offset}) must be >= 0 and lease ({self.lease}) > 0")


def _check_target(job: str, rank: int, node: str, epoch: int, pid: int) -> None:
    # The fields become a path on the node: nothing in them may leave the job's directory.
    if not JOB_NAME_RE.match(job):
        raise ValueError(f"job name {job!r} is not a job name")
    if not _NODE_RE.match(node):
        raise ValueError(f"node name {node!r} is not a node name")
    if rank < 0 or epoch < 0 or pid <= 0:
        raise ValueError(f"rank ({rank}), epoch ({epoch}) and pid ({pid}) must be >= 0, > 0")


@dataclass(frozen=True)
class LogChunk:
    """One piece of a daemon's answer to a :class:`LogRequest`: ``data`` is the file's bytes
    from where the previous chunk ended. ``final``: nothing follows (the whole file was sent,
    or, following, the process ended and its file was sent to the end); ``error`` (with
    ``final``): why the request cannot be answered, one sentence.

    Encoded as one JSON header line, a newline, then the raw bytes (log bytes need not be
    UTF-8, and base64 in a JSON record would cost a third more)."""

    request: str
    seq: int
    data: bytes = b""
    final: bool = False
    error: str = ""

    def encode(self) -> bytes:
        assert len(self.data) <= CHUNK_BYTES, f"log chunk of {len(self.data)} bytes"
        header = {"schema": SCHEMA, "record": "log-chunk", "request": self.request,
                  "seq": self.seq, "size": len(self.data), "final": self.final,
                  "error": self.error[:400]}
        return json.dumps(header, sort_keys=True, separators=(",", ":")).encode() + b"\n" + \
            self.data

    @classmethod
    def decode(cls, value: bytes) -> LogChunk:
        """Raises RecordError saying what is wrong with the value."""
        head, sep, data = value[:_HEADER_MAX + 1].partition(b"\n")
        if not sep:
            raise RecordError("log chunk has no header line")
        try:
            header = json.loads(head.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            raise RecordError("log chunk header is not UTF-8 JSON") from None
        if not isinstance(header, dict) or header.get("schema") != SCHEMA or \
                header.get("record") != "log-chunk":
            raise RecordError("value is not a log chunk")
        data = value[len(head) + 1:]
        request, seq, size = header.get("request"), header.get("seq"), header.get("size")
        final, error = header.get("final"), header.get("error")
        if not (isinstance(request, str) and _REQUEST_RE.match(request)) or \
                not isinstance(seq, int) or isinstance(seq, bool) or seq < 0 or \
                not isinstance(final, bool) or not isinstance(error, str) or \
                size != len(data) or len(data) > CHUNK_BYTES:
            raise RecordError("log chunk header has a bad field, or its size is not the data's")
        return cls(request=request, seq=seq, data=data, final=final, error=error)
