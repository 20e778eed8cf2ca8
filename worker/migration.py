"""The worker side of a live migration (the controller's side is ``daemon/planner.py``).

Every rank runs a :class:`MigrationHook` at its iteration boundaries; a standby chosen as a
joiner runs :func:`join`. They follow the job's migration record (read from the daemon's cache,
no etcd round trip per step) and report progress as keys under the key-value namespace
``<job>/migration/<id>`` (``common.records.Report``), which the controller turns into phase
changes:

    bound/<rank>            the joiner for <rank> has built the model for that rank
    prepared/<rank>         phase 1 done on <rank>: its rebuilt groups' next versions are up
    joiner-prepared/<rank>  phase 1 done on the joiner for <rank>
    switching               the ranks agreed on the switch boundary (by the step vote)
    transferred/<rank>      "ok", or why the leaver's state did not reach its joiner
    switched/<rank>         the joiner for <rank> holds the state and the new groups
    aborted                 the switch was called off; everyone stays on the old versions

Agreement: once the migration is ``ready``, each rank adds "ready for attempt V" to the step
vote (V identifies the attempt; the vote reports V only if every rank gave it). When the vote
says every rank is ready, all of them know it in the same step, and the switch happens at the
next boundary: the leaver streams its state to the joiner over their pair group, the survivors
wait for ``transferred`` and only then switch (so a joiner that dies mid-stream leaves everyone
on the old versions, with the leaver still training), and the joiner loads the state,
switches, and carries on at that step.
"""

from __future__ import annotations

import contextlib
import functools
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from understudy.common import failpoints, logs
from understudy.common.daemon_client import DaemonClient, DaemonError
from understudy.common.layout import Layout, pair_name
from understudy.common.records import (
    TRANSFER_OK,
    Migration,
    MigrationKind,
    MigrationPhase,
    Report,
    renumbering,
    reshaped_nodes,
)
from understudy.common.snapshot_tiers import STORAGE
from understudy.groups.errors import GroupError
from understudy.groups.groupset import GroupSet
from understudy.worker import rng
from understudy.worker.api import CollectiveAborted, applies_landing
from understudy.worker.holder import SnapshotHolder
from understudy.worker.holder_client import HolderDirectory
from understudy.worker.runtime import Action, Runtime
from understudy.worker.snapshots import SnapshotError, restore
from understudy.worker.transfer import (
    Landing,
    PairGroupTransport,
    TransferError,
    TransferStats,
    receive_into,
    send_state,
)

READY_PHASES = (MigrationPhase.READY, MigrationPhase.SWITCHING)
#: A rank's step-vote flag while its job is being stopped (``understudy stop``): once every
#: rank gives it for the same step, each ends at the next boundary, ``on_finish`` run. It wins
#: over a migration's flag, so the ranks agree as soon as each has seen the stop.
STOP_FLAG = -1
#: how often a rank waiting in a collective asks its daemon whether the job is recovering,
#: while the job's view it follows (``DaemonClient.follow_job``) is broken: with the view up,
#: every check reads the view, which the daemon's long poll keeps current
RECOVERY_POLL_S = 0.1
#: longest wait of a joiner's long poll for its migration's phase 1 (it checks its deadline
#: between two)
PHASE_WAIT_S = 0.25
#: longest wait of a standby's long poll for its plan (it notices a stop within it)
PLAN_WAIT_S = 0.5
#: how often a report the daemon could not write (an etcd outage) is tried again
REPORT_RETRY_S = 0.2


class RecoveryNeeded(CollectiveAborted):
    """A rank of the job is gone and a recovery is planned: this rank stops its step."""


def member(rank: int, node: str) -> str:
    """A rank's name in its groups: the same rank on another node is another member."""
    return f"r{rank}-{node}"


def group_members(name: str, nodes: tuple[str, ...], layout: Layout) -> tuple[str, ...]:
    """Members of concrete group ``name`` when rank ``i`` lives on ``nodes[i]``."""
    return tuple(member(r, nodes[r]) for r in layout.members(name))


def _leaver_send_failpoint() -> bool:
    """The leaver's abort check while it sends at the switch: never, unless a test's failpoint
    fires (it sleeps, raises or exits in there)."""
    failpoints.hit("leaver.send")
    return False


def _send_ahead_failpoint() -> bool:
    """As :func:`_leaver_send_failpoint`, while the leaver sends ahead (before the switch)."""
    failpoints.hit("leaver.send_ahead")
    return False


