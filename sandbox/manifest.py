"""What a recording is for: the job, its layout, the role type, the code version; and how
recordings sit on disk.

A recording directory holds one folder per role type, named by :attr:`RoleType.key`::

    <recording_dir>/stage-only.tp-0-of-2/manifest.json
    <recording_dir>/stage-only.tp-0-of-2/calls-<sha256 prefix>.pt

Every file is written to a temporary name in the same folder and renamed into place, data file
first, manifest last; the manifest names the data file and its SHA-256. A reader that goes
through the manifest therefore never sees half a recording, and a data file replaced under it
is detected by its digest.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import importlib.metadata
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from understudy.common.layout import Layout
from understudy.sandbox.errors import RecordingError, RecordingMismatch

#: Bumped whenever the manifest or the data file changes shape; readers refuse other formats.
FORMAT = 1
MANIFEST = "manifest.json"
#: A manifest is small; anything larger is not one of ours.
MAX_MANIFEST_BYTES = 1 << 20


class Stage(enum.Enum):
    """The pipeline-stage type of a rank: stages of one type run the same code paths (the first
    embeds, the last computes the loss, middle stages only pass activations on)."""

    ONLY = "only"
    """No pipeline parallelism: the rank is every stage."""
    FIRST = "first"
    MIDDLE = "middle"
    LAST = "last"

    @classmethod
    def of(cls, pp_index: int, pp: int) -> Stage:
        if pp == 1:
            return cls.ONLY
        if pp_index == 0:
            return cls.FIRST
        return cls.LAST if pp_index == pp - 1 else cls.MIDDLE


@dataclass(frozen=True)
class RoleType:
    """Ranks of one role type issue the same collectives, with the same shapes, in the same
    order: in a TP x DP (x PP) job, that is the stage type and the TP index. The DP index only
    changes the data, so one recording serves every replica's rank with those coordinates.
    """

    stage: Stage
    tp_index: int
    tp: int

    @property
    def key(self) -> str:
        """A stable, file-name-safe name, e.g. ``stage-only.tp-0-of-2``."""
        return f"stage-{self.stage.value}.tp-{self.tp_index}-of-{self.tp}"

    @classmethod
    def of(cls, rank: int, layout: Layout) -> RoleType:
        """The role type of ``rank``.

        Raises:
            ValueError: ``rank`` is outside the layout's world.
        """
        tp_index, _, pp_index = layout.coordinates(rank)
        return cls(Stage.of(pp_index, layout.pp), tp_index, layout.tp)


def recording_ranks(layout: Layout) -> dict[str, int]:
    """The rank that records each role type, by :attr:`RoleType.key`: the first DP replica's,
    in the first stage of each stage type. Recording is once per role type, not per rank."""
    stages = sorted({0, min(1, layout.pp - 1), layout.pp - 1})
    ranks: dict[str, int] = {}
    for pp_index in stages:
        for tp_index in range(layout.tp):
            rank = layout.rank_of(tp_index, 0, pp_index)
            ranks.setdefault(RoleType.of(rank, layout).key, rank)
    return ranks


@dataclass(frozen=True)
class CodeVersion:
    """What the recorded collectives depend on besides the layout: the training script's bytes,
    understudy's version and torch's. A standby replays only a recording of the same code."""

    script_sha256: str
    understudy: str
    torch: str

    @property
    def digest(self) -> str:
        text = f"{self.script_sha256}/{self.understudy}/{self.torch}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @classmethod
    def of(cls, script: Path | str) -> CodeVersion:
        """The code version of this process running ``script``.

        Raises:
            RecordingError: ``script`` cannot be read.
        """
        try:
            data = Path(script).read_bytes()
        except OSError as exc:
            raise RecordingError(f"cannot read the training script {script} to compute the "
                                 f"code version: {exc}") from exc
        return cls(hashlib.sha256(data).hexdigest(), _version("understudy"), _version("torch"))

    def difference(self, other: CodeVersion) -> str | None:
        """A sentence naming what differs from ``other``, or None if nothing does."""
        parts = [f"{name} {mine!r} vs {theirs!r}" for name, mine, theirs in (
            ("training script sha256", self.script_sha256[:12], other.script_sha256[:12]),
            ("understudy", self.understudy, other.understudy),
            ("torch", self.torch, other.torch)) if mine != theirs]
        return "; ".join(parts) or None


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class Expectation:
    """What a replaying process requires of a recording (see :meth:`Manifest.check`)."""

    job: str
    layout: Layout
    role_type: RoleType
    code: CodeVersion


@dataclass(frozen=True)
class Manifest:
    """The JSON file that ties one recording to its job (see the module docstring).

    ``groups`` maps each group name to ``[rank, size]`` of the recording rank there;
    ``segments`` maps ``"build"`` and each recorded step (as a string) to its number of calls;
    ``data_file`` is the data file's name in the same folder, ``data_sha256`` its digest.
    """

    job: str
    layout: Layout
    role_type: str
    rank: int
    groups: dict[str, list[int]]
    first_step: int
    iterations: int
    calls: int
    segments: dict[str, int]
    code: CodeVersion
    data_file: str
    data_sha256: str
    data_bytes: int
    created_unix: float
    record_seconds: float
    format: int = FORMAT

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, *, source: str) -> Manifest:
        """Raises: RecordingError: the text is not a manifest of this format."""
        try:
            raw = json.loads(text)
            if raw.get("format") != FORMAT:
                raise RecordingError(f"{source} has format {raw.get('format')!r}; this "
                                     f"understudy reads format {FORMAT} only")
            raw["layout"] = Layout(**raw["layout"])
            raw["code"] = CodeVersion(**raw["code"])
            return cls(**raw)
        except RecordingError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise RecordingError(f"{source} is not a valid recording manifest: "
                                 f"{type(exc).__name__}: {exc}") from exc

    def check(self, expected: Expectation) -> None:
        """Refuse a recording that cannot answer the expected process's collectives.

        Raises:
            RecordingMismatch: the job, layout, role type or code version differs; ``field``
                says which, the message says both values.
        """
        where = f"the recording of {self.job!r} ({self.role_type}, rank {self.rank})"
        if self.job != expected.job:
            raise RecordingMismatch(f"{where} belongs to job {self.job!r}, not "
                                    f"{expected.job!r}", field="job")
        if self.layout != expected.layout:
            raise RecordingMismatch(f"{where} was made with {self.layout.describe()}, but this "
                                    f"process runs {expected.layout.describe()}", field="layout")
        if self.role_type != expected.role_type.key:
            raise RecordingMismatch(f"{where} is for role type {self.role_type}, but this "
                                    f"process needs {expected.role_type.key}", field="role_type")
        diff = self.code.difference(expected.code)
        if diff is not None:
            raise RecordingMismatch(f"{where} was made by other code ({diff}): its collectives "
                                    "may not be the ones this code issues", field="code")


def role_directory(recording_dir: Path | str, role_type: RoleType | str) -> Path:
    """The folder of one role type's recording."""
    key = role_type.key if isinstance(role_type, RoleType) else role_type
    return Path(recording_dir) / key


