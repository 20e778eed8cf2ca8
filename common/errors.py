"""The daemon's exception family. Operators see ``str(exc)``: one clear sentence."""


class UnderstudyError(Exception):
    """Base of every error understudy raises on purpose."""


class ConfigError(UnderstudyError):
    """The configuration is malformed or inconsistent (exit code 2)."""


class RecordError(UnderstudyError):
    """A value read from etcd is garbage, foreign, oversized or of an unknown schema."""


class StoreError(UnderstudyError):
    """etcd could not be reached or refused the request."""


class ConflictError(StoreError):
    """A compare-and-swap lost its race; re-read and decide again."""


class NotFoundError(UnderstudyError):
    """A named thing (node, job) does not exist."""