class SendAhead:
    """The leaver's stream to its joiner when the job replays (``api.replays``): its state,
    sent in the background during one step's compute, then each committed step's apply inputs,
    each sent while the leaver applies that step; the last step's (the vote agreed the switch)
    carry the RNGs and counters too (:meth:`MigrationHook.before_apply`), or, where that step
    was not committed, they cross alone at the switch (:meth:`MigrationHook.hand_off`). The
    joiner applies each step as it lands where the job can (:class:`_LandingReplay`). One
    message at a time, each a whole
    :func:`~understudy.worker.transfer.send_state`, in order, on the transfer pair.

    The runtime waits (:meth:`wait`) before the state it sends can change: the state before
    ``apply``, a step's inputs before the next compute."""

    def __init__(self, transport: PairGroupTransport, rank: int) -> None:
        self.transport, self.rank = transport, rank
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        #: what each message was and its figures, in order
        self.sent: list[tuple[str, TransferStats]] = []

    def send(self, tree: dict[str, Any], what: str, *,
             should_abort: Callable[[], bool] = _send_ahead_failpoint) -> None:
        """Start sending ``tree`` once the message before it is through.

        Raises:
            TransferError: the message before failed.
        """
        self.wait()

        def run() -> None:
            try:
                stats = send_state(self.transport, tree, should_abort=should_abort)
            except BaseException as exc:  # handed to the runtime's thread by wait()
                self._error = exc
                return
            self.sent.append((what, stats))

        self._thread = threading.Thread(target=run, name="understudy-send-ahead", daemon=True)
        self._thread.start()

    @property
    def state_sent(self) -> bool:
        """The state itself is through (the first message), without waiting."""
        return bool(self.sent) and self._error is None

    def wait(self) -> None:
        """Wait for the message in flight.

        Raises:
            TransferError: it failed (the joiner died, rejected it, or went silent; a value
                that cannot travel).
        """
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            exc = self._error
            if isinstance(exc, TransferError):
                raise exc
            raise TransferError(f"sending ahead failed: {type(exc).__name__}: {exc}") from exc

    def close(self, why: str) -> None:
        """Stop: the migration is over or called off (a message in flight fails)."""
        if self._thread is not None:
            self.transport.abort(why)
            self._thread.join(5)
            self._thread = None
        self.transport.close()

    def summary(self) -> str:
        """The messages sent before the switch, in words: the state's figures, then the steps'
        in total (the last of them may have carried the switch's word: the hand-off's
        figures are that message's)."""
        if not self.sent:
            return "nothing sent ahead"
        (what, first), steps = self.sent[0], [s for _, s in self.sent[1:]]
        out = f"{what} sent ahead: {first}"
        if steps:
            nbytes = sum(s.payload_bytes for s in steps)
            seconds = sum(s.seconds for s in steps)
            out += (f"; then {len(steps)} step(s)' apply inputs, {nbytes} B in "
                    f"{seconds * 1e3:.1f} ms")
        return out


class Plan(Migration):
    """A migration record as a worker sees it: the record itself (``common/records.py``'s
    :class:`~understudy.common.records.Migration`, decoded and checked again from the daemon's
    view of the job), with what a worker derives from it."""

    @classmethod
    def from_info(cls, info: dict[str, Any] | None) -> Plan | None:
        """The job's migration in the daemon's view ``info`` (:meth:`DaemonClient.job`), or
        None without one.

        Raises:
            RecordError: the view's migration is not a valid record (the daemon only passes
                on records it decoded: a bug, not bad input).
        """
        m = (info or {}).get("migration")
        if not m:
            return None
        # Polled at every step boundary: each record is decoded once (a plan is immutable).
        return _decoded_plan(json.dumps(m, sort_keys=True))

    @functools.cached_property
    def moves(self) -> dict[int, tuple[str, str]]:
        """rank -> (leaver node, joiner node)."""
        return {r: (ln, jn) for r, ln, jn in zip(self.ranks, self.leavers, self.joiners,
                                                  strict=True)}

    @functools.cached_property
    def donor_of(self) -> dict[int, int]:
        """A recovery's (or a grow's): rank -> the data-parallel replica that gives its joiner
        the state."""
        return dict(zip(self.ranks, self.donors, strict=False))

    @property
    def reshape(self) -> bool:
        return self.kind == MigrationKind.RESHAPE

    @property
    def rollback(self) -> bool:
        return self.kind == MigrationKind.ROLLBACK

    def stays(self, layout: Layout) -> dict[int, int]:
        """A reshape's ranks that stay, by their rank in ``layout`` (before it) -> their rank
        after it; the ranks not named leave."""
        return renumbering(layout, self.replicas)

    def reshaped_layout(self, tp: int, pp: int) -> Layout:
        """A reshape's layout after it."""
        return Layout(len(self.replicas) * tp * pp, tp, pp)

    def reshaped_nodes(self, nodes: tuple[str, ...], tp: int, pp: int) -> tuple[str, ...]:
        """The node of every rank after this reshape, from ``nodes`` before it.

        Raises: ValueError: the plan's ranks do not make up its new replicas.
        """
        return reshaped_nodes(Layout(self.from_dp * tp * pp, tp, pp), nodes, self.replicas,
                              self.ranks, self.joiners)

    def snapshot_source(self, rank: int) -> str:
        """Where ``rank``'s copy of a rollback's snapshot comes from (``snapshot_tiers``)."""
        return self.snapshot_from[rank] if rank < len(self.snapshot_from) else STORAGE

    def recovers_from(self, epoch: int) -> bool:
        """Whether this is a recovery (or rollback, or reshape), not over, of a job at
        ``epoch``: one the ranks of that epoch take part in."""
        return self.recovery and self.active and self.from_epoch == epoch

    def source(self, rank: int, nodes: tuple[str, ...]) -> str:
        """The member that sends ``rank``'s state to its joiner: the leaver, or in a recovery
        the donor replica (``nodes``: each rank's node before the move)."""
        if self.kind == MigrationKind.RECOVERY:
            donor = self.donor_of[rank]
            return member(donor, nodes[donor])
        return member(rank, self.moves[rank][0])

    def nodes_after(self, nodes: tuple[str, ...]) -> tuple[str, ...]:
        out = list(nodes)
        for r, (_, joiner) in self.moves.items():
            out[r] = joiner
        return tuple(out)


@functools.lru_cache(maxsize=8)
def _decoded_plan(text: str) -> Plan:
    return Plan.decode(text.encode())


def committed(info: dict[str, Any] | None, plan: Plan) -> bool:
    """Whether the controller committed ``plan``: the job's assignment is the one it made. A
    rank that lags the controller can find the job's next migration planned before it saw its
    own done (a recovery commits once the joiners hold their ranks, and a survivor may still
    wait for the donor's ``transferred``, which travels through another daemon): its own plan
    is then done, not called off, and the rank must finish it."""
    a = (info or {}).get("assignment") or {}
    return a.get("migration") == plan.id and a.get("epoch") == plan.to_epoch


