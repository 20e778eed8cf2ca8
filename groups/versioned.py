"""Stable group objects whose communicator is replaced by version underneath.

The mechanism (evidence in ``docs/groups.md`` and ``tests/unit/test_groups.py``): a
:class:`VersionedGroup` is a Python subclass of ``torch.distributed.ProcessGroup`` that the model,
the runtime and Megatron's ``parallel_state`` hold for the whole job. Every collective it receives
is forwarded to its current :class:`GroupVersion`, a real ``ProcessGroup`` with a gloo (CPU) or
NCCL (CUDA) backend built for one membership. A switch replaces the version; nothing outside
holds a version's communicator, so after a switch no collective can reach the old one, and a
captured :class:`GroupVersion` raises :class:`RetiredVersionError` if used.

On torch 2.13 every ``torch.distributed`` collective function calls the group object's method by
name from Python (``all_gather_into_tensor`` calls ``all_gather_single``, ``reduce_scatter_tensor``
calls ``reduce_scatter_single``), so the overrides below see them all. Paths that go straight to
the C++ dispatcher (``torch.ops.c10d``, functional collectives, torch.compile) reject a Python
subclass with a type error instead of silently using some communicator.
"""

from __future__ import annotations

import contextlib
import enum
import os
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _C_Backend
from torch.distributed.distributed_c10d import _world

from understudy.common import env
from understudy.groups.errors import GroupBuildError, NoCurrentVersionError, RetiredVersionError

#: Builds a torch store for one bootstrap namespace; waits in it stop when the event is set.
StoreFactory = Callable[[str, threading.Event], dist.Store]

#: Sees a collective on its way: ``tap(method, args, kwargs, issue)`` returns what
#: ``issue(*args, **kwargs)`` (the current version's method) returns, or stands in for it.
Tap = Callable[[str, tuple[Any, ...], dict[str, Any], Callable[..., Any]], Any]

#: ``ProcessGroup`` methods that issue communication; the stable group forwards each by name.
FORWARDED = (
    "allreduce", "allreduce_coalesced", "broadcast", "reduce",
    "allgather", "all_gather_single", "_allgather_base", "allgather_coalesced",
    "all_gather_single_coalesced", "allgather_into_tensor_coalesced",
    "gather", "scatter",
    "reduce_scatter", "reduce_scatter_single", "_reduce_scatter_base",
    "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced",
    "alltoall", "alltoall_base", "all_to_all_single", "send", "recv", "recv_anysource", "barrier",
    "_start_coalescing", "_end_coalescing",
)


class VersionState(enum.Enum):
    """Lifecycle of one group version. Legal transitions (``GroupVersion._set`` only)::

        building -> ready -> current -> retired
        building -> failed
        building | ready -> retired      (abandoned before the switch)
    """

    BUILDING = "building"
    READY = "ready"
    CURRENT = "current"
    RETIRED = "retired"
    FAILED = "failed"


_TRANSITIONS = {
    VersionState.BUILDING: {VersionState.READY, VersionState.FAILED, VersionState.RETIRED},
    VersionState.READY: {VersionState.CURRENT, VersionState.RETIRED},
    VersionState.CURRENT: {VersionState.RETIRED},
    VersionState.RETIRED: set(),
    VersionState.FAILED: set(),
}


