"""The worker's start-up runs with the cyclic garbage collector paused, and leaves it as the
script had it; a job that opts in to its GPU gets ``LOCAL_RANK``'s."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch

from understudy.worker.api import JobContext, TrainingJob
from understudy.worker.launch import _collector_paused, worker_gpu


@pytest.fixture(autouse=True)
def _restore_collector() -> Iterator[None]:
    enabled = gc.isenabled()
    yield
    if enabled:
        gc.enable()
    else:
        gc.disable()


def test_the_collector_is_paused_inside_and_running_again_after() -> None:
    gc.enable()
    with _collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_failing_start_up_turns_the_collector_back_on() -> None:
    gc.enable()
    with pytest.raises(RuntimeError, match="build failed"), _collector_paused():
        raise RuntimeError("build failed")
    assert gc.isenabled()


def test_a_script_that_turned_the_collector_off_keeps_it_off() -> None:
    gc.disable()
    with _collector_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


class _Job(TrainingJob):
    def build(self, ctx: JobContext) -> None: ...
    def compute(self, step: int) -> float | None: ...
    def apply(self, step: int) -> None: ...
    def discard(self, step: int) -> None: ...
    def state(self) -> dict[str, object]:
        return {}

    def load_state(self, state: dict[str, object]) -> None: ...


class _GpuJob(_Job):
    gpu = True


def test_only_a_job_that_opts_in_gets_a_gpu_and_only_where_there_is_cuda(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert worker_gpu(_Job()) is None  # places itself, as before
    if not torch.cuda.is_available():
        assert worker_gpu(_GpuJob()) is None  # its own build says it needs CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_job_trains_on_its_slots_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    count = torch.cuda.device_count()
    for slot in range(2 * count):
        monkeypatch.setenv("LOCAL_RANK", str(slot))
        device = worker_gpu(_GpuJob())
        assert device == torch.device("cuda", slot % count)
        assert torch.cuda.current_device() == slot % count
