"""The exception family of ``understudy.sandbox``. ``str(exc)`` is one sentence for operators."""

from __future__ import annotations

from understudy.common.errors import UnderstudyError
from understudy.worker.api import CollectiveAborted


class SandboxError(UnderstudyError):
    """Base of every error the sandbox raises on purpose."""


class RecordingError(SandboxError):
    """A recording could not be written or read: an I/O error, a malformed manifest, or a data
    file that does not match the digest its manifest gives (a torn or replaced recording)."""


class RecordingMismatch(SandboxError):
    """A recording exists but was made for another job, layout, role type or code version; it
    cannot answer this process's collectives. ``field`` names what differed."""

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field


class ReplayDiverged(SandboxError, CollectiveAborted):
    """A collective issued in the sandbox does not match the recording (another op, shape, dtype
    or parameter), or the recording ran out. ``call`` is the call's index in its group,
    ``group`` the group's name.

    Also a :class:`~understudy.groups.errors.CollectiveAborted`: the worker runtime treats it like a
    collective that could not complete (it rolls the step back and re-raises) instead of
    counting it as this rank's compute failure and committing the step with the vote.
    """

    def __init__(self, message: str, *, group: str, call: int) -> None:
        CollectiveAborted.__init__(self, message, what=f"{group} call {call}", waited=0.0)
        self.group = group
        self.call = call