class GroupVersion:
    """One communicator for one membership of a logical group.

    ``members[rank]`` is this process. Counts the operations issued on it (``ops``), which is
    how tests show that nothing reaches a version after it is retired.
    """

    def __init__(self, name: str, number: int, members: Sequence[str], rank: int,
                 namespace: str) -> None:
        self.name, self.number, self.namespace = name, number, namespace
        self.members = tuple(members)
        self.rank = rank
        self.ops = 0
        self.build_seconds = 0.0
        self.state = VersionState.BUILDING
        self.error: BaseException | None = None
        self._pg: dist.ProcessGroup | None = None
        self._store: dist.Store | None = None
        self._lock = threading.Lock()
        self._built = threading.Event()
        #: whether retiring this version releases its communicator (a stand-in's is not ours)
        self._owned = True

    @classmethod
    def stand_in(cls, name: str, rank: int, size: int, communicator: Any) -> GroupVersion:
        """Version 0 of ``name``, current from the start, whose communicator is any object with
        the ``ProcessGroup`` methods (a sandbox's replay group): the stable group can be handed
        to a model before the job's real communicators exist. Its members are placeholders,
        nothing is bootstrapped, and retiring it leaves ``communicator`` to its owner."""
        v = cls(name, 0, [f"stand-in-{i}" for i in range(size)], rank, f"{name}/stand-in")
        v._owned = False
        v._pg = communicator
        v._set(VersionState.READY)
        v._set(VersionState.CURRENT)
        v._built.set()
        return v

    def __repr__(self) -> str:
        return (f"GroupVersion({self.name} v{self.number}, rank {self.rank} of "
                f"{len(self.members)}, {self.state.value})")

    @property
    def size(self) -> int:
        return len(self.members)

    def _set(self, to: VersionState) -> None:
        """The one place the state changes; the caller holds ``_lock``."""
        assert to in _TRANSITIONS[self.state], f"{self!r} cannot become {to.value}"
        self.state = to

    def _make_current(self) -> None:
        with self._lock:
            self._set(VersionState.CURRENT)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Issue ``method`` on this version's communicator.

        Raises:
            RetiredVersionError: the version is not current (retired, failed or not switched in).
        """
        pg = self._pg
        if self.state is not VersionState.CURRENT or pg is None:
            raise RetiredVersionError(f"{self.name} v{self.number} is {self.state.value}: a "
                                      "collective must go through the group's current version")
        self.ops += 1
        return getattr(pg, method)(*args, **kwargs)

    def device_types(self) -> list[torch.device]:
        pg = self._pg
        return list(pg._device_types) if pg is not None else []

    # -- used by GroupSet -------------------------------------------------------------------

    def _attach(self, pg: dist.ProcessGroup, store: dist.Store) -> None:
        """The build finished: keep its communicator unless the version was abandoned."""
        with self._lock:
            if self.state is VersionState.BUILDING:
                self._pg, self._store = pg, store
                self._set(VersionState.READY)
                keep = True
            else:
                keep = False
        self._built.set()
        if not keep:
            release([pg, store])

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            self.error = error
            if self.state is VersionState.BUILDING:
                self._set(VersionState.FAILED)
        self._built.set()

    def _wait_built(self, timeout: float) -> None:
        """Raises GroupBuildError if the build failed or did not finish within ``timeout``."""
        if not self._built.wait(timeout):
            raise GroupBuildError(f"{self.name} v{self.number} was not built within "
                                  f"{timeout:g}s (a member did not join)")
        if self.state is VersionState.FAILED:
            raise GroupBuildError(f"building {self.name} v{self.number} failed: "
                                  f"{self.error}") from self.error

    def _retire(self) -> list[Any]:
        """Retire (idempotent; a failed version stays failed) and hand back what must be
        released, off the caller's thread (see :func:`release`)."""
        with self._lock:
            if VersionState.RETIRED in _TRANSITIONS[self.state]:
                self._set(VersionState.RETIRED)
            held = [h for h in (self._pg, self._store) if h is not None and self._owned]
            self._pg = self._store = None
        return held