def read_manifest(folder: Path) -> Manifest:
    """The manifest in ``folder`` (a :func:`role_directory`).

    Raises:
        RecordingError: there is none, or it is unreadable or malformed.
    """
    path = folder / MANIFEST
    try:
        with path.open("rb") as f:
            text = f.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise RecordingError(f"no recording at {folder} (no {MANIFEST})") from None
    except OSError as exc:
        raise RecordingError(f"cannot read {path}: {exc}") from exc
    if len(text) > MAX_MANIFEST_BYTES:
        raise RecordingError(f"{path} is larger than {MAX_MANIFEST_BYTES} bytes: not a manifest")
    return Manifest.from_json(text.decode("utf-8", errors="replace"), source=str(path))


def atomic_write(path: Path, write: Any) -> None:
    """Create or replace ``path`` atomically: ``write(file)`` fills a temporary file in the same
    folder, which is flushed to disk and renamed over ``path``. A crash leaves the old file or
    the new one, never half of one; the temporary is removed on error.

    Raises:
        OSError: from the file system.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a crash
    finally:
        os.close(dir_fd)


def sha256_file(path: Path) -> tuple[str, int]:
    """``(hex digest, size in bytes)`` of a file, read in 1 MiB chunks."""
    h, size = hashlib.sha256(), 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size
