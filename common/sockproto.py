"""The local socket's protocol, shared by the daemon's server (``daemon/localsock.py``) and the
workers' client (``common/daemon_client.py``).

One JSON object per line each way. A request is ``{"id": n, "op": <Op>, ...arguments}``; its reply
is ``{"id": n, "ok": true, ...results}`` or ``{"id": n, "ok": false, "error": sentence}``, the
latter with ``"retry": true`` when the request was fine and etcd did not answer it (an outage: the
same request may succeed later; ``DaemonError.retryable``). A refused connection gets one reply
with ``"id": null``. Values are bytes, sent as base64 strings.
"""

from __future__ import annotations

import base64
import enum
import json
from typing import Any

#: the longest line either side accepts
MAX_LINE = 1024 * 1024


class Op(enum.StrEnum):
    HELLO = "hello"
    PING = "ping"
    SET = "set"
    GET = "get"
    ADD = "add"
    COMPARE_SET = "compare_set"
    CHECK = "check"
    DELETE = "delete"
    NUM_KEYS = "num_keys"
    #: the job's assignment, status and migration, as the daemon last saw them (no etcd call)
    JOB = "job"
    #: a standby worker says what it has warmed: ``{"mode": str, "roles": [str], "detail":
    #: str}``, and ``"holder"``, the id of its snapshot holder, if it runs one; every later
    #: request on that connection counts as a sign of life
    WARMTH = "warmth"
    #: a rank's report on its training for the daemon's metrics
    #: (:class:`~understudy.common.worker_report.WorkerReport`, fields at the top level)
    METRICS = "metrics"


#: the operations that change a key
WRITES = frozenset({Op.SET, Op.ADD, Op.COMPARE_SET, Op.DELETE})


def frame(message: dict[str, Any]) -> bytes:
    """One message as the line that carries it."""
    return json.dumps(message).encode() + b"\n"


def encode_value(value: bytes) -> str:
    return base64.b64encode(value).decode()


def decode_value(text: str) -> bytes:
    """Raises ``binascii.Error`` (a ``ValueError``) on anything but strict base64."""
    return base64.b64decode(text, validate=True)