class VersionedGroup(dist.ProcessGroup):
    """The stable group object: one per logical group for the whole job.

    Its ``rank()`` and ``size()`` never change: a joiner takes the leaver's slot. Every
    collective goes to the current version; with none (before the first switch, or fenced after
    an abort) it raises :class:`NoCurrentVersionError`. A :data:`Tap` set with :meth:`tap` sees
    each collective on its way to the version (a recorder), until it is removed.
    """

    def __init__(self, name: str, rank: int, size: int) -> None:
        # The (rank, size) constructor is the pybind trampoline's; stubs list only the C++ one.
        super().__init__(rank, size)  # type: ignore[call-arg]
        self.logical_name = name
        self._current: GroupVersion | None = None
        self._tap: Tap | None = None

    def __repr__(self) -> str:
        v = self._current
        return (f"VersionedGroup({self.logical_name} "
                f"{'v' + str(v.number) if v else 'without a version'}, "
                f"rank {self.rank()} of {self.size()})")

    @property
    def version(self) -> GroupVersion | None:
        return self._current

    @property
    def _device_types(self) -> list[torch.device]:
        v = self._current
        return v.device_types() if v is not None else []

    def _live(self) -> GroupVersion:
        v = self._current
        if v is None:
            raise NoCurrentVersionError(f"group {self.logical_name} has no current version")
        return v

    def register(self, global_ranks: Sequence[int]) -> None:
        """Tell ``torch.distributed`` which job-wide ranks the group spans (group rank ``i`` is
        ``global_ranks[i]``), as ``new_group`` would. Then ``dist.recv``, ``P2POp`` and
        ``get_global_rank`` accept the group (with a default group, ``get_rank(group)`` too).
        Once per stable object: a switch does not change it, the joiner takes the leaver's
        global rank.

        Raises: ValueError: the ranks repeat, or are not ``size()`` many.
        """
        ranks = list(global_ranks)
        if len(ranks) != self.size() or len(set(ranks)) != len(ranks):
            raise ValueError(f"global ranks {ranks} do not name {self.size()} distinct ranks")
        _world.pg_group_ranks[self] = {g: i for i, g in enumerate(ranks)}

    def unregister(self) -> None:
        _world.pg_group_ranks.pop(self, None)

    def tap(self, tap: Tap | None) -> None:
        """From now on every collective is issued as ``tap(method, args, kwargs, issue)``, where
        ``issue(*args, **kwargs)`` sends it to the current version; None removes the tap (a
        forwarded call then costs nothing more than before). The model keeps the same object."""
        self._tap = tap

    def _install(self, version: GroupVersion | None) -> GroupVersion | None:
        """Make ``version`` current (None: fence); return the previous one."""
        if version is not None:
            assert (version.rank, version.size) == (self.rank(), self.size()), \
                f"{version!r} does not fit the slot of {self!r}"
        old, self._current = self._current, version
        return old


def _forwarder(method: str) -> Callable[..., Any]:
    def forward(self: VersionedGroup, *args: Any, **kwargs: Any) -> Any:
        tap = self._tap
        if tap is None:
            return self._live().call(method, *args, **kwargs)
        version = self._live()
        return tap(method, args, kwargs,
                   lambda *a, **k: version.call(method, *a, **k))

    forward.__name__ = forward.__qualname__ = method
    forward.__doc__ = f"Forward ``{method}`` to the current version."
    return forward


for _method in FORWARDED:
    setattr(VersionedGroup, _method, _forwarder(_method))


def release(held: list[Any], *, abort: bool = False) -> threading.Thread:
    """Drop the last references to a communicator and its store on a named background thread.

    A gloo group whose collective is stuck on a frozen peer blocks in its destructor until the
    backend's timeout; the training thread must never be the one that runs it. The thread is a
    daemon thread so that process exit does not wait for such a destructor.

    ``abort``: the communicator may be stuck (a fenced version). Its CUDA backend (NCCL) is
    aborted first, on the caller's thread, before this returns: a collective whose peer is gone
    keeps its kernel spinning on the GPU until then, and the next device-wide synchronisation (a
    new communicator's set-up, a free of device memory) would wait for it (seen by
    scripts/gpu-selftest's crash check). Aborted on the release thread instead, it raced with
    the caller building its next communicators (one crash check in six failed on an H200).
    Without CUDA this costs nothing.
    """
    box = list(held)
    held.clear()
    if abort:
        for obj in box:
            _abort_device_backend(obj)

    def drop() -> None:
        while box:
            obj = box.pop()
            shutdown = getattr(obj, "shutdown", None) or getattr(obj, "close", None)
            if shutdown is not None:
                # A broken communicator may refuse; dropping the reference is all that is left.
                with contextlib.suppress(RuntimeError):
                    shutdown()
            del obj

    t = threading.Thread(target=drop, name="group-release", daemon=True)
    t.start()
    return t


