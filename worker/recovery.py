"""The survivors' side of a recovery: a rank's process or node is gone, and a standby takes its
place with the state of a data-parallel replica (the controller's side is ``daemon/planner.py``,
the joiner's is :class:`~understudy.worker.migration.Joiner`).

A survivor learns of the loss from its daemon: the collective or the compute it waits in is
released at its next check of the job's view (every 50 ms: ``JobContext.poll_interval``) once
the daemon's long poll brought the recovery plan (or at once, when the peer's death resets the
connection), and :meth:`Runtime.run` raises. Then
:func:`recover`, on every survivor, against the plan's reports in the key-value namespace
``<job>/migration/<id>``:

1. **Stop and report** ``stopped/<rank>``: the rank's committed step, its pending step (computed,
   vote aborted) and how many operations it issued on each of its groups' current versions.
2. **Settle.** Every survivor reads every survivor's report and settles on the most advanced
   committed step (:meth:`Runtime.settle`): a pending step somebody committed is applied, else
   discarded. All survivors now hold the same committed step, with nothing half-applied.
3. **Rebuild** the groups that contained a lost rank, and the groups whose members issued
   different numbers of operations (an abandoned collective is still queued on one side: the
   next one would pair with it). Every member computes the same set from the same reports;
   the other groups are kept, communicators and all. The next versions are built with the
   joiners in the lost ranks' slots; each donor also builds a pair group with its joiner.
   ``prepared/<rank>`` when they are up.
4. **Transfer.** Each donor streams its state (the settled committed step) to its joiner as
   soon as their pair group is up, while the job's groups still come up (so a donor's
   ``prepared/<rank>`` comes after its send), and reports ``transferred/<lost rank>``; the
   others wait for every ``transferred`` to say ok.
5. **Switch** to the new versions under the new epoch; :meth:`Runtime.run` resumes at the settled
   step, which the joiners redo with everyone.

If the plan is called off at any point (the joiner or another rank died meanwhile, the deadline
passed) the prepared versions are abandoned and the survivor waits for the next plan; its step
stays settled, so a second attempt reports the same step and nothing pending.

A **reshape** (:func:`reshape`: a replica lost and no standby free, for a job that may reshape)
stops and settles the same way, among the ranks that stay; then each of them takes its rank in
the new shape, builds all its groups afresh as a new group set of the new epoch, takes its new
place in the job (:mod:`understudy.worker.reshape`) and reports ``reshaped/<rank>`` (its rank
before). Nothing moves but the group bootstrap: a replica that stays holds the whole state, and
the slots it now holds too. The ranks of a dropped replica that still run take no part; their
daemons stop them once the controller committed the new shape.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from understudy.common import failpoints, logs
from understudy.common.daemon_client import DaemonClient, DaemonError
from understudy.common.layout import Layout
from understudy.common.records import (
    CANNOT_RESHAPE,
    NO_REPLICA_COPY,
    TRANSFER_OK,
    MigrationPhase,
    Report,
)
from understudy.groups.errors import GroupError
from understudy.groups.groupset import GroupSet
from understudy.worker.holder_client import HolderDirectory
from understudy.worker.migration import (
    JobGroups,
    MigrationHook,
    Plan,
    committed,
    group_members,
    member,
    pair_name,
)
from understudy.worker.reshape import Shape, new_context, take_shape
from understudy.worker.runtime import Runtime
from understudy.worker.snapshots import SnapshotError, restore
from understudy.worker.transfer import PairGroupTransport, TransferError, send_state

#: how often a survivor re-reads the plan while it waits for peers' reports
POLL_S = 0.05
#: how soon a survivor takes up again a plan it saw called off (``wait_for_recovery``)
RETRY_S = 0.5


class CalledOff(Exception):
    """The recovery plan this survivor followed was aborted or replaced."""


def wait_for_recovery(hook: MigrationHook, stop: threading.Event, timeout: float,
                      called_off: str | None = None) -> Plan | None:
    """After an aborted step: the recovery plan for this rank's epoch, once the controller
    wrote it. None if ``stop`` is set, or no plan came within ``timeout`` seconds; a job paused
    for want of a standby waits as long as it stays paused, and a rank whose daemon cannot
    reach etcd as long as that lasts (nobody can write a plan before; the survivors keep their
    state in memory meanwhile).

    ``called_off``: the id of a plan this rank just followed and saw called off. While it is
    still the job's plan (the controller has not yet aborted or replaced it, or the call-off
    was this rank's own: a report etcd did not take), it is taken up again only once the
    daemon reaches etcd and ``RETRY_S`` after the call-off: never at once, which would spin
    the survivor through the same failing report for as long as an outage lasts."""
    deadline = time.monotonic() + timeout
    retry_at = time.monotonic() + RETRY_S
    while not stop.is_set():
        plan = hook.recovery()
        if plan is not None and (plan.id != called_off or (
                not hook.etcd_unreachable and time.monotonic() >= retry_at)):
            return plan
        if plan is not None or hook.paused or hook.etcd_unreachable:
            deadline = time.monotonic() + timeout
        elif time.monotonic() > deadline:
            return None
        stop.wait(POLL_S)
    return None


def wait_while_replaced(hook: MigrationHook, plan: Plan, stop: threading.Event) -> None:
    """``plan`` replaces this very rank (its node lost its lease, and the rank is still running
    until its daemon finds out and kills it): it takes no part, since its joiner takes the
    state from a replica. Returns once the plan is no longer the job's recovery (done or
    called off: the caller looks again) or ``stop`` is set."""
    while not stop.is_set():
        current = hook.recovery()
        if current is None or current.id != plan.id:
            return
        stop.wait(POLL_S)


def recover(runtime: Runtime, hook: MigrationHook, plan: Plan, *, timeout: float,
            snapshots: Path | None = None) -> bool:
    """This survivor's part of ``plan`` (see the module docstring). True: the joiners hold
    their ranks and training resumes on the new groups. False: the plan was called off; the
    caller waits for the next one. ``snapshots``: this job's snapshot directory (storage),
    for a rollback that takes copies from there."""
    return _Survivor(runtime, hook, plan, timeout, snapshots).run()


def reshape(runtime: Runtime, hook: MigrationHook, plan: Plan, *, timeout: float) -> bool:
    """This rank's part of reshape ``plan``, as a rank that stays (see the module docstring).
    True: it holds its rank of the new shape (``hook`` says which) and training resumes.
    False: the plan was called off; the caller waits for the next one."""
    return _Survivor(runtime, hook, plan, timeout, None).run_reshape()


class _Survivor:
    def __init__(self, runtime: Runtime, hook: MigrationHook, plan: Plan,
                 timeout: float, snapshots: Path | None) -> None:
        self.runtime, self.hook, self.plan, self.timeout = runtime, hook, plan, timeout
        self.snapshots = snapshots
        self.groups: GroupSet = hook.groups
        self.rank, self.layout = hook.rank, hook.layout
        self.nodes = hook.nodes
        # A reshape's ranks are numbered in its new shape: run_reshape works them out.
        self.after = self.nodes if plan.reshape else plan.nodes_after(self.nodes)
        self.log = logs.get(job=hook.job, rank=self.rank, node=hook.node)
        self.reports = DaemonClient(f"{hook.job}/migration/{plan.id}", epoch=plan.from_epoch,
                                    timeout=10)
        self.prepared: list[str] = []

    def run(self) -> bool:
        t0 = time.monotonic()
        try:
            self.hook._forget_planned()
            committed = self._settle()
            if self.plan.rollback:
                committed = self._roll_back()
            rebuild = self._prepare(committed)
            self._transfer(committed)
            self._until_built(self.groups, rebuild, "the new group versions")
            self._set(Report.PREPARED.of(self.rank))
            self._wait_transferred()
            self._guarded(self.groups.switch, rebuild)
        except CalledOff as exc:
            self.log.warning(f"Recovery {self.plan.id} was called off ({exc}); waiting for the "
                             "next plan.")
            if self.prepared:
                self.groups.abandon(self.prepared)
            self.reports.close()
            return False
        self.hook.recovered(self.plan)
        self.reports.close()
        self.log.info(f"Recovered from the loss of rank(s) {sorted(self.plan.moves)} at step "
                      f"{committed}: rebuilt {rebuild}, kept the others.",
                      epoch=self.plan.to_epoch, seconds=round(time.monotonic() - t0, 3))
        return True

    def run_reshape(self) -> bool:
        t0 = time.monotonic()
        stay = self.plan.stays(self.layout)
        layout = self.plan.reshaped_layout(self.layout.tp, self.layout.pp)
        rank = stay[self.rank]
        groups = GroupSet(self.hook.job, member(rank, self.hook.node), epoch=self.plan.to_epoch,
                          timeout=self.timeout, device=self.groups.device)
        try:
            self.hook._forget_planned()
            committed = self._settle()
            try:
                nodes = self.plan.reshaped_nodes(self.nodes, self.layout.tp, self.layout.pp)
            except ValueError as exc:
                raise CalledOff(f"the plan does not make up its new shape: {exc}") from exc
            provider = self.runtime.ctx.groups
            shape = Shape(self.plan.replicas, layout.tp, layout.pp)
            try:
                if not isinstance(provider, JobGroups):
                    raise ValueError("the job's groups are not the runtime's own")
                ctx = new_context(self.runtime, provider, shape, rank)
            except ValueError as exc:
                self._set(Report.ABORTED, f"{CANNOT_RESHAPE}rank {self.rank}: {exc}".encode())
                raise CalledOff(f"{CANNOT_RESHAPE}{exc}") from exc
            names = self._build_shape(groups, layout, rank, nodes)
            self._donate(groups, rank, committed)
            self._wait_transferred()
            try:
                groups.switch(names)
            except GroupError as exc:
                self._set(Report.ABORTED, f"reshape failed on rank {self.rank}: {exc}".encode())
                raise CalledOff(str(exc)) from exc
            # Nothing has trained on the new shape yet: it is taken only once the controller
            # committed it, which it does once every rank that stays said it holds it.
            self._set(Report.RESHAPED.of(self.rank))
            self._until(self._committed, "the controller's commit of the new shape")
        except CalledOff as exc:
            self.log.warning(f"Reshape {self.plan.id} was called off ({exc}); waiting for the "
                             "next plan.")
            groups.close(timeout=1.0)
            self.reports.close()
            return False
        take_shape(self.runtime, provider, self.groups, groups, shape, ctx)
        self.hook.reshaped(self.plan, groups, rank, layout, nodes)
        self.reports.close()
        self.log.info(f"Reshaped at step {committed}: rank {self.rank} of DP {self.layout.dp} is "
                      f"rank {rank} of DP {layout.dp}, holding slots "
                      f"{list(self.runtime.ctx.held_slots)}.", epoch=self.plan.to_epoch,
                      seconds=round(time.monotonic() - t0, 3))
        return True

    def _build_shape(self, groups: GroupSet, layout: Layout, rank: int,
                     nodes: tuple[str, ...]) -> list[str]:
        """Start every group of ``rank`` in the new shape, and the pair to each joiner this rank
        gives the state to; wait until they are up. Returns the job's groups' names."""
        names = list(layout.concrete(rank).values())
        try:
            for name in names:
                groups.prepare(name, self.plan.group_version, group_members(name, nodes, layout))
            for j in self._donating_as(rank):
                groups.prepare(pair_name(j, self.plan.group_version), self.plan.group_version,
                               (member(rank, nodes[rank]), member(j, nodes[j])))
        except ValueError as exc:
            self._set(Report.ABORTED, f"reshape failed on rank {self.rank}: {exc}".encode())
            raise CalledOff(str(exc)) from exc
        self._until_built(groups, groups.pending(), "the new shape's groups")
        self.log.info(f"Reshape {self.plan.id}: the groups of rank {rank} of the new shape are "
                      "up.")
        return names

    def _donating_as(self, rank: int) -> list[int]:
        return [j for j, d in self.plan.donor_of.items() if d == rank]

    def _donate(self, groups: GroupSet, rank: int, committed: int) -> None:
        """Give each new rank whose donor this rank is the state of the settled step (the
        replicas of a slotted job hold the same one)."""
        for j in self._donating_as(rank):
            pair = pair_name(j, self.plan.group_version)
            try:
                groups.switch([pair])
                with PairGroupTransport(groups.current(pair),
                                        timeout_s=self.timeout) as transport:
                    stats = send_state(transport, self.runtime.state())
            except (TransferError, GroupError) as exc:
                self._set(Report.TRANSFERRED.of(j), f"failed: {exc}".encode())
                raise CalledOff(f"the state did not reach rank {j}'s joiner: {exc}") from exc
            self._set(Report.TRANSFERRED.of(j), TRANSFER_OK)
            self.log.info(f"Gave rank {j} of the new shape the state of step {committed}: "
                          f"{stats}.")

    def _committed(self) -> bool:
        """Whether the controller committed this reshape; CalledOff once it called it off."""
        try:
            info = self.hook.control.job()
        except DaemonError:
            return False
        plan = Plan.from_info(info)
        if committed(info, self.plan):
            return True
        if plan is None or plan.id != self.plan.id or plan.phase == MigrationPhase.ABORTED:
            raise CalledOff("aborted" if plan is not None and plan.id == self.plan.id
                            else "replaced")
        return plan.phase == MigrationPhase.DONE

    # -- steps --------------------------------------------------------------------------------

    def _my_groups(self) -> list[str]:
        return list(self.layout.concrete(self.rank).values())

    def _settle(self) -> int:
        pending = self.runtime.pending
        ops = {}
        for name in self._my_groups():
            version = self.groups.current(name).version
            ops[name] = version.ops if version is not None else -1
        mine = {"step": self.runtime.step, "pending": pending[0] if pending else None,
                "ops": ops}
        self._set(f"stopped/{self.rank}", json.dumps(mine).encode())
        reporting = (self.plan.stays(self.layout) if self.plan.reshape else
                     [r for r in range(self.layout.world_size) if r not in self.plan.moves])
        self.stopped = {r: self._read_report(r) for r in reporting}
        committed = max(int(rep["step"]) for rep in self.stopped.values())
        try:
            self.runtime.settle(committed)
        except RuntimeError as exc:
            # Cannot happen while the step protocol holds; refusing is all that is left.
            raise CalledOff(f"this rank cannot settle: {exc}") from exc
        return committed

    def _roll_back(self) -> int:
        step = self.plan.snapshot_step
        holders = HolderDirectory(self.hook.job, lambda: self.plan.from_epoch)
        try:
            where = restore(self.runtime, step, self.plan.snapshot_source(self.rank),
                            directory=self.snapshots, holders=holders, timeout=self.timeout,
                            epoch=self.plan.from_epoch)
        except SnapshotError as exc:
            self._set(Report.ABORTED, f"rank {self.rank} could not load the snapshot of step "
                                 f"{step}: {exc}".encode())
            raise CalledOff(f"the snapshot of step {step} did not load: {exc}") from exc
        finally:
            holders.close()
        self.log.info(f"Rolled back to the snapshot of step {step} ({where}).")
        return step

    def _read_report(self, rank: int) -> dict[str, Any]:
        value = self._wait_for(f"stopped/{rank}", f"rank {rank}'s report")
        try:
            report = json.loads(value)
            int(report["step"])
            dict(report["ops"])
        except (ValueError, KeyError, TypeError) as exc:
            raise CalledOff(f"rank {rank}'s report is unreadable: {exc}") from exc
        return dict(report)

    def _prepare(self, committed: int) -> list[str]:
        lost = set(self.plan.moves)
        rebuild = []
        for name in self._my_groups():
            ranks = self.layout.members(name)
            counts = {self.stopped[r]["ops"].get(name) for r in ranks if r not in lost}
            # -1: a member holds no version of it (fenced, or never built: a rank whose first
            # groups a peer's loss cut short), so it is rebuilt even where all agree on that.
            if lost & set(ranks) or len(counts) > 1 or -1 in counts:
                rebuild.append(name)
        for name in rebuild:
            self._guarded(self.groups.prepare, name, self.plan.group_version,
                          group_members(name, self.after, self.layout))
            self.prepared.append(name)
        for r in self._donating():
            pair = pair_name(r, self.plan.group_version)
            self._guarded(self.groups.prepare, pair, self.plan.group_version,
                          (member(self.rank, self.nodes[self.rank]),
                           member(r, self.plan.moves[r][1])))
            self.prepared.append(pair)
        self.log.info(f"Recovery {self.plan.id}: settled on step {committed}; rebuilding "
                      f"{rebuild}.", kept=[n for n in self._my_groups() if n not in rebuild])
        # A donor sends as soon as its pairs are up; the job's groups come up meanwhile
        # (run() waits for them before it reports this rank prepared).
        pairs = [pair_name(r, self.plan.group_version) for r in self._donating()]
        self._until_built(self.groups, pairs, "the pair groups with the joiners")
        return rebuild

    def _donating(self) -> list[int]:
        return [r for r, d in self.plan.donor_of.items() if d == self.rank]

    def _transfer(self, committed: int) -> None:
        for r in self._donating():
            pair = pair_name(r, self.plan.group_version)
            try:
                state = self.runtime.replica_state(r)
            except ValueError as exc:  # the job keeps no copy of rank r's state here
                self._set(Report.TRANSFERRED.of(r), f"{NO_REPLICA_COPY}{exc}".encode())
                raise CalledOff(f"no copy of rank {r}'s state here: {exc}") from exc
            try:
                self.groups.switch([pair])
                with PairGroupTransport(self.groups.current(pair),
                                        timeout_s=self.timeout) as transport:
                    stats = send_state(transport, state)
            except (TransferError, GroupError) as exc:
                self._set(Report.TRANSFERRED.of(r), f"failed: {exc}".encode())
                raise CalledOff(f"the state did not reach rank {r}'s joiner: {exc}") from exc
            # the joiner holds the state and may commit the plan before the others hear of it
            failpoints.hit("donor.transferred")
            self._set(Report.TRANSFERRED.of(r), TRANSFER_OK)
            self.log.info(f"Gave rank {r}'s joiner the state of step {committed}: {stats}.")

    def _wait_transferred(self) -> None:
        for r in self.plan.moves:
            # committed: the joiners took over, so they hold the state
            value = self._wait_for(Report.TRANSFERRED.of(r), f"rank {r}'s state transfer",
                                   if_committed=TRANSFER_OK)
            if value != TRANSFER_OK:
                raise CalledOff(f"rank {r}'s state transfer failed: {value[:200]!r}")

    # -- plumbing ---------------------------------------------------------------------------

    def _set(self, key: str, value: bytes = b"1") -> None:
        try:
            self.reports.set(key, value)
        except DaemonError as exc:
            raise CalledOff(f"could not report {key}: {exc}") from exc

    def _check_plan(self) -> bool:
        """CalledOff once the plan was called off; True once the controller committed it (the
        job may have moved on to its next migration: this rank still finishes its part)."""
        try:
            info = self.hook.control.job()
        except DaemonError:
            return False
        plan = Plan.from_info(info)
        if committed(info, self.plan):
            return True
        if plan is None or plan.id != self.plan.id or plan.phase == MigrationPhase.ABORTED:
            raise CalledOff("aborted" if plan is not None and plan.id == self.plan.id
                            else "replaced")
        return False

    def _wait_for(self, key: str, what: str, if_committed: bytes | None = None) -> bytes:
        """The value of report ``key``, waiting while the plan stands (up to the timeout);
        ``if_committed`` instead, if given, once the controller committed the plan."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return self.reports.get(key, timeout=0.2)
            except DaemonError:
                pass
            if self._check_plan() and if_committed is not None:
                return if_committed
            if time.monotonic() > deadline:
                raise CalledOff(f"no word of {what} in {self.timeout:g} s")

    def _until(self, done: Callable[[], bool], what: str,
               wait: Callable[[float], object] = time.sleep) -> None:
        """Until ``done()``, checking the plan every ``POLL_S`` (``wait(POLL_S)`` between two
        checks: one that returns as soon as ``done`` may hold ends the wait at once)."""
        deadline = time.monotonic() + self.timeout
        while not done():
            self._check_plan()
            if time.monotonic() > deadline:
                raise CalledOff(f"{what} did not come up in {self.timeout:g} s")
            wait(POLL_S)

    def _until_built(self, groups: GroupSet, names: list[str], what: str) -> None:
        """Until every one of ``names`` has finished building: the moment the last one has,
        not at the next poll (a step of the recovery's critical path)."""
        self._until(lambda: groups.ready(names), what,
                    wait=lambda t: groups.wait_ready(names, t))

    def _guarded(self, action: Callable[..., Any], *args: Any) -> None:
        try:
            action(*args)
        except (ValueError, GroupError) as exc:
            self._set(Report.ABORTED, f"recovery failed on rank {self.rank}: {exc}".encode())
            raise CalledOff(str(exc)) from exc