def _paused(info: dict[str, Any]) -> bool:
    """Whether the job waits for a standby to recover a rank: its status says so, and says it
    after the current assignment was written and after the job's migration (unless aborted)
    was planned. A stale "paused" outlives what ended it: the controller says "resumed" only
    once the recovery planned for the paused rank has committed, and a joiner of that
    recovery that took the status at its word would abort the job's first step after it, for
    good (seen in a full test run)."""
    status, assignment = info.get("status") or {}, info.get("assignment") or {}
    migration = info.get("migration") or {}
    planned = 0.0 if migration.get("phase") == "aborted" else float(migration.get("created_at", 0))
    since = max(float(assignment.get("updated_at", 0)), planned)
    return status.get("paused") is True and float(status.get("updated_at", 0)) >= since


class JobGroups:
    """The runtime's groups provider: ``tp``/``dp``/``pp``/``world`` -> this rank's current
    group."""

    def __init__(self, groups: GroupSet, rank: int, layout: Layout) -> None:
        self.groups = groups
        self.names = layout.concrete(rank)

    def retarget(self, groups: GroupSet, rank: int, layout: Layout) -> None:
        """Answer from ``groups``, as ``rank`` of ``layout``, from now on (a reshape: the job
        keeps this object, and the groups it fetches at call time are the new shape's)."""
        self.groups, self.names = groups, layout.concrete(rank)

    def current(self, name: str) -> Any:
        try:
            concrete = self.names[name]
        except KeyError:
            raise ValueError(f"unknown group {name!r}: this job's groups are "
                             f"{', '.join(self.names)}") from None
        return self.groups.current(concrete)


def report_downtime(job: str, migration: str, epoch: int, rank: int, seconds: float,
                    log: Any) -> None:
    """Tell the controller, through the daemon, how long the job did not train for
    ``migration`` as this rank saw it (``Report.DOWNTIME``, its metrics' downtime per event):
    on a thread of its own, under the migration's new epoch; a report that does not go
    through is dropped."""
    def run() -> None:
        try:
            with DaemonClient(f"{job}/migration/{migration}", epoch=epoch, timeout=10) as c:
                c.set(Report.DOWNTIME.of(rank), f"{seconds:.6f}".encode())
        except DaemonError as exc:
            log.debug("Could not report the migration's downtime.", migration=migration,
                      error=str(exc))

    threading.Thread(target=run, name="understudy-downtime-report", daemon=True).start()