def _abort_device_backend(pg: Any) -> None:
    get = getattr(pg, "_get_backend", None)
    if get is None or not torch.cuda.is_available():
        return
    # No CUDA backend, or one that refuses (aborted already): nothing left to end.
    with contextlib.suppress(RuntimeError, AttributeError):
        get(torch.device("cuda")).abort()


def gloo_backend(store: dist.Store, rank: int, size: int,
                 timeout: timedelta) -> dist.ProcessGroupGloo:
    """Gloo for a group of this worker, its device bound to the node's address (the daemon's
    first ``addresses`` entry, ``UNDERSTUDY_NODE_ADDRESS``): the address other nodes reach this
    node's workers on. Without one, or with ``GLOO_SOCKET_IFNAME`` set (the operator's choice
    of interfaces), torch's own choice: those interfaces, else the address the host name
    resolves to, which on a stock Debian host is 127.0.1.1, a loopback address no other node
    can reach."""
    address = os.environ.get(env.NODE_ADDRESS)
    if not address or os.environ.get("GLOO_SOCKET_IFNAME"):
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # not in the stubs
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    opts._threads = 2  # torch's own: two per device
    return dist.ProcessGroupGloo(store, rank, size, opts)


def build_process_group(store: dist.Store, rank: int, size: int, timeout: timedelta,
                        backends: dict[str, str], device: torch.device | None) -> dist.ProcessGroup:
    """A real ``ProcessGroup`` with one backend per device type (``{"cpu": "gloo", "cuda":
    "nccl"}``), each bootstrapping under its own prefix of ``store``. NCCL is connected eagerly
    on ``device`` so that the communicator exists before the switch.

    Raises:
        ValueError: an unknown backend name. GroupBuildError: NCCL requested but unavailable.
    """
    pg = dist.ProcessGroup(store, rank, size)
    default: dist.ProcessGroup.BackendType | None = None
    for device_type, name in backends.items():
        prefixed = dist.PrefixStore(name, store)
        backend: _C_Backend
        if name == "gloo":
            kind = dist.ProcessGroup.BackendType.GLOO
            backend = gloo_backend(prefixed, rank, size, timeout)
        elif name == "nccl":
            if not dist.is_nccl_available():
                raise GroupBuildError("NCCL was asked for but this torch has no NCCL")
            kind = dist.ProcessGroup.BackendType.NCCL
            # On a collective error torch's default (1, tear down) kills the whole process a
            # while later "to avoid data inconsistency": a survivor of a dead peer would die
            # after it had moved on to the next version (seen by scripts/gpu-selftest). 2
            # (clean up only) aborts the broken communicator and leaves the process alive;
            # the step protocol already keeps a failed step from applying. Read when the
            # backend is made; a value the job set is kept.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            nccl = dist.ProcessGroupNCCL(prefixed, rank, size, opts)
            if device is not None:
                nccl.eager_connect_single_device(device)
            backend = nccl
        else:
            raise ValueError(f"unknown backend {name!r} for {device_type}: use gloo or nccl")
        pg._register_backend(torch.device(device_type), kind, backend)
        default = default or kind
    if default is None:
        raise ValueError("a group needs at least one backend")
    pg._set_default_backend(default)
    if device is not None:
        pg.bound_device_id = device
    return pg
