"""A worker's root cause, written where its daemon will find it.

A worker that dies writes one structured :class:`ErrorRecord` to the file named by
``$UNDERSTUDY_ERROR_FILE`` (set by the daemon's supervisor); the daemon reads it when it sees the
exit, and the daemon and the CLI show the *first* error rather than a wall of tracebacks.
Modelled on ``torch.distributed.elastic.multiprocessing.errors``::

    from understudy.common.errorfile import record

    @record
    def main() -> None:
        ...

This module is imported by the daemon as well as by workers: it must never import torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import sys
import tempfile
import time
import traceback
import types
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from understudy.common import env

#: The most a record may take on disk; larger files are refused as garbage when read.
MAX_RECORD_BYTES = 64 * 1024
#: A message is a sentence for operators, not a dump.
_MAX_MESSAGE_CHARS = 4096



@dataclass(frozen=True)
class ErrorRecord:
    """One worker's root cause.

    ``exc_type`` is the exception's class (qualified unless built in), ``where`` the innermost
    frame (``file.py:42 in step``), ``time`` the wall-clock time it was recorded.
    """

    message: str
    exc_type: str
    traceback: str
    time: float
    pid: int
    where: str

    @classmethod
    def from_exception(cls, exc: BaseException) -> ErrorRecord:
        return cls(message=str(exc), exc_type=_type_name(exc),
                   traceback="".join(traceback.format_exception(exc)), time=time.time(),
                   pid=os.getpid(), where=_where(exc.__traceback__))

    def summary(self) -> str:
        """``ValueError: bad batch (at train.py:42 in step)``: one line for operators."""
        first_line = self.message.strip().splitlines()[0] if self.message.strip() else ""
        if len(first_line) > 200:
            first_line = first_line[:197] + "..."
        text = f"{self.exc_type}: {first_line}" if first_line else self.exc_type
        return f"{text} (at {self.where})" if self.where else text

    def to_json(self) -> bytes:
        """Serialise to at most :data:`MAX_RECORD_BYTES`.

        What does not fit is dropped from the traceback's head (its tail names the failing frame),
        then from the message's tail.
        """
        rec = self
        if len(rec.message) > _MAX_MESSAGE_CHARS:
            rec = replace(rec, message=rec.message[:_MAX_MESSAGE_CHARS] + "...")
        data = _dump(rec)
        keep = len(rec.traceback)
        while len(data) > MAX_RECORD_BYTES and keep > 0:
            keep //= 2
            data = _dump(replace(rec, traceback="...(truncated)\n" + rec.traceback[-keep:]
                                 if keep else ""))
        assert len(data) <= MAX_RECORD_BYTES, "a record without traceback fits by construction"
        return data

    @classmethod
    def from_json(cls, data: bytes) -> ErrorRecord:
        """Parse a record written by :meth:`to_json`.

        Raises:
            ValueError: ``data`` is larger than :data:`MAX_RECORD_BYTES`, not JSON, not an
                object, or lacks a field of the right type. Unknown fields are ignored.
        """
        if len(data) > MAX_RECORD_BYTES:
            raise ValueError(f"error record is {len(data)} bytes, more than the "
                             f"{MAX_RECORD_BYTES} allowed")
        try:
            obj = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"error record is not JSON: {exc}") from exc
        if not isinstance(obj, dict):
            raise ValueError(f"error record is a JSON {type(obj).__name__}, not an object")
        fields: dict[str, Any] = {}
        for name, kinds in _FIELDS.items():
            value = obj.get(name)
            # bool is an int subclass; a boolean pid or time is garbage, not a number.
            if not isinstance(value, kinds) or isinstance(value, bool):
                raise ValueError(f"error record field {name!r} is {value!r}, expected "
                                 f"{' or '.join(k.__name__ for k in kinds)}")
            fields[name] = value
        fields["time"] = float(fields["time"])
        return cls(**fields)


_FIELDS: dict[str, tuple[type, ...]] = {
    "message": (str,), "exc_type": (str,), "traceback": (str,), "time": (int, float),
    "pid": (int,), "where": (str,),
}


def _dump(rec: ErrorRecord) -> bytes:
    return json.dumps(asdict(rec), ensure_ascii=True).encode()


def _type_name(exc: BaseException) -> str:
    cls = type(exc)
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def _where(tb: types.TracebackType | None) -> str:
    frames = traceback.extract_tb(tb)
    if not frames:
        return ""
    last = frames[-1]
    return f"{os.path.basename(last.filename)}:{last.lineno} in {last.name}"


def record_error(exc: BaseException, path: str | os.PathLike[str] | None = None) -> None:
    """Write ``exc`` as this process's root cause, unless one is recorded already.

    The file is ``path``, else ``$UNDERSTUDY_ERROR_FILE``; without either this does nothing. It
    appears complete or not at all (written aside, then hard-linked into place, which fails
    rather than overwrites), so the first error wins even between threads or processes.
    Never raises: it runs while the worker is already failing, and must not mask the cause;
    a failure to write is reported on stderr.
    """
    target = path if path is not None else os.environ.get(env.CHILD_ERROR_FILE)
    if not target:
        return
    target = Path(target)
    tmp: str | None = None
    try:
        if target.exists():
            return
        data = ErrorRecord.from_exception(exc).to_json()
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        try:
            os.link(tmp, target)
        except FileExistsError:
            pass  # an earlier error won
        except OSError:
            # A filesystem without hard links: rename, accepting a narrow race between writers.
            if not target.exists():
                os.replace(tmp, target)
                tmp = None
    except Exception as write_exc:  # never mask the cause (see docstring)
        print(f"understudy: could not record the error in {target}: {write_exc}",
              file=sys.stderr)
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def read_error(path: str | os.PathLike[str]) -> ErrorRecord | None:
    """The record in ``path``, or None when there is none.

    The worker controls what is at ``path``, and the daemon reads it on its event loop: a
    symbolic link is not followed, and anything but a regular file (a FIFO would block the
    read, and the loop with it, until the watchdog killed the daemon) is refused at once.

    Raises:
        ValueError: the file exists but holds no valid record (garbage, oversized, not a
            regular file).
        OSError: the file exists but cannot be read (a symbolic link among them).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{os.fspath(path)} is not a regular file")
        data = f.read(MAX_RECORD_BYTES + 1)
    return ErrorRecord.from_json(data)