class MigrationHook:
    """The boundary hook of a rank that holds its role (see the module docstring)."""

    def __init__(self, control: DaemonClient, groups: GroupSet, *, job: str, rank: int,
                 node: str, layout: Layout, nodes: tuple[str, ...],
                 transfer_timeout: float = 60.0, finished: tuple[str, ...] = (),
                 stop: threading.Event | None = None, send_ahead: bool = False) -> None:
        self.control, self.groups = control, groups
        self.job, self.rank, self.node = job, rank, node
        self.layout = layout
        #: node of each rank under the current epoch
        self.nodes = nodes
        self.transfer_timeout = transfer_timeout
        self.log = logs.get(job=job, rank=rank, node=node)
        self._plan: Plan | None = None
        self._prepared: list[str] = []
        self._reported_prepared = False
        self._switch_next = False
        #: set by SIGTERM: the rank stops at its next boundary
        self.stop = stop or threading.Event()
        #: migrations this rank is done with (a joiner starts with the one that brought it in)
        self._finished: set[str] = set(finished)
        self._reports: DaemonClient | None = None
        #: seconds spent in phase 2 on this rank, for the events
        self.last_switch_s: float | None = None
        self._switch_started = 0.0  # when this rank reached the agreed switch boundary
        self._recovery: Plan | None = None
        self._recovery_checked = 0.0
        #: the job view the recovery was last read from, and the plan it held
        self._recovery_view: dict[str, Any] | None = None
        self._recovery_plan: Plan | None = None
        #: the job waits for a standby to recover a rank (as of the last :meth:`recovery`)
        self.paused = False
        #: this rank's daemon cannot reach etcd (as of the last :meth:`recovery`): no recovery
        #: can be planned until it can, so a wait for one is not over
        self.etcd_unreachable = False
        #: as a leaver, send the state ahead and then each step's apply inputs (the job
        #: replays: ``api.replays``), rather than the whole state at the switch
        self.send_ahead_enabled = send_ahead
        self._ahead: SendAhead | None = None
        #: every rank agreed in a step's vote that the job stops (``understudy stop``): the
        #: rank ends at its next boundary, a finished run (``on_finish`` runs)
        self.stop_agreed = False

    # -- following the plan -------------------------------------------------------------------

    def recovery(self) -> Plan | None:
        """The recovery this rank must take part in now: one from this rank's epoch, not yet
        over. It is polled inside waits: read at every call from the job's view while that is
        current (no round trip: a plan is seen as soon as the daemon's long poll brings it,
        parsed once per view), else asked of the daemon at most every ``RECOVERY_POLL_S``."""
        now = time.monotonic()
        followed = self.control.following
        if followed or now - self._recovery_checked >= RECOVERY_POLL_S:
            self._recovery_checked = now
            # A daemon that does not answer says nothing; the wait's own timeout still bounds it.
            with contextlib.suppress(DaemonError):
                info = self.control.job()
                if not followed or info is None or info is not self._recovery_view:
                    self._recovery_view = info
                    info = info or {}
                    self._recovery_plan = Plan.from_info(info)
                    self.paused = _paused(info)
                    self.etcd_unreachable = info.get("etcd") == "unreachable"
                self._note_recovery(self._recovery_plan)
        return self._recovery

    def _note_recovery(self, plan: Plan | None) -> None:
        self._recovery = plan if (plan is not None and plan.recovers_from(self.groups.epoch)
                                  and plan.id not in self._finished) else None

    def recovered(self, plan: Plan) -> None:
        """The survivors' side of ``plan`` is done: the joiners hold their ranks."""
        self._forget_planned()
        self.nodes = plan.nodes_after(self.nodes)
        self.groups.epoch = plan.to_epoch
        self._finished.add(plan.id)
        self._recovery = None

    def reshaped(self, plan: Plan, groups: GroupSet, rank: int, layout: Layout,
                 nodes: tuple[str, ...]) -> None:
        """This rank's side of reshape ``plan`` is done: it is ``rank`` of ``layout`` on
        ``groups`` (of the new epoch), the ranks' nodes ``nodes``."""
        self._forget_planned()
        self.groups, self.rank, self.layout, self.nodes = groups, rank, layout, nodes
        self.log = logs.get(job=self.job, rank=rank, node=self.node)
        self._finished.add(plan.id)
        self._recovery = None

    def _forget_planned(self) -> None:
        """Call off this rank's part in a planned migration (a rank failed meanwhile)."""
        if self._plan is not None:
            self._forget("a rank failed: the job is recovering")

    def _current_plan(self) -> Plan | None:
        plan = Plan.from_info(self.control.job())
        self._note_recovery(plan)
        if plan is not None and plan.recovery:
            plan = None  # not this hook's to follow: see worker/recovery.py
        if self._plan is not None and (plan is None or plan.id != self._plan.id):
            # called off (and maybe replaced) before this rank saw it end
            self._forget("superseded" if plan is None else f"superseded by {plan.id}")
        if plan is None or plan.id in self._finished or plan.phase in ("done", "aborted"):
            if self._plan is not None and plan is not None and plan.id == self._plan.id:
                self._forget(plan.phase)
            return None
        if self._plan is None:
            self._plan = plan
            self._prepared, self._reported_prepared, self._switch_next = [], False, False
            self._reports = DaemonClient(f"{self.job}/migration/{plan.id}",
                                         epoch=plan.from_epoch, timeout=10)
        else:
            self._plan = plan
        return plan

    def _forget(self, why: str) -> None:
        assert self._plan is not None
        if self._ahead is not None:
            self._ahead.close(f"migration {self._plan.id} ended ({why})")
            self._ahead = None
        if self._prepared:
            self.groups.abandon(self._prepared)
        self.log.info(f"Migration {self._plan.id} ended ({why}); staying on current groups.")
        self._finished.add(self._plan.id)
        self._plan, self._prepared, self._switch_next = None, [], False
        if self._reports is not None:
            self._reports.close()
            self._reports = None

    def _report(self, key: str, value: bytes = b"1", *, within: float = 0.0) -> bool:
        """Write a report of this migration through the daemon. A daemon that cannot write it (etcd
        unreachable: an outage) is asked again every ``REPORT_RETRY_S`` for up to ``within``
        seconds; a refusal is not. A report not through is logged and False returned, never
        raised: a migration must never take a training rank down. (Found by the outage test:
        a stayer's ``prepared`` report in an outage failed its rank, and with it the job.)"""
        assert self._reports is not None and self._plan is not None
        deadline = time.monotonic() + within
        while True:
            try:
                self._reports.set(key, value)
                return True
            except DaemonError as exc:
                if not exc.retryable or time.monotonic() >= deadline:
                    self.log.warning(f"Could not report {key} of migration {self._plan.id} "
                                     f"to the daemon: {exc}.", rank=self.rank)
                    return False
            time.sleep(REPORT_RETRY_S)

    def _start_phase1(self, plan: Plan) -> None:
        after = plan.nodes_after(self.nodes)
        if self.rank in plan.moves:
            leaver, joiner = plan.moves[self.rank]
            self.groups.prepare(pair_name(self.rank, plan.group_version), plan.group_version,
                                (member(self.rank, leaver), member(self.rank, joiner)))
            self._prepared = [pair_name(self.rank, plan.group_version)]
            return
        # The job's groups only: a rank that joined through a transfer pair still holds it.
        names = self.layout.concrete(self.rank).values()
        for name in names:
            before = group_members(name, self.nodes, self.layout)
            new = group_members(name, after, self.layout)
            if before != new:
                self.groups.prepare(name, plan.group_version, new)
                self._prepared.append(name)
        self.log.info(f"Phase 1 of migration {plan.id}: rebuilding {self._prepared}.",
                      untouched=[n for n in names if n not in self._prepared])

    # -- the runtime's hook -----------------------------------------------------------------

    def on_boundary(self, step: int) -> Action:
        if (self.stop.is_set() or self.stop_agreed) and not self._switch_next:
            return Action.STOP
        if self._ahead is not None:
            try:  # the last step's inputs are through before compute overwrites them
                self._ahead.wait()
            except TransferError as exc:
                self._ahead_failed(exc)
        if self._switch_next:
            return self._switch_action(step)
        plan = self._current_plan()
        if self._recovery is not None:
            raise RecoveryNeeded(f"migration {self._recovery.id} recovers "
                                 f"{sorted(self._recovery.moves)}", what=f"step {step}",
                                 waited=0.0)
        if plan is None:
            return Action.CONTINUE
        if plan.phase in (MigrationPhase.PREPARING, *READY_PHASES) and not self._prepared:
            try:
                self._start_phase1(plan)
            except (ValueError, GroupError) as exc:
                # Never let a migration take a training rank down: call it off, keep training.
                self.log.error(f"Phase 1 of migration {plan.id} failed: {exc}.")
                self._report(Report.ABORTED, f"phase 1 failed on rank {self.rank}: {exc}".encode())
                self._forget("aborted")
                return Action.CONTINUE
        if self._prepared and not self._reported_prepared and self.groups.ready(self._prepared):
            # Not through (an outage): said again at the next boundary; the migration's
            # deadline bounds the wait.
            self._reported_prepared = self._report(Report.PREPARED.of(self.rank))
        if (self.send_ahead_enabled and self._ahead is None and self.rank in plan.moves
                and self._reported_prepared and plan.phase in READY_PHASES):
            return Action.SEND_AHEAD  # the joiner waits for the state: every group is up
        return Action.CONTINUE

    def send_ahead(self, step: int, state: dict[str, Any]) -> None:
        """Start sending this rank's state (as of ``step``'s boundary) to the joiner, while
        ``step`` computes; the runtime calls :meth:`before_apply` before the state changes."""
        assert self._plan is not None
        pair = pair_name(self.rank, self._plan.group_version)
        self.groups.switch([pair])
        self._ahead = SendAhead(PairGroupTransport(self.groups.current(pair),
                                                   timeout_s=self.transfer_timeout), self.rank)
        self._ahead.send({**state, "ahead": {"step": step}}, f"the state of step {step}")
        self.log.info(f"Sending the state of rank {self.rank} ahead to its joiner while step "
                      f"{step} computes.", migration=self._plan.id)

    def before_apply(self, step: int, job: Any, after: dict[str, Any]) -> bool:
        """The vote committed ``step``: once the state sent ahead is through (it changes in
        ``apply``), forward the step's apply inputs while this rank applies them too.

        The vote agreed on the switch at the next boundary: the RNG states and ``after`` (the
        runtime's counters once the step applied) go with the inputs, this rank waits for the
        joiner to hold them and says so, and returns True: it leaves without applying the step
        (``job.handed_off``), which the joiner applies (its apply draws no random number:
        ``api.apply_inputs``), so that the survivors wait for no apply of a leaver's. If
        they do not get through, the migration is called off and this rank applies and
        trains on."""
        if self._ahead is None:
            return False
        try:
            self._ahead.wait()
            try:
                inputs = job.apply_inputs(step)
            except Exception as exc:  # the job's own code
                raise TransferError(f"the job's apply_inputs({step}) failed: "
                                    f"{type(exc).__name__}: {exc}") from exc
            message: dict[str, Any] = {"apply": step, "inputs": inputs}
            what = f"step {step}"
            if not self._switch_next:
                self._ahead.send(message, what)
                return False
            message["switch"] = {"rng": rng.capture(), "runtime": after}
            self._ahead.send(message, f"{what} and the switch",
                             should_abort=_leaver_send_failpoint)
            self._ahead.wait()
        except TransferError as exc:
            self._ahead_failed(exc)
            return False
        self.log.info(f"Rank {self.rank}: {self._ahead.summary()}.")
        self.log.info(f"Handed the state of rank {self.rank} off at step {step + 1}: "
                      f"{self._ahead.sent[-1][1]}.")
        failpoints.hit("leaver.handed_off")  # the joiner holds the state; nobody knows yet
        # The stayers wait for this word (up to their transfer timeout): keep trying as long.
        self._report(Report.TRANSFERRED.of(self.rank), TRANSFER_OK, within=self.transfer_timeout)
        return True

    def _ahead_failed(self, exc: TransferError) -> None:
        """The stream to the joiner failed: call the migration off; this rank trains on."""
        self.log.warning(f"Sending the state ahead failed: {exc}.")
        if self._switch_next:  # the survivors wait for this rank's word at the switch
            self._report(Report.TRANSFERRED.of(self.rank), f"failed: {exc}".encode(),
                         within=self.transfer_timeout)
        else:
            self._report(Report.ABORTED,
                         f"rank {self.rank} could not send its state ahead: {exc}".encode())
        self._forget("aborted")

    def vote_flag(self, step: int) -> int:
        if self._stopping():
            return STOP_FLAG
        plan = self._plan
        if plan is not None and plan.phase in READY_PHASES and self._reported_prepared:
            if (self.send_ahead_enabled and self.rank in plan.moves
                    and (self._ahead is None or not self._ahead.state_sent)):
                return 0  # the joiner needs the state before the switch can be agreed
            return plan.group_version
        return 0

    def _stopping(self) -> bool:
        """Whether the job is being stopped, as this rank's daemon last said."""
        try:
            info = self.control.job()
        except DaemonError:
            return False
        return isinstance(info, dict) and info.get("stop") is not None

    def on_vote(self, step: int, flag: int) -> None:
        if flag == STOP_FLAG and not self.stop_agreed:
            self.stop_agreed = True
            self.log.info(f"Every rank agreed to stop the job after step {step}.", step=step)
            return
        plan = self._plan
        if plan is not None and flag == plan.group_version and not self._switch_next:
            self._switch_next = True
            if self.rank == 0:
                failpoints.hit("stayer.report_switching")  # the switch agreed, not yet said
                self._report(Report.SWITCHING, within=self.transfer_timeout)

    def _switch_action(self, step: int) -> Action:
        assert self._plan is not None
        self._switch_started = time.monotonic()
        if self.rank in self._plan.moves:
            return Action.HAND_OFF
        failpoints.hit("stayer.switch")  # phase 2, before the state has moved
        t0 = time.monotonic()
        outcomes = {r: self._transfer_outcome(r, t0 + self.transfer_timeout)
                    for r in self._plan.moves}
        if all(v == TRANSFER_OK.decode() for v in outcomes.values()):
            return Action.SWITCH_GROUPS
        self.log.warning("The state transfer failed; the migration is aborted.",
                         outcomes=outcomes, waited=round(time.monotonic() - t0, 3))
        if self.rank == 0:
            self._report(Report.ABORTED)
        self._forget("aborted")
        return Action.CONTINUE

    def _transfer_outcome(self, rank: int, deadline: float) -> str:
        """The leaver's word on ``rank``'s transfer; a called-off migration (the leaver died)
        ends the wait at once."""
        assert self._reports is not None and self._plan is not None
        while True:
            try:
                return self._reports.get(Report.TRANSFERRED.of(rank), timeout=0.2).decode()
            except DaemonError as exc:
                if time.monotonic() > deadline:
                    return f"no word from the leaver: {exc}"
            with contextlib.suppress(DaemonError):
                info = self.control.job()
                plan = Plan.from_info(info)
                if plan is None or plan.id != self._plan.id or plan.phase == MigrationPhase.ABORTED:
                    # committed: the joiners took over, so they hold the state
                    return TRANSFER_OK.decode() if committed(info, self._plan) else \
                        "the migration was called off"

    def switch_groups(self, step: int) -> None:
        assert self._plan is not None
        t0 = time.monotonic()
        self.groups.switch(self._prepared)
        self.nodes = self._plan.nodes_after(self.nodes)
        self.groups.epoch = self._plan.to_epoch
        self.last_switch_s = time.monotonic() - t0
        # Phase 2 as this rank saw it: from the agreed boundary (the state's transfer on the
        # leavers) to the new groups; the first rank that stays says it for the job.
        if self.rank == min(r for r in range(self.layout.world_size)
                            if r not in self._plan.moves):
            report_downtime(self.job, self._plan.id, self._plan.to_epoch, self.rank,
                            time.monotonic() - self._switch_started, self.log)
        self.log.info(f"Switched to the next versions of {self._prepared} at step {step}.",
                      epoch=self._plan.to_epoch)
        self._finished.add(self._plan.id)
        self._plan, self._prepared, self._switch_next = None, [], False

    def hand_off(self, step: int, state: dict[str, Any]) -> bool:
        """Stream the state to the joiner. True: handed off, this rank leaves. False: the
        transfer failed and this rank keeps training (the survivors stay on the old groups)."""
        assert self._plan is not None
        pair = pair_name(self.rank, self._plan.group_version)
        ahead = self._ahead
        try:
            if ahead is not None:  # the joiner holds the job's state: only the rest crosses
                ahead.wait()
                before = ahead.summary()
                ahead.send({"switch": {"rng": state["rng"], "runtime": state["runtime"]}},
                           "the switch", should_abort=_leaver_send_failpoint)
                ahead.wait()
                stats = ahead.sent[-1][1]
                self.log.info(f"Rank {self.rank}: {before}.")
            else:
                self.groups.switch([pair])
                with PairGroupTransport(self.groups.current(pair),
                                        timeout_s=self.transfer_timeout) as transport:
                    stats = send_state(transport, state,
                                       should_abort=_leaver_send_failpoint)
        except TransferError as exc:
            self.log.warning(f"Handing the state off failed: {exc}.")
            self._report(Report.TRANSFERRED.of(self.rank), f"failed: {exc}".encode(),
                         within=self.transfer_timeout)
            self._forget("aborted")
            return False
        self.log.info(f"Handed the state of rank {self.rank} off at step {step}: {stats}.")
        failpoints.hit("leaver.handed_off")  # the joiner holds the state; nobody knows yet
        # The stayers wait for this word (up to their transfer timeout): keep trying as long.
        self._report(Report.TRANSFERRED.of(self.rank), TRANSFER_OK, within=self.transfer_timeout)
        return True


