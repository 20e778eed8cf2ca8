"""The standby worker's warmup, as the launcher runs it (``worker/launch.py``).

With a recording directory (``UNDERSTUDY_RECORDINGS`` in the job's environment: a shared
filesystem in production), the job's designated ranks record their first iterations (see
:mod:`understudy.sandbox.recording`) and each standby worker:

1. reports ``imports`` warmth, then waits for the recording of the role type it warms as (the
   i-th standby node of the job takes the i-th role type, round robin, so a pool of as many
   standbys as role types covers them all), answering a plan that chooses it meanwhile;
2. builds the job as that role type's recording rank on the stable groups that rank will keep
   (a :class:`~understudy.groups.groupset.GroupSet` with no real version yet), whose replay
   groups stand in for the real communicators, and runs the shadow iterations
   (:func:`~understudy.sandbox.warmup.warm_up`); then reports ``replay`` warmth (``plain`` if
   the recording was refused or the replay diverged: the model is built anyway);
3. parks until chosen. Chosen for the rank it warmed as, it is promoted: the stand-ins are
   retired, the joiner switches the real versions into the same group objects the job holds
   (Megatron's ``parallel_state`` included), and the job is given the real state. Chosen for
   another rank, it retargets the job if the job can (another pipeline stage), or builds that
   rank's job afresh, with its imports warm.
"""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from understudy.common import logs
from understudy.common.daemon_client import DaemonClient, DaemonError
from understudy.common.layout import Layout
from understudy.groups.groupset import GroupSet
from understudy.sandbox.manifest import MANIFEST, RoleType, recording_ranks, role_directory
from understudy.sandbox.warmup import SandboxTarget, Warmed, WarmupOutcome, warm_up
from understudy.worker.api import TrainingJob
from understudy.worker.migration import Plan, chosen_rank, member

if TYPE_CHECKING:
    import torch

#: Iterations a designated rank records.
RECORDED_ITERATIONS = 2
#: How long a standby waits for the recording before it settles for ``imports`` warmth.
RECORDING_WAIT_S = 600.0
POLL_S = 0.1
#: What torch imports only on a job's first build, unless the job says otherwise
#: (:attr:`~understudy.worker.api.TrainingJob.preload`): an optimizer's constructor pulls in
#: ``torch._dynamo`` (about 1.3 s of CPU, the bulk of building a small job). A standby imports
#: them while it waits, so none of it falls between being chosen and taking over.
LAZY_IMPORTS = TrainingJob.preload


def preload_of(job: TrainingJob) -> tuple[str, ...]:
    """The modules ``job`` has a standby import while it waits (``TrainingJob.preload``).

    Raises:
        TypeError: the job's ``preload`` is not a sequence of module names.
    """
    names = getattr(job, "preload", LAZY_IMPORTS)
    if isinstance(names, str) or not isinstance(names, (tuple, list)) or not all(
            isinstance(n, str) and n for n in names):
        raise TypeError(f"{type(job).__name__}.preload must be a tuple of module names, "
                        f"got {names!r}")
    return tuple(names)


def import_lazy_modules(names: tuple[str, ...]) -> dict[str, str]:
    """Import ``names``: the ``imports`` warmth of a standby, before any build. Returns the
    modules that failed to import, with why: a hint the job gave, not worth the standby (the
    job's build meets the same error, where it counts)."""
    failed = {}
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # any import error: the job meets it again at its build
            failed[name] = f"{type(exc).__name__}: {exc}"
    return failed


def sandboxed(job: TrainingJob) -> bool:
    """Whether ``job`` takes part in the sandbox (recorded, replayed): unless it sets
    ``sandboxed = False`` (a job whose collectives cannot be recorded, for example)."""
    return bool(getattr(job, "sandboxed", True))


def warm_role(node: str, standbys: list[str], layout: Layout) -> tuple[str, int]:
    """The role type key this standby warms as, and the rank that records it."""
    roles = sorted(recording_ranks(layout).items(), key=lambda kv: kv[1])
    index = standbys.index(node) if node in standbys else 0
    return roles[index % len(roles)]


def warm_standby(make_job: Callable[[], TrainingJob], control: DaemonClient, *, node: str,
                 stop: threading.Event, job: str, layout: Layout, seed: int,
                 slots: int, recordings: Path, script: Path, timeout: float,
                 should_abort: Callable[[], bool],
                 device: torch.device | None = None) -> tuple[Warmed | None, bool]:
    """Steps 1-2 of the module docstring. Returns the warmed job (None if none was built) and
    whether a plan chose this standby before the warmup could start (then it goes at once).
    ``device``: the GPU the real groups connect NCCL on once promoted (``worker.launch``)."""
    log = logs.get("understudy.sandbox", job=job, node=node)
    info = control.job() or {}
    standbys = list((info.get("assignment") or {}).get("standbys") or [])
    key, rank = warm_role(node, standbys, layout)
    manifest = role_directory(recordings, RoleType.of(rank, layout)) / MANIFEST
    deadline = time.monotonic() + RECORDING_WAIT_S
    while not manifest.exists():
        if stop.is_set() or time.monotonic() > deadline:
            return None, False
        try:
            if chosen_rank(Plan.from_info(control.job()), node) is not None:
                return None, True
        except DaemonError:
            pass
        time.sleep(POLL_S)
    target = SandboxTarget(job=job, world_size=layout.world_size, tp=layout.tp, pp=layout.pp,
                           rank=rank, script=script,
                           seed=seed, slots=slots, collective_timeout=timeout,
                           should_abort=should_abort)
    groups = GroupSet(job, member(rank, node), timeout=timeout, device=device)
    warmed = warm_up(make_job, target, recordings, groups=groups)
    report = warmed.report
    mode = "replay" if report.outcome is WarmupOutcome.SHADOWED else "plain"
    detail = (f"built as rank {rank}; {report.iterations} shadow iterations replayed in "
              f"{report.total_s:.2f} s" if mode == "replay" else
              f"built as rank {rank}; no replay: {report.fallback_reason}")
    control.warmth(mode, [key], detail[:400], rank=rank)
    log.info(f"Standby is warm ({mode}) as rank {rank}: {report.summary()}")
    return warmed, False
