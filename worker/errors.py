"""What a job uses to report its root cause to its daemon (the record's format and file are
:mod:`understudy.common.errorfile`)::

    from understudy.worker.errors import record

    @record
    def main() -> None:
        ...
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from understudy.common.errorfile import ErrorRecord, read_error, record_error

__all__ = ["ErrorRecord", "install_excepthook", "read_error", "record", "record_error"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _should_record(exc: BaseException) -> bool:
    # sys.exit(1) says nothing the exit code does not; sys.exit("reason") carries a reason.
    if isinstance(exc, SystemExit):
        return exc.code is not None and not isinstance(exc.code, int)
    return True


def record(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Decorate a worker's main function: record what escapes it, then re-raise.

    Records every exception except ``SystemExit`` with an integer code (``sys.exit(1)``).
    """

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return fn(*args, **kwargs)
        except BaseException as exc:
            if _should_record(exc):
                record_error(exc)
            raise

    return wrapper


def install_excepthook() -> None:
    """Record any exception that reaches the top of the main thread, then let the previous hook
    print it as usual. Installing twice is harmless."""
    previous = sys.excepthook
    if getattr(previous, "_understudy_hook", False):
        return

    def hook(exc_type: type[BaseException], exc: BaseException,
             tb: types.TracebackType | None) -> None:
        if _should_record(exc):
            record_error(exc.with_traceback(tb))
        previous(exc_type, exc, tb)

    hook._understudy_hook = True  # type: ignore[attr-defined]
    sys.excepthook = hook