def wait_for_plan(control: DaemonClient, node: str, stop: threading.Event,
                  poll: float = 0.1, wait: float = PLAN_WAIT_S) -> tuple[Plan, int] | None:
    """A standby's wait: the first active migration that names this node as a joiner, and the
    rank it takes. None if ``stop`` is set first (seen within ``wait`` seconds).

    A long poll on the daemon (``DaemonClient.job_changed``): the standby hears of the plan as
    soon as its daemon has read it, where a poll every 0.1 s added 50 ms on average to every
    migration and recovery. Each answer, at least one every ``wait`` seconds, also tells the
    daemon the standby is alive. ``poll``: the pause after a failed request."""
    token: str | None = None
    while not stop.is_set():
        try:
            info, token = control.job_changed(token, wait)
            plan = Plan.from_info(info)
        except DaemonError:
            plan, token = None, None
            stop.wait(poll)
        rank = chosen_rank(plan, node)
        if plan is not None and rank is not None:
            return plan, rank
    return None


def chosen_rank(plan: Plan | None, node: str) -> int | None:
    """The rank ``plan`` gives the standby on ``node``, while the plan can still take it."""
    if plan is not None and plan.phase in (MigrationPhase.PLANNED, MigrationPhase.PREPARING):
        for rank, (_, joiner) in plan.moves.items():
            if joiner == node:
                return rank
    return None


