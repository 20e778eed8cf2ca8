"""A survivor's compute stopped at its next autograd operation once the job recovers
(``worker/interrupt.py``), on a real one-rank gloo job: how far compute got, what the runtime
rolled back, and that the run goes on bitwise as if nothing had happened."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.unit.test_runtime import solo  # noqa: F401
from tests.unit.test_sizes import _example
from understudy.worker import rng
from understudy.worker.api import CollectiveAborted, JobContext, TrainingJob, interrupts
from understudy.worker.interrupt import ComputeInterrupted, Tripwire, interruptible
from understudy.worker.runtime import Runtime

pytestmark = pytest.mark.timeout(30)

LAYERS = 40


class DeepJob(TrainingJob):
    """A stack of ``LAYERS`` tanh layers, dropout drawn from the process-global RNG; each
    forward layer and each backward layer counted. ``catch``: compute swallows an exception
    ("swallow") or turns it into a RuntimeError ("wrap")."""

    interruptible = True

    def __init__(self, catch: str | None = None) -> None:
        self.catch = catch
        self.forward_layers = self.backward_layers = 0
        self.backward_started = False

    def build(self, ctx: Any) -> None:
        g = torch.Generator().manual_seed(3)
        self.ws = [torch.nn.Parameter(torch.randn(16, 16, generator=g) / 4)
                   for _ in range(LAYERS)]
        self.opt = torch.optim.SGD(self.ws, lr=0.1)
        torch.manual_seed(7)  # the dropout masks: the runtime rolls the generator back

    def _count_back(self, grad: torch.Tensor) -> torch.Tensor:
        self.backward_layers += 1
        return grad

    def _forward_backward(self, step: int) -> None:
        self.backward_started = False
        self.opt.zero_grad(set_to_none=False)
        x = torch.ones(4, 16) * (step + 1)
        for w in self.ws:
            x = torch.nn.functional.dropout(torch.tanh(x @ w), 0.1)
            x.register_hook(self._count_back)
            self.forward_layers += 1
        self.backward_started = True
        x.square().mean().backward()

    def compute(self, step: int) -> float | None:
        try:
            self._forward_backward(step)
        except Exception as exc:
            if self.catch == "wrap":
                raise RuntimeError("the model failed") from exc
            if self.catch != "swallow":
                raise
        return None

    def apply(self, step: int) -> None:
        self.opt.step()

    def discard(self, step: int) -> None:
        self.opt.zero_grad(set_to_none=False)

    def state(self) -> dict[str, Any]:
        return {"ws": [w.detach().clone() for w in self.ws]}

    def load_state(self, state: dict[str, Any]) -> None:
        for w, v in zip(self.ws, state["ws"], strict=True):
            w.data.copy_(v)


def _runtime(job: TrainingJob, ctx: JobContext, abort: Callable[[], bool]) -> Runtime:
    # Asked at every operation: the layers here take microseconds, not the 50 ms of a poll.
    runtime = Runtime(job, dataclasses.replace(ctx, should_abort=abort, poll_interval=1e-9))
    runtime.build()
    return runtime


def _uninterrupted(ctx: JobContext, steps: int) -> list[torch.Tensor]:
    job = DeepJob()
    _runtime(job, ctx, lambda: False).run(steps)
    return job.state()["ws"]


def test_the_wire_asks_at_most_once_per_poll_and_stays_tripped() -> None:
    now = [0.0]
    answers = iter([False, True])
    asked: list[float] = []

    def should_abort() -> bool:
        asked.append(now[0])
        return next(answers)

    wire = Tripwire(should_abort, poll_s=0.01, clock=lambda: now[0])
    for t in (0.0, 0.002, 0.009):
        now[0] = t
        wire.check()
    assert asked == [0.0]
    now[0] = 0.011
    with pytest.raises(ComputeInterrupted, match=r"compute stopped after 0\.01 s: the job is "
                                                 r"recovering") as caught:
        wire.check()
    assert isinstance(caught.value, CollectiveAborted)
    now[0] = 0.012  # tripped: raises again at once, without asking
    with pytest.raises(ComputeInterrupted):
        wire.check()
    assert asked == [0.0, 0.011] and wire.tripped and wire.calls == 5


def test_the_hooks_raise_from_the_forward_and_the_backward_and_autograd_works_after() -> None:
    w = torch.ones(3, 3, requires_grad=True)
    for trip_in_backward in (False, True):
        trip = [False]
        with pytest.raises(ComputeInterrupted), interruptible(lambda t=trip: t[0], poll_s=0.0):
            y = torch.tanh(torch.ones(2, 3) @ w)  # saves tensors: asks
            trip[0] = True
            if trip_in_backward:
                y.sum().backward()  # unpacks them: asks
            else:
                torch.tanh(y)
    torch.tanh(torch.ones(2, 3) @ w).sum().backward()  # no hooks left behind
    assert w.grad is not None


def test_an_interruptible_compute_stops_at_its_next_operation_and_the_run_goes_on_bitwise(
        solo: JobContext) -> None:  # noqa: F811
    expected = _uninterrupted(solo, 4)
    job = DeepJob()
    aborting = [False]
    runtime = _runtime(job, solo, lambda: aborting[0] or job.forward_layers >= 2 * LAYERS + 10)
    runtime.run(2)
    before = [w.detach().clone() for w in job.ws]
    generators = rng.capture()
    with pytest.raises(ComputeInterrupted, match="the job is recovering"):
        runtime.run(4)
    # It stopped within a layer or two of the word, far from the step's end.
    assert 2 * LAYERS + 10 <= job.forward_layers <= 2 * LAYERS + 12, job.forward_layers
    assert not job.backward_started
    assert runtime.step == 2 and runtime.pending is None
    assert all(torch.equal(a, b) for a, b in zip(before, job.ws, strict=True))
    assert all(w.grad is None or not w.grad.any() for w in job.ws)  # discarded
    assert rng.capture()["cpu"].equal(generators["cpu"])
    job.forward_layers = -10**9  # the recovery is over: nothing asks to stop now
    assert runtime.run(4).value == "completed"
    assert all(torch.equal(a, b) for a, b in zip(expected, job.ws, strict=True))


def test_a_backward_is_stopped_too(solo: JobContext) -> None:  # noqa: F811
    job = DeepJob()
    runtime = _runtime(job, solo, lambda: job.backward_started and job.backward_layers >= 5)
    with pytest.raises(ComputeInterrupted):
        runtime.run(1)
    assert job.forward_layers == LAYERS and 5 <= job.backward_layers <= 7, job.backward_layers
    assert runtime.step == 0 and runtime.pending is None


@pytest.mark.parametrize("catch", ["swallow", "wrap"])
def test_a_job_that_catches_the_interruption_is_stopped_all_the_same_and_casts_no_vote(
        solo: JobContext, catch: str) -> None:  # noqa: F811
    job = DeepJob(catch=catch)
    runtime = _runtime(job, solo, lambda: job.forward_layers >= 3)
    with pytest.raises(ComputeInterrupted, match="the job is recovering") as caught:
        runtime.run(1)
    if catch == "wrap":
        assert "RuntimeError: the model failed" in str(caught.value)
    # No vote, nothing pending: a swallowed interruption leaves gradients that are not the
    # step's, which no peer may commit and no settle may apply.
    assert runtime.step == 0 and runtime.pending is None
    assert not any(t.committed for t in runtime.timings)


def test_a_job_that_does_not_opt_in_computes_to_its_next_collective(
        solo: JobContext) -> None:  # noqa: F811
    job = DeepJob()
    job.interruptible = False
    assert not interrupts(job)
    runtime = _runtime(job, solo, lambda: job.forward_layers >= 3)
    with pytest.raises(CollectiveAborted) as caught:
        runtime.run(1)
    assert not isinstance(caught.value, ComputeInterrupted)
    assert "the vote on step 0" in str(caught.value)
    assert job.forward_layers == LAYERS and job.backward_layers == LAYERS
    assert runtime.pending is not None  # computed whole: kept for the survivors' settle


def test_a_standalone_context_installs_no_hooks(solo: JobContext,  # noqa: F811
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    assert not solo.aborts
    calls: list[int] = []
    monkeypatch.setattr(Tripwire, "check", lambda self: calls.append(1))
    job = DeepJob()
    runtime = Runtime(job, solo)
    runtime.build()
    runtime.run(1)
    assert calls == []


def test_the_example_opts_in_unless_told_not_to() -> None:
    example = _example()
    for extra, expected in (([], True), (["--interruptible"], True),
                            (["--no-interruptible"], False)):
        for job in ([], ["--shard-optimizer"]):
            made = example.make_job(example.parse_args(["--steps", "1", *job, *extra]))
            assert interrupts(made) is expected, (job, extra)
