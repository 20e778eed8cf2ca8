"""``GroupSet``: one process's logical groups, their versions and the two-phase delta setup.

Phase 1 (:meth:`GroupSet.prepare`, :meth:`GroupSet.prepare_replacement`): build the next
version of only the groups that contain the leaving member, on a background thread per group,
while training keeps using the current versions. The joiner prepares the same versions with
itself in the leaver's slot; all meet in the bootstrap namespace ``<job>/<group>/v<version>``.

Phase 2 (:meth:`GroupSet.switch`), at the agreed iteration boundary, from the thread that issues
the collectives: make every prepared version current at once and retire the old ones. The stable
:class:`~understudy.groups.versioned.VersionedGroup` objects stay the same, so the model is not
rebuilt and holds no reference to any version.

A version number is used once per group: an abandoned attempt burns its number (its bootstrap
keys are still in etcd), and the next attempt must pick a higher one.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from understudy.common import failpoints, logs
from understudy.groups.errors import GroupBuildError
from understudy.groups.store import DaemonStore
from understudy.groups.versioned import (
    GroupVersion,
    StoreFactory,
    VersionedGroup,
    build_process_group,
    release,
)

NAME_RE = re.compile(r"^[A-Za-z0-9._-]+$")


@dataclass
class GroupStats:
    """What this process rebuilt. ``untouched`` counts groups that a replacement left alone
    because the leaver was not in them; ``last_*`` name the groups of the latest replacement."""

    prepared: int = 0
    switched: int = 0
    untouched: int = 0
    abandoned: int = 0
    failed: int = 0
    last_rebuilt: tuple[str, ...] = ()
    last_untouched: tuple[str, ...] = ()


@dataclass
class _Pending:
    version: GroupVersion
    cancel: threading.Event
    thread: threading.Thread


class GroupSet:
    """The logical groups of this process (``member``) in ``job``.

    ``store_factory`` makes the bootstrap store of one namespace; by default a
    :class:`~understudy.groups.store.DaemonStore` on the daemon socket (``socket_path`` or
    ``$UNDERSTUDY_SOCKET``) with this set's ``epoch``. ``backends`` maps device types to
    backends; by default gloo for CPU, plus NCCL for CUDA when CUDA is available (then
    ``device`` is the GPU the NCCL communicators connect on eagerly).

    Raises (constructor): ValueError for a job or member name the daemon would refuse, or a
    timeout that is not positive.
    """

    def __init__(self, job: str, member: str, *, epoch: int = 0, timeout: float = 30.0,
                 store_factory: StoreFactory | None = None, socket_path: str | None = None,
                 backends: dict[str, str] | None = None,
                 device: torch.device | None = None) -> None:
        _check_name("job", job)
        if not member:
            raise ValueError(f"member {member!r} must be a non-empty name")
        if not 0 < timeout < float("inf"):
            raise ValueError(f"group timeout must be a positive number of seconds, "
                             f"got {timeout!r}")
        self.job, self.member, self.timeout = job, member, timeout
        if backends is None:
            backends = {"cpu": "gloo"}
            if torch.cuda.is_available():
                backends["cuda"] = "nccl"
        self.backends = dict(backends)
        self.device = device
        self._store_factory = store_factory or self._daemon_store(socket_path)
        self._groups: dict[str, VersionedGroup] = {}
        self._pending: dict[str, _Pending] = {}
        self._highest: dict[str, int] = {}
        self._releases: list[threading.Thread] = []
        self._lock = threading.Lock()
        self.stats = GroupStats()
        self.epoch = epoch

    @property
    def epoch(self) -> int:
        """The epoch later builds say hello with; a promoted process raises it."""
        return self._epoch

    @epoch.setter
    def epoch(self, epoch: int) -> None:
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ValueError(f"epoch {epoch!r} is not a non-negative integer")
        self._epoch = epoch
        self.log = logs.get(job=self.job, member=self.member, epoch=epoch)

    def _daemon_store(self, socket_path: str | None) -> StoreFactory:
        def factory(namespace: str, cancel: threading.Event) -> DaemonStore:
            return DaemonStore(namespace, self.epoch, path=socket_path, timeout=self.timeout,
                               cancel=cancel)
        return factory

    # -- reading ------------------------------------------------------------------------------

    def names(self) -> list[str]:
        return sorted(self._groups)

    def current(self, name: str) -> VersionedGroup:
        """The stable group object of ``name``; hold it for the whole job.

        Raises: ValueError: no such group (not yet switched in on this process).
        """
        try:
            return self._groups[name]
        except KeyError:
            raise ValueError(f"no group named {name!r} on {self.member}; "
                             f"known: {self.names()}") from None

    def version(self, name: str) -> int:
        v = self.current(name).version
        return v.number if v is not None else 0

    def members(self, name: str) -> tuple[str, ...]:
        v = self.current(name).version
        return v.members if v is not None else ()

    def ready(self, names: Iterable[str]) -> bool:
        """Whether every named prepared version has finished building (successfully or not)."""
        return all(self._pending_of(n).version._built.is_set() for n in names)

    def wait_ready(self, names: Iterable[str], timeout: float) -> bool:
        """:meth:`ready`, waiting up to ``timeout`` seconds for it: returns the moment the last
        named version finished building, not at a poll's next tick."""
        deadline = time.monotonic() + timeout
        for name in names:
            if not self._pending_of(name).version._built.wait(
                    max(0.0, deadline - time.monotonic())):
                return False
        return True

    def pending(self) -> list[str]:
        return sorted(self._pending)

    # -- phase 1 ------------------------------------------------------------------------------

    def create(self, name: str, members: Sequence[str], version: int = 1) -> VersionedGroup:
        """Build a group and switch it in at once (job start). Raises as :meth:`prepare` and
        :meth:`switch`."""
        self.prepare(name, version, members)
        self.switch([name])
        return self.current(name)

    def reserve(self, name: str, rank: int, size: int) -> VersionedGroup:
        """The stable object of group ``name`` before it has any version (a joiner builds its
        model on it while phase 1 has not begun). Its collectives raise
        ``NoCurrentVersionError`` until the first :meth:`switch`.

        Raises:
            ValueError: a bad name, or the group exists with another rank or size.
        """
        _check_name("group", name)
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside a group of {size}")
        with self._lock:
            group = self._groups.get(name)
            if group is None:
                group = self._groups[name] = VersionedGroup(name, rank, size)
            elif (group.rank(), group.size()) != (rank, size):
                raise ValueError(f"{name} is rank {group.rank()} of {group.size()}, not "
                                 f"{rank} of {size}")
            return group

    def stand_in(self, name: str, rank: int, size: int, communicator: Any) -> VersionedGroup:
        """The stable object of group ``name`` with ``communicator`` as its current version
        (:meth:`GroupVersion.stand_in`, number 0): a standby's sandbox builds the job on the
        objects the job will keep, answered by replay groups. :meth:`fence` drops the stand-in
        and the first :meth:`switch` replaces it; neither touches ``communicator``.

        Raises:
            ValueError: as :meth:`reserve`, a ``communicator`` of another rank or size, or a
                group that has a current version already.
        """
        if (communicator.rank(), communicator.size()) != (rank, size):
            raise ValueError(f"the stand-in for {name} is rank {communicator.rank()} of "
                             f"{communicator.size()}, not {rank} of {size}")
        group = self.reserve(name, rank, size)
        with self._lock:
            if group.version is not None:
                raise ValueError(f"{name} has a current version already ({group.version!r})")
            group._install(GroupVersion.stand_in(name, rank, size, communicator))
        self.log.info("A stand-in answers the group until its first real version.", group=name)
        return group

    def prepare(self, name: str, version: int, members: Sequence[str]) -> GroupVersion:
        """Start building version ``version`` of ``name`` for ``members`` in the background.

        This process is ``members[i]`` with ``i`` its rank in the group; for an existing group
        the rank and size must stay those of its stable object (a joiner takes the leaver's
        slot).

        Raises:
            ValueError: a bad name, a version not above every one used before for this group,
                members with duplicates or without this process, a changed rank or size, or a
                version of this group already being prepared.
        """
        _check_name("group", name)
        members = tuple(members)
        if len(set(members)) != len(members):
            raise ValueError(f"members of {name} v{version} repeat a name: {members}")
        if self.member not in members:
            raise ValueError(f"{self.member} is not among the members of {name} v{version}: "
                             f"{members}")
        rank = members.index(self.member)
        with self._lock:
            if version <= self._highest.get(name, 0):
                raise ValueError(f"version {version} of {name} is not above "
                                 f"{self._highest[name]}, the highest used so far")
            if name in self._pending:
                raise ValueError(f"{name} v{self._pending[name].version.number} is already "
                                 "being prepared; switch or abandon it first")
            group = self._groups.get(name)
            if group is not None and (group.rank(), group.size()) != (rank, len(members)):
                raise ValueError(
                    f"{name} v{version} would put {self.member} at rank {rank} of "
                    f"{len(members)}, but the group is rank {group.rank()} of {group.size()}")
            v = GroupVersion(name, version, members, rank, f"{self.job}/{name}/v{version}")
            cancel = threading.Event()
            thread = threading.Thread(target=self._build, args=(v, cancel), daemon=True,
                                      name=f"group-build {v.namespace}")
            self._highest[name] = version
            self._pending[name] = _Pending(v, cancel, thread)
            self.stats.prepared += 1
        thread.start()
        self.log.info("Started building the next version of a group.", group=name,
                      version=version, members=list(members), rank=rank)
        return v

    def prepare_replacement(self, leaver: str, joiner: str,
                            version: int | None = None) -> list[str]:
        """Phase 1 on a survivor: prepare the next version of every group that contains
        ``leaver``, with ``joiner`` in its slot; leave the other groups untouched. ``version``
        defaults to each group's current version plus one. Returns the names being rebuilt.

        Raises:
            ValueError: this process is the leaver, or the joiner is already a member of a
                group that contains the leaver; or as :meth:`prepare`.
        """
        if leaver == self.member:
            raise ValueError(f"{self.member} is the leaver: it hands over, it does not rebuild")
        rebuilt, untouched = [], []
        plans: list[tuple[str, int, tuple[str, ...]]] = []
        for name in self.names():
            members = self.members(name)
            if leaver not in members:
                untouched.append(name)
                continue
            if joiner in members:
                raise ValueError(f"{joiner} is already a member of {name}: {members}")
            new = tuple(joiner if m == leaver else m for m in members)
            plans.append((name, version if version is not None else self.version(name) + 1,
                          new))
        for name, number, new in plans:
            self.prepare(name, number, new)
            rebuilt.append(name)
        self.stats.untouched += len(untouched)
        self.stats.last_rebuilt, self.stats.last_untouched = tuple(rebuilt), tuple(untouched)
        self.log.info(f"Rebuilding {len(rebuilt)} group(s) that contain {leaver}, "
                      f"{len(untouched)} untouched.", leaver=leaver, joiner=joiner,
                      rebuilt=rebuilt, untouched=untouched)
        return rebuilt

    def _build(self, v: GroupVersion, cancel: threading.Event) -> None:
        t0 = time.monotonic()
        store: Any = None
        # a fault test's build that comes up late (``group.build.dp-1=2*sleep(3)``: this
        # process's first two builds of dp-1, its first version's and the next)
        failpoints.hit(f"group.build.{v.name}")
        try:
            store = self._store_factory(v.namespace, cancel)
            pg = build_process_group(store, v.rank, v.size, timedelta(seconds=self.timeout),
                                     self.backends, self.device)
        except Exception as exc:  # reported at the switch, where the caller decides
            v._fail(exc)
            if store is not None:
                self._track(release([store]))
            self.log.warning("Building a group version failed.", group=v.name,
                             version=v.number, error=str(exc))
            return
        v.build_seconds = time.monotonic() - t0
        v._attach(pg, store)
        self.log.info("Built a group version.", group=v.name, version=v.number,
                      seconds=round(v.build_seconds, 4))

    # -- phase 2 ------------------------------------------------------------------------------

    def switch(self, names: Iterable[str], timeout: float | None = None) -> None:
        """Make the prepared versions of ``names`` current, all or none, and retire the old
        ones (their communicators are released on a background thread). Waits up to
        ``timeout`` (default: the set's) for builds still running.

        Raises:
            ValueError: a name has no prepared version.
            GroupBuildError: a build failed or did not finish in time; nothing was switched and
                the prepared versions stay pending (abandon them, or switch again).
        """
        names = list(dict.fromkeys(names))
        pendings = [self._pending_of(n) for n in names]
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        try:
            for p in pendings:
                p.version._wait_built(max(0.0, deadline - time.monotonic()))
        except GroupBuildError:
            self.stats.failed += 1
            raise
        t0 = time.monotonic()
        changes = []
        with self._lock:
            for p in pendings:
                v = p.version
                del self._pending[v.name]
                group = self._groups.get(v.name)
                if group is None:
                    group = self._groups[v.name] = VersionedGroup(v.name, v.rank, v.size)
                v._make_current()
                old = group._install(v)
                if old is not None:
                    self._track(release(old._retire()))
                changes.append((v.name, old.number if old else 0, v.number))
            self.stats.switched += len(pendings)
        self.log.info("Switched group versions.", switched={n: f"v{a}->v{b}" for n, a, b
                                                            in changes},
                      seconds=round(time.monotonic() - t0, 4))

    def abandon(self, names: Iterable[str] | None = None, timeout: float = 2.0) -> list[str]:
        """Drop prepared versions (all by default): cancel their builds, waiting up to
        ``timeout`` for the threads. A build stuck past that ends at the group timeout and its
        result is discarded. Returns the names abandoned."""
        with self._lock:
            chosen = list(self._pending) if names is None else [n for n in names
                                                                if n in self._pending]
            dropped = [self._pending.pop(n) for n in chosen]
            self.stats.abandoned += len(dropped)
        for p in dropped:
            p.cancel.set()
            self._track(release(p.version._retire()))
        deadline = time.monotonic() + timeout
        for p in dropped:
            p.thread.join(max(0.0, deadline - time.monotonic()))
        if dropped:
            self.log.info("Abandoned prepared group versions.", groups=chosen)
        return chosen

    def fence(self, names: Iterable[str]) -> None:
        """Retire the current versions of ``names`` now, without a replacement: after an
        aborted collective, nothing may be issued on the stuck communicator. The groups raise
        ``NoCurrentVersionError`` until the next switch.

        Raises: ValueError: an unknown group.
        """
        for name in names:
            old = self._unset(name, abort=True)
            if old is not None:
                self.log.warning("Fenced a group version.", group=name, version=old.number)

    def retire_stand_ins(self) -> list[str]:
        """Retire every stand-in that is still current (the sandbox is over): those groups
        raise ``NoCurrentVersionError`` until their first real version is switched in. Returns
        their names."""
        names = [n for n in self.names() if (v := self._groups[n].version) is not None
                 and not v._owned]
        for name in names:
            self._unset(name)
        if names:
            self.log.info("Retired the stand-ins; the groups wait for their first real "
                          "version.", groups=names)
        return names

    def _unset(self, name: str, abort: bool = False) -> GroupVersion | None:
        old = self.current(name)._install(None)
        if old is not None:
            self._track(release(old._retire(), abort=abort))
        return old

    def close(self, timeout: float = 5.0) -> None:
        """Abandon what is pending, retire every current version and wait, up to ``timeout``,
        for the communicators to be released."""
        deadline = time.monotonic() + timeout
        self.abandon(timeout=timeout / 2)
        for name in self.names():
            self._unset(name)
            self._groups[name].unregister()
        for t in self._releases:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self._releases):
            self.log.warning("A retired communicator is still being released (stuck on a "
                             "peer until its backend timeout).")

    # -- internals ----------------------------------------------------------------------------

    def _pending_of(self, name: str) -> _Pending:
        try:
            return self._pending[name]
        except KeyError:
            raise ValueError(f"{name} has no prepared version on {self.member}; "
                             f"pending: {self.pending()}") from None

    def _track(self, thread: threading.Thread) -> None:
        self._releases = [t for t in self._releases if t.is_alive()]
        self._releases.append(thread)


def _check_name(what: str, name: str) -> None:
    if not isinstance(name, str) or not NAME_RE.match(name) or name in (".", ".."):
        raise ValueError(f"{what} name {name!r} must be letters, digits, '.', '_' or '-'")
