"""Sizes on the command line (``common/sizes.py``) and the example job sized by them."""

from __future__ import annotations

import argparse
import copy
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.unit.test_runtime import assert_bitwise_equal
from understudy.common.sizes import parse_size, size_arg
from understudy.worker.api import JobContext
from understudy.worker.runtime import Runtime, StaticGroups

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "plain_torch" / "train.py"


@pytest.mark.parametrize(("text", "expected"), [
    ("1000", 1000), ("27KB", 27_000), ("27kb", 27_000), ("64MiB", 64 * 2**20),
    ("1GiB", 2**30), ("1.5GB", 1_500_000_000), (" 256 MiB ", 256 * 2**20),
    ("12B", 12)])
def test_parse_size_reads_decimal_and_binary_units(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "MiB", "12XB", "1..5GB", "-3MiB", "0", "ten"])
def test_parse_size_refuses_what_is_not_a_size(text: str) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_size(text)
    with pytest.raises(argparse.ArgumentTypeError, match="size"):
        size_arg(text)


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("plain_train", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _solo(tmp_path: Path, job: str, slots: int = 0) -> JobContext:
    """A one-rank job's context on real gloo groups."""
    groups = StaticGroups(dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                          tp=1, timeout=10)
    return JobContext(job=job, rank=0, world_size=1, tp=1, groups=groups,
                      collective_timeout=5, slots=slots)


def _tensor_bytes(tree: object) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_tensor_bytes(v) for v in tree)
    return 0


@pytest.mark.parametrize(("tp", "pp", "layers"), [(1, 1, 1), (2, 1, 1), (4, 1, 2), (2, 2, 4)])
def test_the_hidden_width_for_a_state_size_gives_that_size(tp: int, pp: int,
                                                           layers: int) -> None:
    # The formula counts what the job holds: its parameters and Adam's two moments.
    train = _example()
    target = 8 * 2**20
    hidden = train.hidden_for(target, features=16, layers=layers, tp=tp, pp=pp)
    assert hidden % tp == 0
    per_block = (2 * 16 + 1) * hidden // tp + 16
    fixed = 2 * (16 * 16 + 16) if pp == 1 else 16 * 16 + 16
    held = (fixed + layers // pp * per_block) * train.STATE_PER_PARAM
    assert target - 0.01 * target <= held <= target


def test_a_job_built_at_a_state_size_holds_it(tmp_path: Path) -> None:
    train = _example()
    ctx = _solo(tmp_path, "sized")
    job = train.PlainJob(state_bytes=4 * 2**20)
    job.build(ctx)
    job.compute(0)
    job.apply(0)  # Adam's moments exist once it stepped
    held = _tensor_bytes(job.state())
    assert 0.99 * 4 * 2**20 <= held <= 1.001 * 4 * 2**20, held


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_a_sharded_job_keeps_no_second_copy_of_its_model_or_its_gradients(
        tmp_path: Path) -> None:
    # ShardedJob's parameters are views of its all-gather's buffer, and their gradients views
    # of its reduce-scatter's: at 1 GiB a rank, each separate copy would be 358 MB more.
    train = _example()
    ctx = _solo(tmp_path, "sharded")

    def built() -> Any:
        args = ["--shard-optimizer", "--state-size", "1MiB", "--steps", "5"]
        job = train.make_job(train.parse_args(args))
        job.build(ctx)
        return job

    def step(job: Any, n: int) -> None:
        job.reseed(n)  # the dropout masks of step n, as the runtime draws them
        job.compute(n)
        job.apply(n)

    job = built()
    first = {name: q.detach().clone() for name, q in job.params.items()}
    for n in range(3):
        step(job, n)
    offset = 0
    for name, q in job.params.items():
        assert _storage(q) == _storage(job.gathered), name
        assert _storage(q.grad) == _storage(job.grad_buffer), name
        assert torch.equal(q.detach().flatten(),
                           job.gathered[offset:offset + q.numel()])
        offset += q.numel()
    assert not torch.equal(first["block0_w1"], job.params["block0_w1"])
    # A job that takes the state of step 3 goes on as the first does, bit for bit, its model
    # still the buffer's views.
    again = built()
    again.load_state(copy.deepcopy(job.state()))  # as it arrives: no tensor shared
    for n in range(3, 5):
        step(job, n)
        step(again, n)
    assert_bitwise_equal(job.state(), again.state())
    assert all(_storage(q) == _storage(again.gathered)
               for q in again.params.values())
    # A gradient set aside (to None) is an error, not a step that syncs stale zeros.
    next(iter(job.params.values())).grad = None
    with pytest.raises(RuntimeError, match="no longer a view"):
        job.compute(5)


def test_a_slotted_sharded_job_keeps_no_second_copy_of_its_model_or_its_gradients(
        tmp_path: Path) -> None:
    # SlottedShardedJob's parameters are views of the flat buffer its slots' chunks are
    # gathered into, and its gradients views of the flat buffer apply reads, through the
    # runtime's slotted steps (which sum the slots' gradients back into them) too.
    train = _example()

    def built(name: str) -> tuple[Any, Runtime]:
        (tmp_path / name).mkdir()
        job = train.make_job(train.parse_args(["--shard-optimizer", "--slots", "2",
                                               "--state-size", "1MiB", "--steps", "5"]))
        runtime = Runtime(job, _solo(tmp_path / name, "slotted", slots=2))
        runtime.build()
        return job, runtime

    def assert_views(job: Any) -> None:
        offset = 0
        for name, q in job.params.items():
            assert _storage(q) == _storage(job.flat), name
            assert _storage(q.grad) == _storage(job._grads), name
            assert torch.equal(q.detach().flatten(), job.flat[offset:offset + q.numel()]), name
            offset += q.numel()

    job, runtime = built("leaver")
    first = job.params["block0_w1"].detach().clone()
    runtime.run(2)
    state = copy.deepcopy(runtime.state())
    runtime.run(3)
    assert not torch.equal(first, job.params["block0_w1"])
    assert_views(job)
    # A joiner following the job applies step 2 from its apply inputs (one flat tensor, as it
    # arrives: its own, uncopied) and goes on bit for bit, its gradients views of that tensor.
    inputs = copy.deepcopy(job.apply_inputs(2))
    joiner, again = built("joiner")
    again.load_state(state)
    again.replay(2, inputs)
    assert_bitwise_equal(job.state(), joiner.state())
    assert joiner._grads is inputs["grads"][0]
    runtime.run(5)
    again.run(5)
    assert_bitwise_equal(job.state(), joiner.state())
    assert_views(joiner)
    with pytest.raises(ValueError, match="do not fit"):
        again.replay(5, {"grads": [torch.zeros(3)]})
    # A gradient set aside (to None) is an error, not a step that applies stale values.
    next(iter(job.params.values())).grad = None
    with pytest.raises(RuntimeError, match="no longer a view"):
        job.apply(5)
