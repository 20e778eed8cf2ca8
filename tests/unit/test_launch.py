"""The worker's start-up runs with the cyclic garbage collector paused, and leaves it as the
script had it; a job that opts in to its GPU gets ``LOCAL_RANK``'s; a standby preloads what the
job names (``TrainingJob.preload``)."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from understudy.sandbox.standby import LAZY_IMPORTS, import_lazy_modules, preload_of
from understudy.worker.api import JobContext, TrainingJob
from understudy.worker.launch import _collector_paused, worker_gpu

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "plain_torch" / "train.py"


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


def test_a_standby_preloads_what_the_job_names_and_torch_dynamo_unless_it_says() -> None:
    assert preload_of(_Job()) == LAZY_IMPORTS == ("torch._dynamo",)
    for names, expected in (((), ()), (["json", "csv"], ("json", "csv"))):
        job = _Job()
        job.preload = names  # type: ignore[assignment]
        assert preload_of(job) == expected
    for bad in ("torch._dynamo", (1,), ("",), None, {"json": 1}):
        job = _Job()
        job.preload = bad  # type: ignore[assignment]
        with pytest.raises(TypeError, match=r"_Job.preload must be a tuple of module names"):
            preload_of(job)


def test_a_module_that_cannot_be_preloaded_is_reported_and_the_rest_imported() -> None:
    failed = import_lazy_modules(("understudy_no_such_module", "json"))
    assert set(failed) == {"understudy_no_such_module"}
    assert failed["understudy_no_such_module"].startswith("ModuleNotFoundError:")
    assert "json" in sys.modules


def test_the_plain_example_on_functional_adam_preloads_nothing_and_never_loads_dynamo(
        tmp_path: Path) -> None:
    """What ``preload = ()`` stands on: two steps of the example with torch's functional Adam,
    built and trained in a fresh interpreter, leave ``torch._dynamo`` unimported (a standby of
    such a job would import it for nothing); its sharded form steps torch.optim.Adam, so it
    keeps the default."""
    probe = f"""
import json, runpy, sys
sys.argv = [{str(EXAMPLE)!r}, "--steps", "2", "--rank", "0", "--world-size", "1", "--tp", "1",
            "--store", {str(tmp_path / "store")!r}, "--adam", "functional"]
module = runpy.run_path(sys.argv[0], run_name="plain_example")
assert module["main"]() == 0
plain = module["PlainJob"](adam="functional").preload
sharded = module["ShardedJob"](adam="functional").preload
print(json.dumps(["torch._dynamo" in sys.modules, plain, sharded]))
"""
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr[-3000:]
    dynamo, plain, sharded = json.loads(res.stdout.strip().splitlines()[-1])
    assert dynamo is False
    assert plain == [] and tuple(sharded) == LAZY_IMPORTS
