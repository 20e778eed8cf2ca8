"""megatron-core's ``DistributedDataParallel`` and ``DistributedOptimizer`` on the job's groups,
with a copy of every optimizer shard on the next data-parallel rank. **CUDA only.**

:class:`ShardedMegatronJob` is :class:`~understudy.worker.megatron.adapter.MegatronJob`'s GPT
trained with Megatron's ZeRO-1: the parameters live in Megatron's contiguous parameter buffer,
the gradients in its gradient buffer, and DP rank ``d`` owns the ``d``-th of ``dp`` equal parts
of each bucket: fp32 main values and Adam's moments for that part only, the only copy of them.

**What Megatron does and what the adapter does.** Megatron lays out the buffers, maps every
parameter to its ranges, owns the shard's main parameters and its inner optimizer
(``torch.optim.AdamW``, fused, weight decay 0) and does the optimizer's arithmetic
(``prepare_grads``, the inner step, main to model parameters). The adapter issues the step's
data-parallel collectives itself, on Megatron's own bucket views and as Megatron would issue
them (``overlap_grad_reduce`` and ``overlap_param_gather`` off), but waited abortably like every
collective of an understudy job, and at the places the worker API needs:

- ``compute``: all-gather of the parameter buffer (each rank's part), forward and backward
  (Megatron's hooks add the gradients into the gradient buffer), each bucket scaled by
  ``1/dp`` and reduce-scattered (each rank gets its part's average), then the part's gradient
  sent to DP rank ``d + 1`` and the previous rank's received;
- ``apply``: Megatron's ``prepare_grads`` and inner step on the rank's part (without
  ``DistributedOptimizer.step_with_ready_grads``' all-gather: the next ``compute`` does it, so
  ``apply`` stays free of communication, as a joiner that applies a step from
  ``apply_inputs`` needs), and the same AdamW step on the *buddy* copy of part ``d - 1``.

Nothing else in Megatron's optimizer step communicates here: gradient clipping is off
(``clip_grad=0``: no all-reduce of the gradient norm), and neither fp32 nor bf16 takes a loss
scaler (no all-reduce of a found-inf flag). A job that turns either on puts a collective into
``apply``, which the step protocol takes to be local: not supported.

The buddy copy mirrors rank ``d - 1``'s main parameters piece by piece (Megatron's own range
map, computed for rank ``d - 1``) with the same fused AdamW over tensors of the same shapes in
the same order, so it is bitwise what rank ``d - 1`` holds at every commit. A lost rank's
state is rebuilt from it (:meth:`ShardedMegatronJob.replica_state`), as for
``examples/plain_torch/train.py``'s ``ShardedJob``: the donor sends the lost rank's part, and
the replacement's own copy of its predecessor's part comes from the predecessor during its
first step (a ``dp``-element all-reduce at each step's start says who misses one).

**Why CUDA only** (megatron-core 0.16.1; :data:`CUDA_ONLY` is the error a CPU build gets):
``DistributedOptimizer`` accepts only ``torch.cuda.FloatTensor``, ``HalfTensor`` or
``BFloat16Tensor`` parameters (the type check in ``_build_model_and_main_param_groups``,
``megatron/core/optimizer/distrib_optimizer.py``); ``DistributedDataParallel``'s buffers
allocate on ``torch.cuda.current_device()`` (``_ParamAndGradBuffer``,
``megatron/core/distributed/param_and_grad_buffer.py``); and ``MixedPrecisionOptimizer`` keeps
its flags in ``device='cuda'`` tensors (``megatron/core/optimizer/optimizer.py``). The CPU
adapter (:class:`MegatronJob`) trains with a plain replicated Adam instead.

**Point-to-point order.** NCCL runs the sends and receives between two ranks in the order they
were issued, one after the other; two ranks that both send first wait for each other forever.
So even DP ranks issue their sends first and odd ones their receives (:func:`exchange`).

**Tested** on CPU only, with megatron-core's CUDA device literals redirected
(``tests/integration/test_megatron_sharded.py``: hand-overs in two processes in bf16; a
crash and a drain under the daemons in fp32, to standbys warmed in the sandbox); its GPU test skips
without CUDA. No GPU was available while this was written, so it has not run on one. Not
covered: fp16 parameters (a loss scaler), more than one bucket per buffer
(``overlap_grad_reduce`` is off, so there is one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from understudy.common import logs
from understudy.worker.api import JobContext
from understudy.worker.copies import (
    adam_parts,
    buddy_check,
    check_keeps_copy,
    empty_adam_parts,
    install_adam_parts,
)
from understudy.worker.megatron.adapter import GPTShape, MegatronJob, _clone

log = logs.get("understudy.worker.megatron")

CUDA_ONLY = (
    "megatron-core 0.16.1's DistributedOptimizer runs on CUDA only: it accepts only "
    "torch.cuda.FloatTensor, HalfTensor or BFloat16Tensor parameters (the type check in "
    "megatron/core/optimizer/distrib_optimizer.py), its DistributedDataParallel allocates the "
    "parameter and gradient buffers on torch.cuda.current_device() "
    "(megatron/core/distributed/param_and_grad_buffer.py), and its MixedPrecisionOptimizer "
    "keeps its flags in device='cuda' tensors (megatron/core/optimizer/optimizer.py); on CPU "
    "use MegatronJob (replicated Adam)")

_BUDDY_TAG, _RESYNC_TAG = 21, 22


@dataclasses.dataclass(frozen=True)
class Piece:
    """The part of one parameter that a DP rank owns: ``param`` elements ``[start, end)``
    (flattened), which sit at ``[local, local + end - start)`` of the rank's part of bucket
    ``bucket`` of buffer ``buffer``."""

    buffer: int
    bucket: int
    param: torch.nn.Parameter
    start: int
    end: int
    local: int

    @property
    def numel(self) -> int:
        return self.end - self.start


def owned_pieces(buffers: Sequence[Any], dp: int, dp_rank: int) -> list[Piece]:
    """The pieces DP rank ``dp_rank`` owns, in the order Megatron's ``DistributedOptimizer``
    gives them to its inner optimizer: the fp32 parameters' pieces, then the 16-bit ones'
    (whose fp32 main copies the optimizer steps), each in range order (buffer by buffer,
    bucket by bucket, parameters in the buffer's ``param_index_map`` order;
    ``_build_model_and_main_param_groups``). Computed by Megatron's own range map for that
    rank, so a copy of another rank's part has its pieces' shapes and order.

    ``buffers``: Megatron ``_ParamAndGradBuffer`` objects (``buckets`` with ``grad_data`` and
    ``offset``, and ``param_index_map``).
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer, Range

    pieces = []
    for b, buffer in enumerate(buffers):
        for k, bucket in enumerate(buffer.buckets):
            size = bucket.grad_data.numel()
            if size % dp:
                raise ValueError(f"bucket {k} of buffer {b} holds {size} elements, not a "
                                 f"multiple of the {dp} DP ranks")
            part = size // dp
            world = Range(bucket.offset + dp_rank * part,
                          bucket.offset + min(size, (dp_rank + 1) * part))
            ranges = DistributedOptimizer._build_model_gbuf_param_range_map(
                buffer.param_index_map, world, bucket.offset)
            for param, r in ranges.items():
                pieces.append(Piece(b, k, param, r["param"].start, r["param"].end,
                                    r["gbuf_local"].start))
    # sorted() is stable: the range order within each kind.
    return sorted(pieces, key=lambda piece: piece.param.dtype != torch.float32)


