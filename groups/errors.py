"""The exception family of ``understudy.groups``. ``str(exc)`` is one sentence for operators."""

from __future__ import annotations

import torch.distributed as dist

from understudy.common.errors import UnderstudyError


class GroupError(UnderstudyError):
    """Base of every error the groups subsystem raises on purpose."""


class GroupStoreError(GroupError):
    """The bootstrap store (the daemon's key-value service) refused a request or is unreachable,
    including a hello refused for a stale epoch."""


class StoreTimeout(GroupStoreError, dist.DistStoreError):
    """A key did not appear within the store's timeout. Also a ``DistStoreError``, so torch code
    that expects its own stores' timeout type sees the one it knows."""


class StoreCancelled(GroupStoreError):
    """A wait in the store was cancelled (the build it served was abandoned)."""


class GroupBuildError(GroupError):
    """Building a group version failed; nothing was switched."""


class RetiredVersionError(GroupError):
    """A collective was issued on a group version that is no longer current."""


class NoCurrentVersionError(GroupError):
    """A collective was issued on a group that has no current version (fenced or not yet built)."""


class CollectiveAborted(GroupError):
    """A collective did not complete: a peer failed, stayed silent past the timeout, or the
    caller was told to abort (a peer is known to be gone). The group it ran on must be
    considered broken. The worker runtime raises and catches this same class.

    ``what`` names the collective, ``waited`` is how long this rank waited, in seconds.
    """

    def __init__(self, message: str, *, what: str = "the collective", waited: float = 0.0) -> None:
        super().__init__(message)
        self.what = what
        self.waited = waited


class CollectiveTimeout(CollectiveAborted):
    """A collective did not complete within the caller's deadline."""


class CollectiveFailed(CollectiveAborted):
    """The backend reported that a collective failed (peer reset, backend timeout)."""