class Joiner:
    """A standby taking over ``rank`` under ``plan``: phase 1 with the survivors, then the
    state from the leaver, then the new groups (see the module docstring)."""

    def __init__(self, control: DaemonClient, groups: GroupSet, plan: Plan, *, job: str,
                 rank: int, node: str, layout: Layout, nodes: tuple[str, ...],
                 timeout: float = 120.0) -> None:
        self.control, self.groups, self.plan = control, groups, plan
        self.job, self.rank, self.node, self.layout = job, rank, node, layout
        self.nodes_before = nodes
        # A reshape's joiner is numbered in the new shape (``layout``), as its donor is.
        self.nodes = (plan.reshaped_nodes(nodes, layout.tp, layout.pp) if plan.reshape
                      else plan.nodes_after(nodes))
        self.timeout = timeout
        self.reports = DaemonClient(f"{job}/migration/{plan.id}", epoch=plan.from_epoch,
                                    timeout=10)
        self.log = logs.get(job=job, rank=rank, node=node)
        #: a recovery's joiner: it takes the state as soon as its pair is up (:meth:`prepare`)
        self._early = False

    def bound(self) -> None:
        self.reports.set(Report.BOUND.of(self.rank), b"1")

    def prepare(self) -> list[str]:
        """Wait for phase 1 and build this joiner's groups; returns their names.

        A recovery's joiner waits only for its pair with the donor, and reports phase 1 done
        once :meth:`receive` took the state and the other groups are up: the state crosses
        while they come up (their rendezvous waits on peers, the state on bandwidth). Every
        other joiner waits for all of them here and reports at once (a drain's leaver sends
        only once the whole migration is prepared)."""
        deadline = time.monotonic() + self.timeout
        token: str | None = None
        while True:
            # A long poll: phase 1 is heard the moment the daemon has it, not at a poll's tick.
            info, token = self.control.job_changed(token, PHASE_WAIT_S)
            plan = self._still_on(Plan.from_info(info))
            if plan.phase != MigrationPhase.PLANNED:
                break
            if time.monotonic() > deadline:
                raise TransferError(f"migration {self.plan.id} never reached phase 1")
        names = [*self.layout.concrete(self.rank).values()]
        for name in names:
            self.groups.prepare(name, self.plan.group_version,
                                group_members(name, self.nodes, self.layout))
        waiting = list(names)
        if not self.plan.rollback:  # a rollback's joiner loads its rank's snapshot instead
            pair = pair_name(self.rank, self.plan.group_version)
            donor = self.plan.donor_of.get(self.rank, -1)
            source = (member(donor, self.nodes[donor]) if self.plan.reshape
                      else self.plan.source(self.rank, self.nodes_before))
            self.groups.prepare(pair, self.plan.group_version,
                                (source, member(self.rank, self.node)))
            waiting.append(pair)
        self._early = self.plan.kind == MigrationKind.RECOVERY
        self._wait_ready([waiting[-1]] if self._early else waiting, deadline)
        failpoints.hit("joiner.prepared")  # phase 1 done here (a recovery's: its pair is up)
        if not self._early:
            self.reports.set(Report.JOINER_PREPARED.of(self.rank), b"1")
        return names

    def _wait_ready(self, names: list[str], deadline: float) -> None:
        """Until every one of ``names`` is built. A member lost meanwhile keeps a group from
        ever coming up: the migration is called off, and this joiner leaves at once
        (TransferError) rather than hold its node for the timeout."""
        checked = time.monotonic()
        while not self.groups.ready(names):
            if time.monotonic() > deadline:
                raise TransferError("the new groups did not come up in time")
            if time.monotonic() - checked > 0.25:
                self._current()
                checked = time.monotonic()
            self.groups.wait_ready(names, 0.05)  # returns as the last of them is built

    def _current(self) -> Plan:
        """This joiner's migration as the daemon sees it now; TransferError once it ended."""
        return self._still_on(Plan.from_info(self.control.job()))

    def _still_on(self, plan: Plan | None) -> Plan:
        """``plan``, the job's migration as just read, if it is still this joiner's;
        TransferError once it ended."""
        if plan is None or plan.id != self.plan.id or plan.phase in ("done", "aborted"):
            raise TransferError(f"migration {self.plan.id} was called off")
        return plan

    def receive(self, names: list[str], runtime: Runtime, into: Any = None) -> None:
        """Take the leaver's state into ``runtime``, then switch to the new groups. ``into``:
        this joiner's own state tree (its job is built), whose tensors the leaver's overwrite
        in place where path, dtype and shape match, so that the joiner never holds a second
        copy of the state.

        The leaver either sends its whole state at the switch, or (its job replays) sends it
        ahead and then each committed step's apply inputs, which this joiner applies as they
        come, and at the switch the RNGs and counters (:class:`SendAhead`).

        Raises:
            TransferError: the state did not arrive whole, or the job failed to load or apply
                it (``runtime``'s state is then partly written).
        """
        pair = pair_name(self.rank, self.plan.group_version)
        self.groups.switch([pair])
        transport = PairGroupTransport(self.groups.current(pair), timeout_s=self.timeout)
        watcher_stop = threading.Event()

        def watch() -> None:  # a called-off migration releases the blocked receive
            while not watcher_stop.wait(0.1):
                try:
                    plan = Plan.from_info(self.control.job())
                except DaemonError:
                    continue
                if plan is None or plan.id != self.plan.id or plan.phase == MigrationPhase.ABORTED:
                    transport.abort(f"migration {self.plan.id} was aborted")
                    return

        watcher = threading.Thread(target=watch, name="joiner-watch", daemon=True)
        watcher.start()
        try:
            state, stats = receive_into(
                transport, into, on_chunk=lambda i, _: failpoints.hit("joiner.receive.chunk"))
            ahead = state.pop("ahead", None) if isinstance(state, dict) else None
            _load(runtime, state)
            if ahead is not None:
                stats = self._follow(transport, runtime, stats)
        finally:
            watcher_stop.set()
            watcher.join(2)
            transport.close()
        if self._early:  # a recovery's: the state came first, now the rest of phase 1
            self._wait_ready(names, time.monotonic() + self.timeout)
            self.reports.set(Report.JOINER_PREPARED.of(self.rank), b"1")
        self.switch(names)
        self.log.info(f"Took over rank {self.rank}: {stats}.", epoch=self.plan.to_epoch)

    def _follow(self, transport: PairGroupTransport, runtime: Runtime,
                first: TransferStats) -> TransferStats:
        """Apply each step the leaver forwards until the switch's word (with the last step's
        inputs, or on its own); returns the last message's figures (the state's were logged).
        A job that applies its inputs as they land (``api.applies_landing``) does so on a
        thread of its own while they cross (:class:`_LandingReplay`)."""
        self.log.info(f"Took the state of rank {self.rank} ahead, at step {runtime.step}: "
                      f"{first}.")
        inputs: Any = None  # the last step's inputs: the next step's land in them in place
        applied = 0
        while True:
            replay = _LandingReplay(runtime) if applies_landing(runtime.job) else None
            try:
                message, stats = receive_into(
                    transport, inputs, landing=None if replay is None else replay.landing)
            finally:
                if replay is not None:
                    replay.join()  # a failed transfer ends it too (Landing.fail)
            if not isinstance(message, dict):
                raise TransferError(f"the leaver sent a {type(message).__name__}, not a message")
            if "apply" in message:
                try:
                    if replay is not None and replay.started:
                        replay.result()
                    else:
                        runtime.replay(int(message["apply"]), message["inputs"])
                except Exception as exc:  # the job's own code, or a step out of order
                    raise TransferError(f"applying step {message['apply']} as the leaver did "
                                        f"failed: {type(exc).__name__}: {exc}") from exc
                inputs, applied = message, applied + 1
            if "switch" in message:
                try:
                    runtime.load_counters(message["switch"]["rng"], message["switch"]["runtime"])
                except (ValueError, KeyError, TypeError) as exc:
                    raise TransferError(f"the switch message does not fit: {exc}") from exc
                self.log.info(f"Applied {applied} step(s) as the leaver did"
                              f"{' as their inputs landed' if replay is not None else ''}; at "
                              f"the switch, step {runtime.step}.")
                return stats
            if "apply" not in message:
                raise TransferError(f"the leaver sent a message with keys {sorted(message)}")

    def restore(self, runtime: Runtime, directory: Path | None,
                holder: SnapshotHolder | None = None) -> None:
        """A rollback's joiner: load this rank's snapshot of the plan's step from where the plan
        says (``holder``: this standby's own, whose copies need no network) and say so (the
        survivors wait for it). Raises TransferError."""
        holders = HolderDirectory(self.job, lambda: self.plan.from_epoch)
        try:
            where = restore(runtime, self.plan.snapshot_step, self.plan.snapshot_source(self.rank),
                            directory=directory, holders=holders, local=holder,
                            timeout=self.timeout, epoch=self.plan.from_epoch)
        except SnapshotError as exc:
            self.reports.set(Report.TRANSFERRED.of(self.rank), f"failed: {exc}".encode())
            raise TransferError(f"could not load the snapshot: {exc}") from exc
        finally:
            holders.close()
        self.reports.set(Report.TRANSFERRED.of(self.rank), TRANSFER_OK)
        self.log.info(f"Took over rank {self.rank} from its snapshot of step "
                      f"{self.plan.snapshot_step} ({where}).", epoch=self.plan.to_epoch)

    def switch(self, names: list[str]) -> None:
        self.groups.switch(names)
        self.groups.epoch = self.plan.to_epoch

    def switched(self) -> None:
        self.reports.set(Report.SWITCHED.of(self.rank), b"1")
        self.reports.close()

    def committed(self) -> bool:
        """A reshape's joiner, holding its state and groups: wait until the controller
        committed the new shape (True) or called it off (False: the ranks that stay keep the
        old one, and this joiner must leave)."""
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(DaemonError):
                info = self.control.job() or {}
                plan = Plan.from_info(info)
                if plan is None or plan.id != self.plan.id or plan.phase == MigrationPhase.ABORTED:
                    return False
                if plan.phase == MigrationPhase.DONE:
                    return True
            time.sleep(0.02)
        return False