def exchange(group: Any, dp_rank: int, sends: Iterable[tuple[torch.Tensor, int]],
             recvs: Iterable[tuple[torch.Tensor, int]], tag: int) -> list[Any]:
    """Issue ``sends`` (tensor, peer) and ``recvs`` (tensor, peer) on ``group``: even ranks
    their sends first, odd ranks their receives (see the module docstring). Returns the works,
    in issue order."""
    issue_sends = [lambda t=t, p=p: group.send([t], p, tag) for t, p in sends]
    issue_recvs = [lambda t=t, p=p: group.recv([t], p, tag) for t, p in recvs]
    order = issue_sends + issue_recvs if dp_rank % 2 == 0 else issue_recvs + issue_sends
    return [issue() for issue in order]


class ShardedMegatronJob(MegatronJob):
    """:class:`MegatronJob`'s GPT with Megatron's DDP and ``DistributedOptimizer`` on CUDA, and
    a copy of every optimizer part on the next DP rank (see the module docstring).

    ``copy=False``: Megatron's ZeRO-1 alone; a lost rank's part is then gone (the controller
    falls back to snapshots).

    Under the daemons it opts in to its worker's GPU (``gpu``): ``LOCAL_RANK``'s, made current
    by the launcher, its groups' NCCL communicators connected as each is built.
    """

    gpu = True

    def __init__(self, shape: GPTShape | None = None, *, copy: bool = True,
                 bf16: bool = False) -> None:
        super().__init__(shape)
        self.copy, self.bf16 = copy, bf16
        self.buddy_missing = False
        self._incoming: list[torch.Tensor] = []

    # -- building ---------------------------------------------------------------------------

    def _check_device(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(CUDA_ONLY)

    def _install_rng(self, ctx: JobContext) -> Any:
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel

        if ps._GLOBAL_MEMORY_BUFFER is None:
            ps._set_global_memory_buffer()
        # Megatron's streams on the CUDA generator: the same names and seeds as on CPU.
        tensor_parallel.model_parallel_cuda_manual_seed(ctx.seed, tp_rank=ctx.tp_index,
                                                        ep_rank=0, etp_rank=0)
        return tensor_parallel.get_cuda_rng_tracker()

    def _precision(self) -> dict[str, Any]:
        # bf16: the model's parameters in bf16, Megatron's fp32 main copy of each rank's part
        # in the optimizer, gradients reduced in fp32.
        return ({"params_dtype": torch.bfloat16, "bf16": True} if self.bf16 else
                super()._precision())

    def _device(self) -> torch.device:
        """The GPU this process trains on: the current one (under the daemons the launcher
        made it ``LOCAL_RANK``'s; standalone, the job's script picks it)."""
        return torch.device("cuda", torch.cuda.current_device())

    def _build_optimizer(self, config: Any, groups: Sequence[Any]) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
        )
        from megatron.core.optimizer import OptimizerConfig
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
        from megatron.core.transformer.module import Float16Module

        ctx, shape = self.ctx, self.shape
        _, dp, _ = groups
        self.device = self._device()
        assert self.model is not None
        self.model.to(self.device)
        # bf16: Megatron's Float16Module makes every parameter bf16 (its norms included) and
        # casts the inputs and the output, as Megatron's own training does.
        module = Float16Module(config, self.model) if self.bf16 else self.model
        self.ddp = DistributedDataParallel(
            config, DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, overlap_param_gather=False,
                use_distributed_optimizer=True, average_in_collective=False),
            module=module)
        self.forward_module = self.ddp
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        inner = torch.optim.AdamW(self.params, lr=shape.lr, weight_decay=0.0, fused=True)
        self.megatron_optimizer: Any = DistributedOptimizer(
            inner, OptimizerConfig(optimizer="adam", lr=shape.lr, weight_decay=0.0,
                                   clip_grad=0.0, use_distributed_optimizer=True,
                                   bf16=self.bf16, params_dtype=config.params_dtype),
            None, None, model_chunks=[self.ddp], per_model_buffers={0: self.ddp.buffers},
            data_parallel_group=dp, data_parallel_group_gloo=dp,
            data_parallel_group_idx=ctx.tp_index, distributed_optimizer_instance_id=0)
        self.inner: torch.optim.Optimizer = self.megatron_optimizer.optimizer
        if len(self.inner.param_groups) != 1:
            raise RuntimeError(f"expected one optimizer parameter group, Megatron made "
                               f"{len(self.inner.param_groups)}")
        self.main: list[torch.Tensor] = list(self.inner.param_groups[0]["params"])
        mine = owned_pieces(self.ddp.buffers, ctx.dp, ctx.dp_index)
        if [p.numel for p in mine] != [m.numel() for m in self.main]:
            raise RuntimeError("Megatron's DistributedOptimizer owns other pieces than its "
                               "range map says; the buddy copies would not match")
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.inner, self._lr_factor)
        # Each bucket's part of this rank (gradients and parameters), as Megatron slices them.
        self._grad_parts = [_part(bucket.grad_data, ctx.dp, ctx.dp_index)
                            for buffer in self.ddp.buffers for bucket in buffer.buckets]
        self.buddy_index = (ctx.dp_index - 1) % ctx.dp
        self.buddy = self._buddy() if ctx.dp > 1 and self.copy else None
        log.info("Megatron's DistributedOptimizer on the job's groups", rank=ctx.rank,
                 pieces=len(self.main), part=sum(m.numel() for m in self.main),
                 buddy=None if self.buddy is None else self.buddy_index)

    def _buddy(self) -> _Buddy:
        """A copy of DP rank ``d - 1``'s part: its pieces, at their initial values (every rank
        builds the same full model), gradients as views of one flat buffer per bucket (what
        rank ``d - 1`` sends), and the same optimizer and schedule."""
        ctx = self.ctx
        pieces = owned_pieces(self.ddp.buffers, ctx.dp, self.buddy_index)
        grads = [torch.zeros_like(part) for part in self._grad_parts]
        offsets = [0]
        for buffer in self.ddp.buffers:
            offsets.append(offsets[-1] + len(buffer.buckets))
        values = []
        for piece in pieces:
            # fp32, as Megatron's main copy of a bf16 parameter
            value = torch.nn.Parameter(
                piece.param.detach().view(-1)[piece.start:piece.end].clone().float())
            value.grad = grads[offsets[piece.buffer] + piece.bucket][
                piece.local:piece.local + piece.numel]
            values.append(value)
        optimizer = torch.optim.AdamW(values, lr=self.shape.lr, weight_decay=0.0, fused=True)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, self._lr_factor)
        return _Buddy(values, grads, optimizer, schedule)

    # -- the step -----------------------------------------------------------------------------

    def compute(self, step: int) -> float:
        # The tracker is saved before the buddy check and the all-gather, the first
        # collectives that may be aborted.
        self._begin_step()
        resync = self._start_resync()
        self._gather()
        self.ddp.zero_grad_buffer()
        loss = self._forward_backward(step)
        self._finish_resync(resync)
        return loss

    def _gather(self) -> None:
        """Every rank's part into the parameter buffer (the model's parameters are its
        views)."""
        ctx = self.ctx
        if ctx.dp == 1:
            return
        group: Any = ctx.group("dp")
        for buffer in self.ddp.buffers:
            for bucket in buffer.buckets:
                work = group._allgather_base(bucket.param_data,
                                             _part(bucket.param_data, ctx.dp, ctx.dp_index))
                ctx.wait(work, "the DP parameter all-gather")

    def _sync_gradients(self) -> None:
        """Megatron's hooks added this rank's gradients into the gradient buffer: each bucket
        averaged over DP into this rank's part, which goes on to the rank keeping its copy."""
        ctx = self.ctx
        if ctx.dp == 1:
            return
        group: Any = ctx.group("dp")
        d = ctx.dp_index
        parts = iter(self._grad_parts)
        for buffer in self.ddp.buffers:
            for bucket in buffer.buckets:
                if bucket.gradient_scaling_factor != 1.0:
                    bucket.grad_data.mul_(bucket.gradient_scaling_factor)
                ctx.wait(group._reduce_scatter_base(next(parts), bucket.grad_data),
                         "the DP gradient reduce-scatter")
        if self.buddy is None:
            return
        works = exchange(group, d, [(part, (d + 1) % ctx.dp) for part in self._grad_parts],
                         [(grad, (d - 1) % ctx.dp) for grad in self.buddy.grads], _BUDDY_TAG)
        for work in works:
            ctx.wait(work, "the buddy part's gradient")

    def _start_resync(self) -> list[Any]:
        """A rank that took a lost rank's place gets its predecessor's part (values, moments,
        step counts) while the step computes; :meth:`_finish_resync` waits before apply."""
        ctx, dp = self.ctx, self.ctx.dp
        self._incoming = []
        if dp < 2 or self.buddy is None:
            return []
        group, d = ctx.group("dp"), ctx.dp_index
        next_misses, own_missing = buddy_check(ctx, self.buddy_missing)
        sends: list[tuple[torch.Tensor, int]] = []
        recvs: list[tuple[torch.Tensor, int]] = []
        if next_misses:
            # Read-only until this step's apply, which waits for these sends first.
            sends = [(t, (d + 1) % dp) for v in self.main for t in adam_parts(v, self.inner)]
        if own_missing:
            self._incoming = [t for v in self.buddy.values for t in empty_adam_parts(v)]
            recvs = [(t, (d - 1) % dp) for t in self._incoming]
        return exchange(group, d, sends, recvs, _RESYNC_TAG)

    def _finish_resync(self, works: list[Any]) -> None:
        for work in works:
            self.ctx.wait(work, "the predecessor's part")
        if self._incoming:
            assert self.buddy is not None
            for n, value in enumerate(self.buddy.values):
                install_adam_parts(self.buddy.optimizer, value, self._incoming[4 * n:4 * n + 4])
            self._incoming = []
            self.buddy_missing = False

    def apply(self, step: int) -> None:
        from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer

        with torch.no_grad():
            # The main pieces' gradients: views of this rank's reduced parts.
            self.megatron_optimizer.prepare_grads()
            # The inner step and main -> model parameters, without DistributedOptimizer's
            # all-gather: the next compute gathers, abortably.
            MixedPrecisionOptimizer.step_with_ready_grads(self.megatron_optimizer)
        if self.buddy is not None:
            self.buddy.optimizer.step()
            self.buddy.schedule.step()
        self.schedule.step()
        self._commit(step)

    def apply_inputs(self, step: int) -> dict[str, Any]:
        return {"grads": list(self._grad_parts),
                "buddy_grads": [] if self.buddy is None else list(self.buddy.grads),
                "loss": self._loss, "tracker": _clone(self.tracker.get_states())}

    def load_apply_inputs(self, step: int, inputs: dict[str, Any]) -> None:
        mine = list(self._grad_parts) + ([] if self.buddy is None else list(self.buddy.grads))
        got = list(inputs["grads"]) + list(inputs["buddy_grads"])
        if len(got) != len(mine) or any(g.shape != m.shape for g, m in zip(got, mine,
                                                                           strict=True)):
            raise ValueError(f"step {step}'s gradient parts do not fit this rank's parts")
        for m, g in zip(mine, got, strict=True):
            m.copy_(g)
        self.tracker.set_states(_clone(inputs["tracker"]))
        self._loss = inputs["loss"]

    # -- state --------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        buddy = None if self.buddy is None else (self.buddy.values, self.buddy.optimizer)
        return self._state((self.main, self.inner), buddy, self.buddy_missing)

    def replica_state(self, rank: int) -> dict[str, Any]:
        check_keeps_copy(self.ctx, rank, self.buddy_index, kept=self.buddy is not None,
                         what="part")
        assert self.buddy is not None
        # Its own copy of its predecessor's part is left out: the replacement gets it from the
        # predecessor while its first step computes.
        return self._state((self.buddy.values, self.buddy.optimizer), None, True)

    def _state(self, own: tuple[Sequence[torch.Tensor], torch.optim.Optimizer],
               buddy: tuple[Sequence[torch.Tensor], torch.optim.Optimizer] | None,
               buddy_missing: bool) -> dict[str, Any]:
        return {"part": [v.detach() for v in own[0]], "optimizer": own[1].state_dict(),
                "buddy": None if buddy is None else {
                    "part": [v.detach() for v in buddy[0]],
                    "optimizer": buddy[1].state_dict()},
                "buddy_missing": buddy_missing, "schedule": self.schedule.state_dict(),
                "tracker": _clone(self.tracker.get_states()),
                "data": {"position": self.committed}, "step": self.committed}

    def load_state(self, state: dict[str, Any]) -> None:
        if self.model is None:
            self._materialize([self.ctx.group(name) for name in ("tp", "dp", "world")])
        _copy_into(self.main, state["part"], "this rank's part")
        self.inner.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        self.tracker.set_states(_clone(state["tracker"]))
        self.buddy_missing = bool(state["buddy_missing"])
        if self.buddy is not None:
            buddy = state["buddy"]
            if buddy is not None:
                _copy_into(self.buddy.values, buddy["part"], "the buddy part")
                self.buddy.optimizer.load_state_dict(buddy["optimizer"])
            else:
                # No copy yet (it comes from the previous rank at the next step); the buddy's
                # optimizer still takes the schedule's learning rate.
                empty = self.buddy.optimizer.state_dict()
                empty["state"] = {}
                empty["param_groups"] = [
                    {**saved, "params": own["params"]} for saved, own in
                    zip(state["optimizer"]["param_groups"], empty["param_groups"], strict=True)]
                self.buddy.optimizer.load_state_dict(empty)
            self.buddy.schedule.load_state_dict(state["schedule"])
        with torch.no_grad():
            # The model's own range of the parameter buffer; the next compute gathers the rest.
            self.megatron_optimizer._copy_main_params_to_model_params()
        self.committed = int(state["step"])


@dataclasses.dataclass
class _Buddy:
    values: list[torch.nn.Parameter]
    grads: list[torch.Tensor]  # one flat tensor per bucket: what rank d - 1 sends
    optimizer: torch.optim.Optimizer
    schedule: Any


def _part(buffer: torch.Tensor, dp: int, dp_rank: int) -> torch.Tensor:
    """Rank ``dp_rank``'s part of a bucket's flat buffer, as Megatron slices it."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    part: torch.Tensor = shard_buffer(buffer, dp)[dp_rank]
    return part


def _copy_into(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], what: str) -> None:
    if len(dst) != len(src) or any(d.shape != s.shape for d, s in zip(dst, src, strict=True)):
        raise ValueError(f"{what} in the state ({len(src)} pieces) does not fit this rank's "
                         f"({len(dst)} pieces)")
    with torch.no_grad():
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)


__all__ = ["CUDA_ONLY", "Piece", "ShardedMegatronJob", "exchange", "owned_pieces"]
