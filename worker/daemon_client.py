"""A worker's connection to its node daemon's local socket (see ``daemon/localsock.py``).

Synchronous and dependency-free (no torch, no grpc): workers use it from their training loop,
and the process-group bootstrap store wraps it. Every call has a timeout.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import socket
from typing import Any

from understudy.daemon import env


class DaemonError(RuntimeError):
    """The daemon refused a request or could not be reached; the message says which."""


class DaemonClient:
    def __init__(self, namespace: str, epoch: int = 0, path: str | None = None,
                 timeout: float = 30.0) -> None:
        path = path or os.environ.get(env.CHILD_SOCKET)
        if not path:
            raise DaemonError(f"no daemon socket: {env.CHILD_SOCKET} is not set")
        self.timeout = timeout
        self._ids = itertools.count(1)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(path)
        except OSError as exc:
            self._sock.close()
            raise DaemonError(f"cannot reach the daemon at {path}: {exc.strerror}") from exc
        self._file = self._sock.makefile("rwb")
        try:
            self._call("hello", namespace=namespace, epoch=epoch)
        except DaemonError:
            self.close()
            raise

    def close(self) -> None:
        self._file.close()
        self._sock.close()

    def __enter__(self) -> DaemonClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, op: str, wait: float = 0.0, **args: Any) -> dict[str, Any]:
        rid = next(self._ids)
        self._sock.settimeout(self.timeout + wait)
        try:
            self._file.write(json.dumps({"id": rid, "op": op, **args}).encode() + b"\n")
            self._file.flush()
            line = self._file.readline()
        except OSError as exc:
            raise DaemonError(f"daemon connection failed during {op}: {exc}") from exc
        if not line:
            raise DaemonError(f"the daemon closed the connection during {op}")
        reply: dict[str, Any] = json.loads(line)
        if reply.get("id") != rid:
            raise DaemonError(f"daemon answered request {reply.get('id')} instead of {rid}")
        if not reply.get("ok"):
            raise DaemonError(str(reply.get("error")))
        return reply

    def ping(self) -> None:
        self._call("ping")

    def set(self, key: str, value: bytes) -> None:
        self._call("set", key=key, value=base64.b64encode(value).decode())

    def get(self, key: str, timeout: float = 0.0) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` seconds for it to be set."""
        reply = self._call("get", wait=timeout, key=key, timeout=timeout)
        return base64.b64decode(reply["value"])

    def add(self, key: str, amount: int) -> int:
        return int(self._call("add", key=key, amount=amount)["value"])

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        reply = self._call("compare_set", key=key, expected=base64.b64encode(expected).decode(),
                           desired=base64.b64encode(desired).decode())
        return base64.b64decode(reply["value"])

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", keys=keys)["present"])

    def delete(self, key: str) -> bool:
        return bool(self._call("delete", key=key)["deleted"])

    def warmth(self, mode: str, roles: list[str], detail: str = "",
               rank: int | None = None, holder: str | None = None) -> None:
        """As a standby worker: say what is warm (``rank``: the rank whose job it has built,
        which the controller prefers to give it; ``holder``: the id of the snapshot holder it
        runs, kept by the daemon until the worker exits). Every later request on this
        connection tells the daemon the worker is alive; one silent for long is replaced."""
        extra: dict[str, Any] = {} if rank is None else {"rank": rank}
        if holder is not None:
            extra["holder"] = holder
        self._call("warmth", mode=mode, roles=roles, detail=detail, **extra)

    def job(self) -> dict[str, Any] | None:
        """The job's assignment, status and migration records (JSON objects) as the daemon
        last saw them, or None if the daemon does not know the job."""
        info: dict[str, Any] | None = self._call("job")["job"]
        return info

    def num_keys(self) -> int:
        return int(self._call("num_keys")["count"])