class _LandingReplay:
    """A joiner's apply of one forwarded step while its inputs land: started (on a thread of
    its own) once the message's manifest is read, if the message is a step's inputs."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.landing = Landing(on_begin=self._begin)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def started(self) -> bool:
        return self._thread is not None

    def _begin(self, tree: Any) -> None:
        if not (isinstance(tree, dict) and "apply" in tree
                and isinstance(tree.get("inputs"), dict)):
            return  # not a step's inputs (or a foreign message): the caller says why
        step, inputs = tree["apply"], tree["inputs"]

        def run() -> None:
            try:
                self.runtime.replay_landing(int(step), inputs, self.landing)
            except BaseException as exc:  # handed to the joiner's thread by result()
                self._error = exc

        self._thread = threading.Thread(target=run, name="understudy-apply-landing",
                                        daemon=True)
        self._thread.start()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def result(self) -> None:
        """Raise what the apply raised, if anything."""
        self.join()
        if self._error is not None:
            raise self._error


def _load(runtime: Runtime, state: Any) -> None:
    """``runtime.load_state(state)``, its failures (the job's own code, a foreign tree) a
    TransferError: the joiner cannot take the rank."""
    try:
        runtime.load_state(state)
    except Exception as exc:
        raise TransferError(f"the job could not load the leaver's state: "
                            f"{type(exc).__name__}: {exc}") from exc
