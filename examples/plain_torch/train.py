"""A plain-PyTorch job on the understudy worker API: a tensor-, data- and pipeline-parallel
MLP with Adam.

The model is a linear embedding, residual MLP blocks ``h + W2 dropout(gelu(W1 h + b1)) + b2``
and a linear head with a squared-error loss. Each block is split Megatron-style over the TP
group: ``W1`` by rows (column-parallel), ``W2`` by columns (row-parallel), the partial outputs
summed by an all-reduce over the TP group (and the input gradients summed coming back). With
``pp`` stages the first holds the embedding, the last the head and the loss, and each an equal
share of the blocks; a step runs its micro-batches through the stages with the runtime's own
schedule (:mod:`understudy.worker.pipeline`). Gradients are averaged over the DP group. The
data is a synthetic regression whose batches derive from ``(seed, step, dp_index)``, so the data
position is the step itself; the learning rate warms up linearly, then decays along a cosine.

Every run with the same arguments is bitwise identical, and so is a run whose ranks hand their
state to fresh processes midway (``--save`` then ``--load``).

Four ranks, TP=2 x DP=2, bootstrapped through a file store (add ``--pp 2`` and eight ranks for
two stages)::

    for r in 0 1 2 3; do
        python examples/plain_torch/train.py --rank $r --world-size 4 --tp 2 \\
            --store /tmp/plain-store --steps 50 &
    done; wait

The model's size is the command line's: ``--features`` and ``--hidden`` (default 16 and 64: 27 KB
of state per rank at TP 2), or ``--state-size 64MiB`` (also ``27KB``, ``1GiB``...), which picks the
hidden width at which a rank holds that much parameters and Adam state.

``--slots N`` trains N data-parallel slots on however many replicas the layout has
(:class:`~understudy.worker.api.SlottedJob`): each slot's batch derives from ``(seed, step,
slot)`` and the runtime sums the slots' gradients in slot order, so ``--slots 4`` on DP 4, 2 or 1
gives the same state bit for bit (not the same as without ``--slots``, whose DP all-reduce adds in
gloo's ring order).

``--fail-at`` and ``--freeze-at`` inject faults for tests (a transient compute error, a frozen
process); production code knows nothing of them. ``--step-log DIR`` appends a line per committed
step (step, wall time, rank, pid, loss) to ``DIR/rank<r>-<pid>.jsonl``: the benchmarks compute
downtime from it (``benchmarks/downtime.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
import warnings
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.optim.adam import adam

from understudy.common import logs
from understudy.common.sizes import size_arg
from understudy.worker import rng
from understudy.worker.api import JobContext, SlottedJob, TrainingJob, allreduce_options
from understudy.worker.copies import (
    adam_parts,
    buddy_check,
    check_keeps_copy,
    empty_adam_parts,
    install_adam_parts,
)
from understudy.worker.errors import record
from understudy.worker.pipeline import run_schedule
from understudy.worker.runtime import Runtime, StaticGroups
from understudy.worker.slots import chunk, gather_slots, held, redistribute


class FunctionalAdam:
    """``torch.optim.Adam`` with a ``LambdaLR`` schedule, through Adam's functional form
    (``torch.optim.adam.adam``, the single-tensor update the class runs on CPU): the same
    arithmetic, bit for bit, without the optimizer class, whose first use imports
    ``torch._dynamo`` (``Optimizer.add_param_group``: 1.1-1.35 CPU-s per process here). The
    tests run the example with it (``--adam functional``); a user's job would use the class.
    Its ``schedule`` is the LambdaLR's counterpart: ``step()`` and its own state."""

    class Schedule:
        def __init__(self) -> None:
            self.last_epoch = 0

        def step(self) -> None:
            self.last_epoch += 1

        def state_dict(self) -> dict[str, Any]:
            return {"last_epoch": self.last_epoch}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.last_epoch = int(state["last_epoch"])

    def __init__(self, params: Any, lr: float, factor: Any) -> None:
        self.params = list(params)
        self.lr, self.factor = lr, factor
        self.schedule = FunctionalAdam.Schedule()
        # As the class's lazy state at its first step: a float32 step count, zeroed moments.
        self.steps = [torch.tensor(0.0) for _ in self.params]
        self.exp_avg = [torch.zeros_like(p, memory_format=torch.preserve_format)
                        for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p, memory_format=torch.preserve_format)
                           for p in self.params]

    def zero_grad(self, set_to_none: bool = False) -> None:
        for p in self.params:
            if p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        grads = [p.grad for p in self.params]
        assert all(g is not None for g in grads), "every parameter has a gradient"
        adam(self.params, grads, self.exp_avg, self.exp_avg_sq, [], self.steps,  # type: ignore[arg-type]
             foreach=False, capturable=False, differentiable=False, fused=None,
             grad_scale=None, found_inf=None, has_complex=False, amsgrad=False, beta1=0.9,
             beta2=0.999, lr=self.lr * self.factor(self.schedule.last_epoch),
             weight_decay=0.0, eps=1e-8, maximize=False)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.steps, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for mine, theirs in ((self.steps, state["step"]), (self.exp_avg, state["exp_avg"]),
                             (self.exp_avg_sq, state["exp_avg_sq"])):
            if len(mine) != len(theirs):
                raise ValueError(f"the optimizer state holds {len(theirs)} tensors for "
                                 f"{len(mine)} parameters")
            for a, b in zip(mine, theirs, strict=True):
                a.copy_(b)


class _SumOverTP(torch.autograd.Function):
    """Sum partial outputs over the TP group; the gradient passes through unchanged (each TP
    rank's partial contributed to the sum with weight one)."""

    @staticmethod
    def forward(fctx: Any, partial: torch.Tensor, ctx: JobContext) -> torch.Tensor:
        total = partial.clone()
        work = ctx.group("tp").allreduce([total], allreduce_options(dist.ReduceOp.SUM))
        ctx.wait(work, "the TP all-reduce")
        return total

    @staticmethod
    def backward(fctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _CopyToTP(torch.autograd.Function):
    """The input of a column-parallel layer: the same on every TP rank going forward; coming
    back, each rank holds the gradient of its own columns only, so they are summed."""

    @staticmethod
    def forward(fctx: Any, replicated: torch.Tensor, ctx: JobContext) -> torch.Tensor:
        fctx.job_ctx = ctx
        return replicated.view_as(replicated)

    @staticmethod
    def backward(fctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx: JobContext = fctx.job_ctx
        total = grad.clone()
        work = ctx.group("tp").allreduce([total], allreduce_options(dist.ReduceOp.SUM))
        ctx.wait(work, "the TP all-reduce of an input gradient")
        return total, None


class PlainJob(TrainingJob):
    """The model: ``embed`` (a linear layer, first stage), ``layers`` residual MLP blocks
    (``h + W2 dropout(gelu(W1 h + b1)) + b2``, split over the TP group), ``head`` (a linear
    layer and the loss, last stage). With ``pp`` stages each holds ``layers / pp`` blocks and
    the step runs ``microbatches`` micro-batches through
    :func:`~understudy.worker.pipeline.run_schedule`. Every parameter is drawn from the job's
    seed in one order whatever the layout, so every layout trains the same model."""

    def __init__(self, *, features: int = 16, hidden: int = 64, batch: int = 32,
                 state_bytes: int | None = None,
                 layers: int | None = None, microbatches: int | None = None,
                 lr: float = 1e-2, warmup: int = 5, total_steps: int = 1000,
                 dropout: float = 0.1, fail_at: int | None = None,
                 freeze_at: int | None = None, marker_dir: Path | None = None,
                 step_sleep: float = 0.0, step_log: Path | None = None,
                 step_sleep_off: Path | None = None, adam: str = "class",
                 rng_by_layer: bool = False, hold: tuple[int, Path] | None = None,
                 interruptible: bool = False) -> None:
        self.features, self.hidden, self.batch = features, hidden, batch
        #: compute may stop at its next autograd operation once the job recovers (worker/
        #: interrupt.py; --interruptible): nothing it consumes outlives a discard, the batch
        #: follows from the step
        self.interruptible = interruptible
        #: draw each block's dropout mask from (seed, TP index, slot or DP index, step, layer,
        #: micro-batch) rather than the rank's stream: the masks then do not depend on which
        #: stage runs a block, which a job whose stages change needs (``restage``)
        self.rng_by_layer = rng_by_layer
        self._draw = (0, 0)  # the step and the slot (or DP index) being computed
        #: "class": torch.optim.Adam and LambdaLR; "functional": FunctionalAdam (same bits)
        self.adam = adam
        #: torch's functional Adam never imports torch._dynamo: a standby has nothing to preload
        self.preload = () if adam == "functional" else TrainingJob.preload
        #: the state a rank should hold, in bytes (None: ``hidden`` as given); the hidden width
        #: that gives it is worked out in ``build``, once the layout is known
        self.state_bytes = state_bytes
        # Defaults, once the layout is known: a block per stage, a micro-batch per stage.
        self._layers, self._microbatches = layers, microbatches
        self.layers = self.microbatches = 1
        self.lr, self.warmup, self.total_steps, self.dropout = lr, warmup, total_steps, dropout
        self.fail_at, self.freeze_at, self.marker_dir = fail_at, freeze_at, marker_dir
        self._failed = False
        self.step_sleep, self.step_sleep_off = step_sleep, step_sleep_off
        #: (step, file): no step from that one on starts before the file exists (--hold-until)
        self.hold = hold
        self.step_log = StepLog(step_log) if step_log is not None else None
        self._loss: float | None = None  # the last compute's, for the step log
        self._replaying = False  # the next apply replays a leaver's step (load_apply_inputs)
        #: what each loss is divided by beyond the micro-batches (a slotted job's slot count)
        self.loss_parts = 1
        #: what the last build or retarget allocated, in words (the sandbox tests read it)
        self.allocated: list[str] = []

    def _full_model(self, seed: int) -> dict[str, torch.Tensor]:
        """Every parameter of the whole model, unsplit, drawn in one order from ``seed``."""
        init = torch.Generator().manual_seed(seed)
        f, h = self.features, self.hidden
        full = {"embed_w": torch.randn(f, f, generator=init) / math.sqrt(f),
                "embed_b": torch.zeros(f)}
        for layer in range(self.layers):
            full[f"block{layer}_w1"] = torch.randn(h, f, generator=init) / math.sqrt(f)
            full[f"block{layer}_b1"] = torch.zeros(h)
            full[f"block{layer}_w2"] = torch.randn(f, h, generator=init) / math.sqrt(h)
            full[f"block{layer}_b2"] = torch.zeros(f)
        full["head_w"] = torch.randn(f, f, generator=init) / math.sqrt(f)
        full["head_b"] = torch.zeros(f)
        return full

    def _stage_blocks(self, ctx: JobContext) -> range:
        per = self.layers // ctx.pp
        return range(ctx.pp_index * per, (ctx.pp_index + 1) * per)

    def _own(self, ctx: JobContext, name: str, value: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full parameter ``name`` (TP: W1 and b1 by rows, W2 by
        columns; everything else replicated)."""
        part = slice(ctx.tp_index * self.hidden // ctx.tp,
                     (ctx.tp_index + 1) * self.hidden // ctx.tp)
        if name.endswith(("_w1", "_b1")):
            return value[part].clone()
        if name.endswith("_w2"):
            return value[:, part].clone()
        return value.clone()

    def _names(self, ctx: JobContext) -> list[str]:
        names = ["embed_w", "embed_b"] if ctx.first_stage else []
        for layer in self._stage_blocks(ctx):
            names += [f"block{layer}_{p}" for p in ("w1", "b1", "w2", "b2")]
        return names + (["head_w", "head_b"] if ctx.last_stage else [])

    def build(self, ctx: JobContext) -> None:
        self.layers = self._layers or ctx.pp
        self.microbatches = self._microbatches or ctx.pp
        if self.state_bytes is not None:
            self.hidden = hidden_for(self.state_bytes, features=self.features,
                                     layers=self.layers, tp=ctx.tp, pp=ctx.pp)
        if self.hidden % ctx.tp:
            raise ValueError(f"hidden={self.hidden} does not split over tp={ctx.tp}")
        if self.layers % ctx.pp:
            raise ValueError(f"layers={self.layers} do not split over pp={ctx.pp} stages")
        if self.batch % self.microbatches:
            raise ValueError(f"batch={self.batch} does not split into {self.microbatches} "
                             "micro-batches")
        self.ctx = ctx
        # Full matrices from the job's seed, then this rank's slice: the model is the same
        # whatever the layout.
        full = self._full_model(ctx.seed)
        self.params = torch.nn.ParameterDict({
            name: torch.nn.Parameter(self._own(ctx, name, full[name]))
            for name in self._names(ctx)})
        self.allocated = list(self.params)
        self._optimizer()
        self.committed = 0
        self._seed_rank()

    def _seed_rank(self) -> None:
        # Dropout draws from the global generator, which the runtime saves and restores; each
        # rank has its own stream, as each holds different activations.
        rng.seed_all(self.ctx.seed * 1_000_003 + self.ctx.rank)

    def _optimizer(self) -> None:
        if self.adam == "functional":
            self.optimizer = FunctionalAdam(self.params.parameters(), self.lr, self._lr_factor)
            self.schedule = self.optimizer.schedule
            return
        self.optimizer = torch.optim.Adam(self.params.parameters(), lr=self.lr)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)

    def retarget(self, ctx: JobContext) -> str | None:
        # Another rank with the same TP split: the blocks built are the right shape whatever
        # their stage, so they are kept (renamed); only the embedding (first stage) or the head
        # (last stage) is allocated when the new stage has it and the old one did not. The
        # values do not matter: the rank's state is loaded next.
        if (ctx.tp, ctx.pp, ctx.tp_index) != (self.ctx.tp, self.ctx.pp, self.ctx.tp_index):
            return None
        old_names, new_names = self._names(self.ctx), self._names(ctx)
        moved = dict(zip(self._stage_blocks(ctx), self._stage_blocks(self.ctx), strict=True))
        self.allocated = []
        params: dict[str, torch.nn.Parameter] = {}
        for name in new_names:
            if name.startswith("block"):  # block<new>_<p> takes block<old>_<p>
                layer, _, part = name.removeprefix("block").partition("_")
                params[name] = self.params[f"block{moved[int(layer)]}_{part}"]
            elif name in self.params:
                params[name] = self.params[name]
            else:
                shape = (self.features,) if name.endswith("_b") else (self.features,) * 2
                params[name] = torch.nn.Parameter(torch.zeros(shape))
                self.allocated.append(name)
        dropped = [n for n in old_names if not n.startswith("block") and n not in params]
        self.params = torch.nn.ParameterDict(params)
        self.ctx = ctx
        self._optimizer()
        self._seed_rank()
        return (f"kept {len(moved)} blocks, allocated {', '.join(self.allocated) or 'nothing'}, "
                f"dropped {', '.join(dropped) or 'nothing'}")

    def reseed(self, step: int) -> None:
        # This rank's dropout stream follows from (seed, rank, step): a rank rebuilt from a
        # data-parallel replica's state draws the masks the lost rank would have.
        rng.seed_all((self.ctx.seed * 1_000_003 + self.ctx.rank) * 1_000_033 + step)

    def _lr_factor(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.total_steps - self.warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    def _batch(self, step: int, index: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch of ``step`` for data-parallel position ``index`` (default: this rank's
        replica; a slotted job's: the slot)."""
        index = self.ctx.dp_index if index is None else index
        g = torch.Generator().manual_seed((self.ctx.seed * 1_000_003 + step) * 1_009 + index)
        x = torch.randn(self.batch, self.features, generator=g)
        return x, torch.sin(x) + 0.1 * torch.randn(x.shape, generator=g)

    def _block(self, layer: int, h: torch.Tensor, mb: int) -> torch.Tensor:
        p, ctx = self.params, self.ctx
        if self.rng_by_layer:
            step, index = self._draw
            key = (self.ctx.seed * 1_000_003 + ctx.tp_index) * 1_000_033 + index
            torch.manual_seed((((key * 1_000_037 + step) * 1_000_039 + layer) * 1_009 + mb)
                              % 2**63)
        x = _CopyToTP.apply(h, ctx) if h.requires_grad else h
        inner = F.dropout(F.gelu(x @ p[f"block{layer}_w1"].T + p[f"block{layer}_b1"]),
                          self.dropout, training=True)
        return h + _SumOverTP.apply(inner @ p[f"block{layer}_w2"].T, ctx) + p[f"block{layer}_b2"]

    def _stage(self, x: torch.Tensor, y: torch.Tensor, mb: int,
               received: torch.Tensor | None) -> torch.Tensor:
        ctx, p = self.ctx, self.params
        rows = slice(mb * self.batch // self.microbatches,
                     (mb + 1) * self.batch // self.microbatches)
        h = x[rows] @ p["embed_w"].T + p["embed_b"] if ctx.first_stage else received
        assert h is not None
        for layer in self._stage_blocks(ctx):
            h = self._block(layer, h, mb)
        if not ctx.last_stage:
            return h
        loss = F.mse_loss(h @ p["head_w"].T + p["head_b"], y[rows]) / self.microbatches
        return loss / self.loss_parts if self.loss_parts > 1 else loss

    def _sleep(self, step: int) -> None:
        """The step's stand-in work (``--step-sleep``), until ``--step-sleep-off`` exists; from
        step ``--hold-at`` on, first a wait for ``--hold-until``."""
        if self.hold is not None and step >= self.hold[0]:
            while not self.hold[1].exists():
                time.sleep(0.02)
            self.hold = None  # it stays: no need to look again
        if self.step_sleep and not (self.step_sleep_off and self.step_sleep_off.exists()):
            time.sleep(self.step_sleep)

    def _forward_backward(self, step: int, index: int | None = None) -> list[Any]:
        """Zero the gradients, then forward and backward of the batch of ``step`` for position
        ``index`` (:meth:`_batch`) through the stages; the micro-batches' losses (last stage)."""
        x, y = self._batch(step, index)
        self._draw = (step, self.ctx.dp_index if index is None else index)
        self._zero_grad()
        return run_schedule(self.ctx, microbatches=self.microbatches,
                            stage=lambda mb, h: self._stage(x, y, mb, h),
                            activation=(self.batch // self.microbatches, self.features))

    def compute(self, step: int) -> float | None:
        ctx = self.ctx
        self._sleep(step)
        losses = self._forward_backward(step)
        self._sync_gradients(self._flat_gradients())
        # Faults are injected after the step's collectives, so that no peer waits on us.
        if step == self.fail_at and not self._failed:
            self._failed = True
            raise RuntimeError(f"injected fault at step {step}")
        if step == self.freeze_at:
            if self.marker_dir is not None:
                (self.marker_dir / f"frozen-rank{ctx.rank}").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)
        loss = sum(losses) if ctx.last_stage else None
        if self.step_log is not None:
            self._loss = None if loss is None else float(loss)
        return loss

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=False)

    def _flat_gradients(self) -> torch.Tensor:
        """The step's gradients, all of them in one flat tensor (``_sync_gradients``'s)."""
        grads = [q.grad for q in self.params.values()]
        assert all(g is not None for g in grads), "every parameter takes part in the loss"
        return torch.cat([g.flatten() for g in grads if g is not None])

    def _sync_gradients(self, flat: torch.Tensor) -> None:
        """Average the gradients (``flat``: all of them, concatenated) over the DP group."""
        ctx = self.ctx
        work = ctx.group("dp").allreduce([flat], allreduce_options(dist.ReduceOp.SUM))
        ctx.wait(work, "the DP gradient all-reduce")
        flat /= ctx.dp
        offset = 0
        for q in self.params.values():
            g = q.grad
            assert g is not None
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def apply(self, step: int) -> None:
        self.optimizer.step()
        self.schedule.step()
        self.committed = step + 1
        replayed, self._replaying = self._replaying, False
        if self.step_log is not None and not replayed:  # the leaver logged a replayed step
            self.step_log.committed(self.ctx.rank, step, self._loss)

    def handed_off(self, step: int) -> None:
        # The joiner applies this step with the rank; this process leaves: the line only.
        self.committed = step + 1
        if self.step_log is not None:
            self.step_log.committed(self.ctx.rank, step, self._loss)

    def apply_inputs(self, step: int) -> dict[str, Any]:
        # What apply reads from compute: the averaged gradients (the schedule follows from
        # the step count, which apply keeps).
        return {"grads": [q.grad for q in self.params.values()]}

    def load_apply_inputs(self, step: int, inputs: dict[str, Any]) -> None:
        params = list(self.params.values())
        grads = inputs["grads"]
        if len(grads) != len(params) or any(g.shape != q.shape or g.dtype != q.dtype
                                            for g, q in zip(grads, params, strict=True)):
            raise ValueError(f"step {step}'s gradients do not fit this rank's parameters")
        for q, g in zip(params, grads, strict=True):
            q.grad = g  # the joiner's own now: the next step's land in place in them
        self._replaying = True

    @torch.no_grad()
    def _apply_as_landed(self, step: int, inputs: dict[str, Any], landing: Any) -> None:
        # apply_landing, with --hand-off landing (landing_hand_off). Adam is element-wise:
        # each parameter is updated a landed range at a time, with the arithmetic of the whole
        # update (the single-tensor kernel on CPU), and its step count goes up once; the
        # schedule steps once all are through. Bit for bit what load_apply_inputs and apply
        # do, while the rest of the gradients cross.
        params = list(self.params.values())
        moments = self._adam_moments(params)
        if moments is None:  # the class's lazy state is not there yet: the whole update
            for g in inputs["grads"]:
                landing.wait(g)
            self.load_apply_inputs(step, inputs)
            self.apply(step)
            return
        grads = inputs["grads"]
        if len(grads) != len(params) or any(g.shape != q.shape or g.dtype != q.dtype
                                            for g, q in zip(grads, params, strict=True)):
            raise ValueError(f"step {step}'s gradients do not fit this rank's parameters")
        lr = (self.optimizer.lr * self.optimizer.factor(self.schedule.last_epoch)
              if isinstance(self.optimizer, FunctionalAdam)
              else self.optimizer.param_groups[0]["lr"])
        for q, g, (exp_avg, exp_avg_sq, count) in zip(params, grads, moments, strict=True):
            flat = (q.view(-1), g.view(-1), exp_avg.view(-1), exp_avg_sq.view(-1))
            for lo, hi in landing.pieces(g):
                p_, g_, m_, v_ = (t[lo:hi] for t in flat)
                adam([p_], [g_], [m_], [v_], [], [count.clone()], foreach=False,
                     capturable=False, differentiable=False, fused=None, grad_scale=None,
                     found_inf=None, has_complex=False, amsgrad=False, beta1=0.9,
                     beta2=0.999, lr=lr, weight_decay=0.0, eps=1e-8, maximize=False)
            count += 1
            q.grad = g  # the joiner's own now, as load_apply_inputs leaves it
        self.schedule.step()
        self.committed = step + 1

    def _adam_moments(self, params: list[torch.Tensor]
                      ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None:
        """Each parameter's Adam moments and step count, whichever Adam the job runs; None
        before torch.optim.Adam's first step made them. The class's hyperparameters must be
        the ones apply_landing uses (its defaults, as _optimizer makes it)."""
        if isinstance(self.optimizer, FunctionalAdam):
            return list(zip(self.optimizer.exp_avg, self.optimizer.exp_avg_sq,
                            self.optimizer.steps, strict=True))
        state = self.optimizer.state
        if any("exp_avg" not in state[q] for q in params):
            return None
        return [(state[q]["exp_avg"], state[q]["exp_avg_sq"], state[q]["step"]) for q in params]

    def discard(self, step: int) -> None:
        self.optimizer.zero_grad(set_to_none=False)

    def forget_shadow_steps(self) -> None:
        # A standby's shadow iterations are no commits of the run: their lines would read as
        # commits of the rank it warmed as.
        if self.step_log is not None:
            self.step_log.forget()

    def state(self) -> dict[str, Any]:
        return {"params": self.params.state_dict(), "optimizer": self.optimizer.state_dict(),
                "schedule": self.schedule.state_dict(),
                "data": {"position": self.committed}, "step": self.committed}

    def load_state(self, state: dict[str, Any]) -> None:
        self.params.load_state_dict(state["params"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        self.committed = int(state["step"])


class StepLog:
    """One JSON line per committed step, ``{"step", "t", "rank", "pid", "loss"}`` (``t``: wall
    time just after the optimizer step), appended to ``<dir>/rank<r>-<pid>.jsonl`` and flushed at
    once, so that a process killed mid-run leaves every step it committed. A file per process: a
    standby that takes over a rank, or a restarted process, starts a file of its own."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._files: dict[int, Any] = {}

    def committed(self, rank: int, step: int, loss: float | None) -> None:
        f = self._files.get(rank)
        if f is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            f = self._files[rank] = open(  # noqa: SIM115 (open for the process's life)
                self.directory / f"rank{rank}-{os.getpid()}.jsonl", "a", buffering=1)
        f.write(json.dumps({"step": step, "t": time.time(), "rank": rank, "pid": os.getpid(),
                            "loss": loss}) + "\n")

    def forget(self) -> None:
        """Remove what this process has logged so far (shadow iterations)."""
        for f in self._files.values():
            f.close()
            Path(f.name).unlink(missing_ok=True)
        self._files.clear()


#: bytes of state per parameter: the fp32 value and Adam's two moments
STATE_PER_PARAM = 3 * 4


def hidden_for(state_bytes: int, *, features: int, layers: int, tp: int, pp: int) -> int:
    """The hidden width at which a rank of the largest stage holds about ``state_bytes`` of
    parameters and Adam state (the embedding and the head count on the stages that have them;
    a block's ``W1``, ``b1`` and ``W2`` are split over TP, ``b2`` is not). At least ``tp``,
    and a multiple of it."""
    f = features
    fixed = 2 * (f * f + f) if pp == 1 else f * f + f  # embedding and head, or one of them
    per_block_fixed, per_block_slice = f, 2 * f + 1  # b2; W1 row + b1 + W2 column per unit
    blocks = layers // pp
    units = (state_bytes // STATE_PER_PARAM - fixed - blocks * per_block_fixed) // \
        (blocks * per_block_slice)
    return max(1, units) * tp


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, default=int(os.environ.get("RANK", "0")))
    p.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (standalone runs; under "
                   "`understudy run` the job's --pp)")
    p.add_argument("--layers", type=int, help="MLP blocks, split over the stages (default: "
                   "one per stage)")
    p.add_argument("--microbatches", type=int, help="micro-batches per step (default: one per "
                   "stage)")
    p.add_argument("--features", type=int, default=16, help="width of the embedding, the head "
                   "and the blocks' inputs and outputs (default 16)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--hidden", type=int, default=64, help="width inside a block, split over "
                      "TP (default 64: 20 KB of tensors per rank at TP 2)")
    size.add_argument("--state-size", type=size_arg, metavar="SIZE",
                      help="the state a rank holds instead (parameters and Adam's moments): "
                      "27KB, 64MiB, 1GiB...; sets --hidden to match")
    p.add_argument("--store", help="file shared by all ranks to bootstrap groups (standalone "
                   "runs; under `understudy run` the daemons bootstrap the groups)")
    p.add_argument("--job", default="plain-torch")
    p.add_argument("--steps", type=int, required=True, help="stop once this many are committed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--collective-timeout", type=float, default=60.0)
    p.add_argument("--group-timeout", type=float, default=300.0,
                   help="gloo's own timeout; keep it above --collective-timeout")
    p.add_argument("--load", type=Path, help="start from a state saved with --save")
    p.add_argument("--save", type=Path, help="directory for the final state and timings")
    p.add_argument("--snapshot-at", type=int,
                   help="also save the state once this many steps are committed, under "
                        "SAVE/snapshot")
    p.add_argument("--step-sleep", type=float, default=0.0,
                   help="seconds of extra work per step (to stand in for a bigger model); with "
                   "--slots, per slot a replica holds")
    p.add_argument("--step-sleep-off", type=Path, help="no more step sleep once this file "
                   "exists (a test lets the job run out at full speed once its faults are "
                   "over; the sleep never changes the state)")
    p.add_argument("--hold-until", type=Path, metavar="FILE",
                   help="from step --hold-at on, start no step before FILE exists (a benchmark "
                   "holds the job until its standbys are warm: under load they may take longer "
                   "than the job's steps; holding never changes the state)")
    p.add_argument("--hold-at", type=int, default=2,
                   help="the first step --hold-until holds (default 2: after the iterations "
                   "the standbys' sandbox records)")
    p.add_argument("--interruptible", action=argparse.BooleanOptionalAction, default=True,
                   help="once the job recovers, compute stops at its next autograd operation "
                   "rather than running on to its next collective (TrainingJob.interruptible; "
                   "default: on)")
    p.add_argument("--step-log", type=Path, help="directory for a line per committed step "
                   "(StepLog), for the benchmarks")
    p.add_argument("--hand-off", choices=("ahead", "landing", "whole"), default="ahead",
                   help="in a planned migration, send the state ahead and then each step's "
                   "gradients (default); as ahead, with the joiner applying each step as its "
                   "gradients land (apply_landing: for a GPU, where the apply does not take "
                   "the transfer's CPU); or the whole state at the switch, as a job that "
                   "does not implement apply_inputs does")
    p.add_argument("--shard-optimizer", action="store_true",
                   help="shard the optimizer state over DP (ZeRO-1) with a redundant copy of "
                   "each shard on the next DP rank (ShardedJob)")
    p.add_argument("--no-shard-copy", action="store_true",
                   help="with --shard-optimizer: no redundant copies (plain ZeRO-1, the "
                   "baseline of their cost)")
    p.add_argument("--adam", choices=("class", "functional"), default="class",
                   help="torch.optim.Adam with LambdaLR (default), or the same update through "
                   "torch.optim.adam.adam (FunctionalAdam: the same bits, without importing "
                   "torch._dynamo; the tests use it)")
    p.add_argument("--slots", type=int, help="train this many data-parallel slots on the "
                   "layout's replicas, each replica computing its share (SlottedPlainJob): "
                   "the same result bit for bit whatever the DP size (default: no slots, "
                   "the job's own DP all-reduce)")
    p.add_argument("--rng-by-layer", action="store_true",
                   help="draw each block's dropout mask from its layer, the step and the slot "
                   "(or DP index), not from the rank's stream: the run is then the same on any "
                   "number of pipeline stages, which a job whose stages change needs")
    p.add_argument("--fail-at", type=int, help="fault: fail this step's compute once")
    p.add_argument("--freeze-at", type=int, help="fault: SIGSTOP this rank in this step")
    args = p.parse_args(argv)
    if args.no_shard_copy and not args.shard_optimizer:
        p.error("--no-shard-copy goes with --shard-optimizer")
    if args.hand_off == "landing" and args.shard_optimizer:
        p.error("--hand-off landing applies Adam over whole parameters: not with "
                "--shard-optimizer")
    if args.adam == "functional" and args.shard_optimizer and not args.slots:
        p.error("--adam functional does not go with --shard-optimizer (ShardedJob steps its "
                "shards with torch.optim.Adam)")
    if args.hold_at < 0:
        p.error(f"--hold-at must be a step, 0 or more, got {args.hold_at}")
    if args.slots is not None:
        if args.slots < 1:
            p.error(f"--slots must be at least 1, got {args.slots}")
        if args.fail_at is not None or args.freeze_at is not None:
            p.error("--fail-at and --freeze-at are not available with --slots (the faults sit "
                    "after the job's own DP all-reduce, which a slotted job does not have)")
    return args


def _bind_to_buffers(params: list[torch.nn.Parameter], values: torch.Tensor | None,
                     grads: torch.Tensor) -> list[torch.Tensor]:
    """Make ``params`` views of the flat ``values`` (their values copied in, in order; None:
    leave them) and their gradients views of the flat ``grads``; returns those gradient views,
    which :func:`_check_grad_views` compares against."""
    offset = 0
    with torch.no_grad():
        for q in params:
            n = q.numel()
            if values is not None:
                values[offset:offset + n].copy_(q.detach().flatten())
                q.data = values[offset:offset + n].view_as(q)
            q.grad = grads[offset:offset + n].view_as(q)
            offset += n
    return [q.grad for q in params]  # type: ignore[misc]


def _check_grad_views(params: Iterable[torch.nn.Parameter], views: list[torch.Tensor]) -> None:
    """Raise unless every gradient of ``params`` is still the view :func:`_bind_to_buffers` made:
    one set to None or replaced would leave the buffer's stale values to be synced."""
    if any(q.grad is not view for q, view in zip(params, views, strict=True)):
        raise RuntimeError("a gradient of the model is no longer a view of the job's "
                           "gradient buffer (was it set to None or replaced?)")


class ShardedJob(PlainJob):
    """The same model with its optimizer state sharded over the DP group (ZeRO-1), and a
    redundant copy of every shard on another rank, current at every committed step.

    The parameters, concatenated and padded to ``dp`` equal shards, are owned shard by shard:
    DP rank ``d`` holds shard ``d``'s fp32 values and Adam state, the only copy of them. A step:

    - ``compute``: all-gather the shards into the model's parameters (derived, not state),
      forward and backward, reduce-scatter the gradients (each rank gets its shard's average),
      then pass that shard gradient to the next DP rank, ``d + 1`` (mod ``dp``), and take the
      previous rank's;
    - ``apply``: Adam on the own shard, and on the *buddy* shard ``d - 1`` with the gradient
      just received: the buddy copy is exactly what rank ``d - 1`` holds, at every commit.

    At DP 2 the reduce-scatter and the gradient's send are one all-reduce, and a rank whose
    copy is current holds both shards: it takes its parameters from its shard and its copy
    instead of the all-gather (:meth:`_gather`).

    So a lost rank's shard is rebuilt from its successor (:meth:`replica_state`), which the
    controller picks as the donor, with no step lost. The cost: one more Adam over ``1/dp`` of
    the parameters and one point-to-point send of ``1/dp`` of the gradients per step, and the
    buddy's memory; at DP 2, less the all-gather. The donor sends only what the lost rank
    needs to go on: its shard (half of the state with ``dp = 2``), not its buddy copy. So a
    replacement has no copy of its own predecessor's shard yet: every step begins with a
    ``dp``-element all-reduce of who misses one, and the predecessor sends it whole while the
    step's forward and backward run (the copy is needed only at apply), off the recovery's
    path. Until that step ends the
    predecessor's shard has one live copy; two adjacent DP ranks lost at once lose a shard for
    good: that needs snapshots.

    Apply takes only the two shard gradients (``apply_inputs``), so a planned migration sends
    the state ahead as for the replicated job.

    ``copy=False`` is plain ZeRO-1, without the buddy copies (the baseline the copies' cost is
    measured against): a lost rank's shard is then gone.
    """

    def __init__(self, *, copy: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.copy = copy
        self.preload = TrainingJob.preload  # its shards step with torch.optim.Adam

    def _optimizer(self) -> None:
        ctx, dp = self.ctx, self.ctx.dp
        params = list(self.params.values())
        numel = sum(q.numel() for q in params)
        self.shard_size = size = -(-numel // dp)
        # Two flat buffers, reused at every step (their padding stays zero): the all-gather's
        # output, which the model's parameters are views of, and the reduce-scatter's input,
        # which their gradients are views of (backward accumulates into them in place). So
        # the model holds no second copy of either, and no step concatenates or copies them.
        padded = self.gathered = torch.zeros(size * dp)
        self.grad_buffer = torch.zeros(size * dp)
        self._grad_views = _bind_to_buffers(params, padded, self.grad_buffer)
        d = ctx.dp_index

        def owned(index: int) -> tuple[torch.nn.Parameter, torch.optim.Adam, Any]:
            shard = torch.nn.Parameter(padded[index * size:(index + 1) * size].clone())
            shard.grad = torch.zeros_like(shard)
            # fused: torch's fused Adam kernel, 6x faster on one CPU thread than the loop
            # over tensors (0.011 against 0.064 s for 11 M parameters here), and deterministic:
            # the owner and the copy apply the same bits.
            optimizer = torch.optim.Adam([shard], lr=self.lr, fused=True)
            return shard, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer,
                                                                      self._lr_factor)

        self.shard, self.optimizer, self.schedule = owned(d)
        self.buddy_index = (d - 1) % dp
        self.buddy: tuple[torch.nn.Parameter, torch.optim.Adam, Any] | None = (
            owned(self.buddy_index) if dp > 1 and self.copy else None)
        self.buddy_missing = False
        self._incoming: list[torch.Tensor] = []  # the predecessor's shard, while it crosses
        #: this step's buddy check found no rank missing its copy (see :meth:`_gather`)
        self._copies_current = False

    def retarget(self, ctx: JobContext) -> str | None:
        # Another DP rank of the same stage and TP split (a standby warmed as DP rank 0 taking
        # rank 1's place): every shard is the same size, so the model, its two flat buffers
        # and both shards with their optimizers are kept; only which shards they stand for
        # changes, and the state loaded next fills them. Re-making them would allocate and
        # fill twice the model and both shards again on the recovery's path (0.43 s at 1 GiB
        # per rank, idle, here).
        old = self.ctx
        if (ctx.tp, ctx.pp, ctx.dp, ctx.tp_index, ctx.pp_index) != \
                (old.tp, old.pp, old.dp, old.tp_index, old.pp_index):
            return super().retarget(ctx)
        self.ctx = ctx
        self.buddy_index = (ctx.dp_index - 1) % ctx.dp
        self.buddy_missing = False
        self._seed_rank()
        return (f"kept its model, buffers and shards (DP rank {old.dp_index} -> "
                f"{ctx.dp_index}), allocated nothing")

    def _zero_grad(self) -> None:
        self.grad_buffer.zero_()  # the model's gradients are its views

    def compute(self, step: int) -> float | None:
        resync = self._start_resync()
        self._gather()
        loss = super().compute(step)
        self._finish_resync(resync)
        return loss

    def _gather(self) -> None:
        """The model's parameters from every rank's shard. At DP 2 a rank whose copy of the
        other shard is current (and whose peer's copy is: the step's buddy check says so to
        both, so both skip it alike) holds both shards already, bit for bit, and takes them
        without the all-gather; otherwise, and at DP 3 and more, they are all-gathered."""
        ctx, size = self.ctx, self.shard_size
        if ctx.dp == 2 and self.buddy is not None and self._copies_current:
            for index, shard in ((ctx.dp_index, self.shard), (self.buddy_index, self.buddy[0])):
                self.gathered[index * size:(index + 1) * size].copy_(shard.detach())
        elif ctx.dp > 1:
            work = ctx.group("dp")._allgather_base(self.gathered,
                                                    self.shard.detach())
            ctx.wait(work, "the DP parameter all-gather")
        else:
            self.gathered.copy_(self.shard.detach())
        # The model's parameters are views of ``gathered``: they hold the step's values now.

    def _flat_gradients(self) -> torch.Tensor:
        # The model's gradients are views of the buffer: backward wrote them there in place.
        _check_grad_views(self.params.values(), self._grad_views)
        return self.grad_buffer

    def _sync_gradients(self, flat: torch.Tensor) -> None:
        # ``flat`` is ``grad_buffer``, padded to ``dp`` equal shards
        ctx, dp = self.ctx, self.ctx.dp
        grad = self.shard.grad
        assert grad is not None
        if dp == 1:
            grad.copy_(flat)
            return
        group, d, size = ctx.group("dp"), ctx.dp_index, self.shard_size
        if dp == 2:
            # At DP 2 the copy's rank needs exactly the other half of the reduction, so the
            # reduce-scatter and the send of each half to its copy are one all-reduce (with
            # copies, a step 0.03-0.08 s shorter at 256 MiB here). Plain ZeRO-1 takes it too:
            # timed alone, gloo's all-reduce of 88 MB over two ranks took 82 ms against its
            # reduce-scatter's 126 (in the job its step did not change). Each sum is a + b
            # either way: the same bits as before.
            ctx.wait(group.allreduce([flat], allreduce_options(dist.ReduceOp.SUM)),
                     "the DP gradient all-reduce")
            torch.div(flat[d * size:(d + 1) * size], dp, out=grad)
            if self.buddy is not None:
                b = self.buddy_index * size
                torch.div(flat[b:b + size], dp, out=self.buddy[0].grad)
            return
        ctx.wait(group._reduce_scatter_base(grad, flat),
                 "the DP gradient reduce-scatter")
        grad /= dp
        if self.buddy is None:
            return
        assert self.buddy[0].grad is not None
        # The shard's gradient to the rank that keeps its copy; the previous rank's in.
        works = [group.send([grad], (d + 1) % dp, _BUDDY_TAG),
                 group.recv([self.buddy[0].grad], (d - 1) % dp, _BUDDY_TAG)]
        for work in works:
            ctx.wait(work, "the buddy shard's gradient")

    def _start_resync(self) -> list[tuple[Any, str]]:
        """A rank that took a lost rank's place gets its predecessor's shard (values and Adam
        state) whole (see the class docstring): start the sends and receives, which cross
        while the step computes; :meth:`_finish_resync` waits for them before apply."""
        ctx, dp = self.ctx, self.ctx.dp
        self._incoming = []  # not an aborted attempt's
        self._copies_current = False
        if dp < 2 or self.buddy is None:
            return []
        group, d = ctx.group("dp"), ctx.dp_index
        next_misses, own_missing = buddy_check(ctx, self.buddy_missing)
        self._copies_current = not (next_misses or own_missing)
        works: list[tuple[Any, str]] = []
        if next_misses:
            # Read-only until this step's apply, which waits for these sends first.
            works += [(group.send([t], (d + 1) % dp, tag), "the shard to the next rank")
                      for t, tag in zip(adam_parts(self.shard, self.optimizer), _RESYNC_TAGS,
                                        strict=True)]
        if own_missing:
            self._incoming = empty_adam_parts(self.buddy[0])
            works += [(group.recv([t], (d - 1) % dp, tag), "the previous rank's shard")
                      for t, tag in zip(self._incoming, _RESYNC_TAGS, strict=True)]
        return works

    def _finish_resync(self, works: list[tuple[Any, str]]) -> None:
        for work, what in works:
            self.ctx.wait(work, what)
        if self._incoming:
            assert self.buddy is not None
            install_adam_parts(self.buddy[1], self.buddy[0], self._incoming)
            self._incoming = []
            self.buddy_missing = False

    def apply(self, step: int) -> None:
        if self.buddy is not None:
            self.buddy[1].step()
            self.buddy[2].step()
        super().apply(step)

    def apply_inputs(self, step: int) -> dict[str, Any]:
        return {"grads": [self.shard.grad] + ([self.buddy[0].grad] if self.buddy else [])}

    def load_apply_inputs(self, step: int, inputs: dict[str, Any]) -> None:
        shards = [self.shard] + ([self.buddy[0]] if self.buddy else [])
        grads = inputs["grads"]
        if len(grads) != len(shards) or any(g.shape != q.shape for g, q in zip(grads, shards,
                                                                                  strict=True)):
            raise ValueError(f"step {step}'s shard gradients do not fit this rank's shards")
        for q, g in zip(shards, grads, strict=True):
            q.grad = g
        self._replaying = True

    def state(self) -> dict[str, Any]:
        return self._state(own=(self.shard, self.optimizer), buddy=self.buddy,
                           buddy_missing=self.buddy_missing)

    def replica_state(self, rank: int) -> dict[str, Any]:
        # The previous DP rank's state, as it would give it: its shard is our buddy copy; its
        # own buddy (shard d - 2) is ours with dp = 2, and comes from its predecessor later
        # otherwise.
        check_keeps_copy(self.ctx, rank, self.buddy_index, kept=self.buddy is not None,
                         off="--no-shard-copy")
        assert self.buddy is not None
        # Its own buddy copy (shard d - 2) is left out, with dp = 2 our own shard: the
        # replacement gets it from its predecessor while its first step computes.
        return self._state(own=self.buddy[:2], buddy=None, buddy_missing=True)

    def _state(self, own: tuple[Any, ...], buddy: tuple[Any, ...] | None,
               buddy_missing: bool) -> dict[str, Any]:
        return {"shard": own[0].detach(), "optimizer": own[1].state_dict(),
                "buddy": None if buddy is None else {"shard": buddy[0].detach(),
                                                     "optimizer": buddy[1].state_dict()},
                "buddy_missing": buddy_missing, "schedule": self.schedule.state_dict(),
                "data": {"position": self.committed}, "step": self.committed}

    def load_state(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            self.shard.copy_(state["shard"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        self.buddy_missing = bool(state["buddy_missing"])
        if self.buddy is not None:
            buddy = state["buddy"]
            if buddy is not None:
                with torch.no_grad():
                    self.buddy[0].copy_(buddy["shard"])
            # Without a copy (it comes from the previous rank at the next step), the buddy's
            # optimizer still takes the schedule's learning rate, which a scheduler's own
            # load_state_dict does not put back into its optimizer.
            self.buddy[1].load_state_dict(
                buddy["optimizer"] if buddy is not None else
                {"state": {}, "param_groups": state["optimizer"]["param_groups"]})
            self.buddy[2].load_state_dict(state["schedule"])
        self.committed = int(state["step"])


_BUDDY_TAG, _RESYNC_TAGS = 11, (12, 13, 14, 15)


class SlottedPlainJob(SlottedJob, PlainJob):
    """The same model trained by data-parallel slots (``--slots``): the runtime computes each
    slot this rank's replica holds and sums their gradients in slot order
    (:mod:`understudy.worker.slots`); each slot's loss is divided by the slot count, so the sum
    is the mean over the job's whole batch."""

    def build(self, ctx: JobContext) -> None:
        super().build(ctx)
        self.loss_parts = ctx.data_slots
        self._slot_losses: list[float] = []

    def compute_slot(self, step: int, slot: int) -> float | None:
        if slot == self.ctx.held_slots.start:
            self._slot_losses = []
        # The stand-in work is a slot's: a replica holding two slots (after a shrink) does
        # twice the work of one, as it would on real hardware.
        self._sleep(step)
        losses = self._forward_backward(step, slot)
        loss = float(sum(losses)) if self.ctx.last_stage else None
        if loss is not None:
            self._slot_losses.append(loss)
            if self.step_log is not None:  # this replica's share of the step's mean loss
                self._loss = sum(self._slot_losses)
        return loss

    def gradients(self) -> list[torch.Tensor]:
        grads = [q.grad for q in self.params.values()]
        assert all(g is not None for g in grads), "every parameter takes part in the loss"
        return grads  # type: ignore[return-value]

    # Pipeline reshape (worker/restage.py): unit 0 is the embedding, unit 1 + l block l, the
    # last unit the head; a unit's state is its parameters' values, then their Adam moments.

    def _unit_names(self, unit: int) -> list[str]:
        if unit == 0:
            return ["embed_w", "embed_b"]
        if unit == self.layers + 1:
            return ["head_w", "head_b"]
        return [f"block{unit - 1}_{p}" for p in ("w1", "b1", "w2", "b2")]

    def stage_units(self, ctx: JobContext) -> list[int]:
        if not self.rng_by_layer:
            raise ValueError("the job draws its dropout masks from each rank's stream, which "
                             "its stage keys: run it with --rng-by-layer to change its stages")
        if self.layers % ctx.pp:
            raise ValueError(f"layers={self.layers} do not split over pp={ctx.pp} stages")
        return ([0] if ctx.first_stage else []) + [1 + b for b in self._stage_blocks(ctx)] + \
            ([self.layers + 1] if ctx.last_stage else [])

    def _moments(self, q: torch.nn.Parameter) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(self.optimizer, FunctionalAdam):
            i = next(i for i, p in enumerate(self.optimizer.params) if p is q)
            return self.optimizer.exp_avg[i], self.optimizer.exp_avg_sq[i]
        state = self.optimizer.state.get(q)
        if not state:  # no step yet: the moments the first would start from
            return torch.zeros_like(q), torch.zeros_like(q)
        return state["exp_avg"], state["exp_avg_sq"]

    def unit_state(self, unit: int) -> torch.Tensor:
        values = [self.params[n].detach() for n in self._unit_names(unit)]
        moments = [self._moments(self.params[n]) for n in self._unit_names(unit)]
        return torch.cat([t.flatten() for t in values] + [m.flatten() for m, _ in moments] +
                         [v.flatten() for _, v in moments])

    def empty_unit(self, unit: int) -> torch.Tensor:
        numel = sum(math.prod(self._unit_shape(n)) for n in self._unit_names(unit))
        return torch.empty(3 * numel)

    def _unit_shape(self, name: str) -> tuple[int, ...]:
        f, h = self.features, self.hidden // self.ctx.tp
        if name.startswith(("embed_w", "head_w")):
            return (f, f)
        if name.endswith("_w1"):
            return (h, f)
        if name.endswith("_w2"):
            return (f, h)
        return (h,) if name.endswith("_b1") else (f,)

    def restage(self, ctx: JobContext, units: dict[int, torch.Tensor], step: int) -> None:
        kept: dict[str, tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor]] = {
            n: (q, *self._moments(q)) for n, q in self.params.items()}
        self.ctx = ctx
        for unit, flat in units.items():
            names = self._unit_names(unit)
            sizes = [math.prod(self._unit_shape(n)) for n in names]
            parts = flat.split(sizes * 3)
            for i, n in enumerate(names):
                shape = self._unit_shape(n)
                kept[n] = (torch.nn.Parameter(parts[i].view(shape).clone()),
                           parts[len(names) + i].view(shape).clone(),
                           parts[2 * len(names) + i].view(shape).clone())
        self.params = torch.nn.ParameterDict({n: kept[n][0] for n in self._names(ctx)})
        self._optimizer()
        for n, q in self.params.items():
            _, m, v = kept[n]
            if step == 0:
                continue  # no step yet: the optimizer's state starts at the first
            if isinstance(self.optimizer, FunctionalAdam):
                i = list(self.params).index(n)
                self.optimizer.exp_avg[i], self.optimizer.exp_avg_sq[i] = m, v
                self.optimizer.steps[i] = torch.tensor(float(step))
            else:
                self.optimizer.state[q] = {"step": torch.tensor(float(step)), "exp_avg": m,
                                           "exp_avg_sq": v}
        with warnings.catch_warnings():  # the schedule replayed without optimizer steps
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(step):
                self.schedule.step()
        self.committed = step


class SlottedShardedJob(SlottedPlainJob):
    """The slotted job with its optimizer state sharded by slot (ZeRO-1 over slots: ``--slots
    N --shard-optimizer``), which keeps its results bit for bit across a reshape as the
    replicated one does.

    The flat parameters are cut into one chunk per slot (:func:`understudy.worker.slots.chunk`);
    a rank keeps, for each slot its replica holds, the chunk's fp32 values and Adam moments in
    one flat tensor (``values | exp_avg | exp_avg_sq | step``), and (unless ``copy=False``) the
    same for the previous replica's slots: a copy, kept current at every step, so that a lost
    replica's chunks live on. A step:

    - first, the slot states go where the current shape wants them
      (:func:`~understudy.worker.slots.redistribute`: one all-gather of who has and wants what;
      after a reshape re-dealt the slots, or a recovery rebuilt a rank from its successor's
      state, the missing ones come from a replica that has them), and the parameters are
      gathered from the holders' chunks (:func:`~understudy.worker.slots.gather_slots`);
    - the slots' forward and backward, and the runtime's canonical sum, as for any slotted job;
    - ``apply``: Adam on every chunk kept here. The runtime's sum stops at those chunks
      (:meth:`summed_slots`): each replica sums its slots' chunks and sends each to the replica
      keeping its copy, with no all-gather of the whole gradient.

    A chunk's update is the same computation whichever replica makes it, so the run is the
    same bit for bit on any number of replicas. The update is Adam's functional form
    (``torch.optim.adam.adam``, the fused kernel) on views of the flat state, whatever
    ``--adam`` says."""

    def __init__(self, *, copy: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.copy = copy
        self.preload = TrainingJob.preload  # its shards step with torch.optim.Adam

    def _optimizer(self) -> None:
        ctx = self.ctx
        # The gathered parameters, flat: the all-gather's output, which the model's parameters
        # are views of (the model is not held a second time, nor copied in at each step); and
        # the gradients, flat, which the model's gradients are views of: backward accumulates
        # each slot's into them in place, the runtime writes the slots' sum back into them, and
        # apply reads them there (no step concatenates them).
        params = list(self.params.values())
        self.flat = torch.empty(sum(q.numel() for q in params))
        self._grads = torch.zeros_like(self.flat)
        self._grad_views = _bind_to_buffers(params, self.flat, self._grads)
        self.kept: dict[int, torch.Tensor] = {}
        for x in self._wanted(ctx):
            values = self.flat[self._part(x)]
            self.kept[x] = torch.cat([values, torch.zeros(2 * values.numel() + 1)])

    def stage_units(self, ctx: JobContext) -> list[int]:
        raise ValueError("the optimizer state is sharded by slot over each stage's flat "
                         "parameters, which a pipeline reshape re-cuts: a job with "
                         "--shard-optimizer keeps its stages")

    def _part(self, slot: int) -> slice:
        return chunk(self.flat.numel(), self.ctx.data_slots, slot)

    def _wanted(self, ctx: JobContext) -> list[int]:
        """The slots whose state this rank keeps: its replica's, and the previous replica's
        (their copies)."""
        return self.summed_slots(ctx.dp, ctx.dp_index)

    def summed_slots(self, dp: int, replica: int) -> list[int]:
        # Apply reads the summed gradient of the slots whose state it keeps, no other: the
        # runtime's sum stops there (no all-gather of the whole gradient).
        slots = self.ctx.data_slots
        wanted = list(held(slots, dp, replica))
        if self.copy and dp > 1:
            wanted += held(slots, dp, (replica - 1) % dp)
        return sorted(set(wanted))

    def _empty(self, slot: int) -> torch.Tensor:
        part = self._part(slot)
        return torch.empty(3 * (part.stop - part.start) + 1)

    def _zero_grad(self) -> None:
        self._grads.zero_()  # the model's gradients are its views

    def compute_slot(self, step: int, slot: int) -> float | None:
        if slot == self.ctx.held_slots.start:
            self._take_slots()
        return super().compute_slot(step, slot)

    def _take_slots(self) -> None:
        """The slot states this shape wants, then the parameters from the holders' chunks."""
        ctx = self.ctx
        self.kept = redistribute(ctx, self.kept, self._wanted(ctx), self._empty)
        gather_slots(ctx, {x: self._values(x) for x in ctx.held_slots}, self.flat)
        # The model's parameters are views of ``flat``: they hold the step's values now.

    def _values(self, slot: int) -> torch.Tensor:
        n = self._part(slot).stop - self._part(slot).start
        return self.kept[slot][:n]

    @torch.no_grad()
    def apply(self, step: int) -> None:
        _check_grad_views(self.params.values(), self._grad_views)
        grads = self._grads
        lr = self.lr * self._lr_factor(self.committed)
        for x, buf in sorted(self.kept.items()):
            part = self._part(x)
            n = part.stop - part.start
            # Torch's fused kernel (6x the loop's speed on one CPU thread, ShardedJob's note):
            # the same chunk, whichever replica updates it, gives the same bits.
            adam([buf[:n]], [grads[part]], [buf[n:2 * n]], [buf[2 * n:3 * n]], [],  # type: ignore[arg-type]
                 [buf[3 * n:].view(())], foreach=False, capturable=False, differentiable=False,
                 fused=True, grad_scale=None, found_inf=None, has_complex=False, amsgrad=False,
                 beta1=0.9, beta2=0.999, lr=lr, weight_decay=0.0, eps=1e-8, maximize=False)
        self.committed = step + 1
        replayed, self._replaying = self._replaying, False
        if self.step_log is not None and not replayed:
            self.step_log.committed(self.ctx.rank, step, self._loss)

    def discard(self, step: int) -> None:
        self._zero_grad()

    def apply_inputs(self, step: int) -> dict[str, Any]:
        # What apply reads: the summed gradients, flat (the model's are views of them).
        return {"grads": [self._grads]}

    def load_apply_inputs(self, step: int, inputs: dict[str, Any]) -> None:
        grads = inputs["grads"]
        if len(grads) != 1 or grads[0].shape != self._grads.shape or \
                grads[0].dtype != self._grads.dtype:
            raise ValueError(f"step {step}'s gradients do not fit this rank's parameters: one "
                             f"flat {self._grads.dtype} tensor of {self._grads.numel()} elements")
        # The leaver's gradients are the joiner's own now, uncopied: the model's gradients
        # become views of them, and the next step's land in them in place.
        self._grads = grads[0]
        self._grad_views = _bind_to_buffers(list(self.params.values()), None, self._grads)
        self._replaying = True

    def state(self) -> dict[str, Any]:
        return {"slots": {str(x): buf for x, buf in sorted(self.kept.items())},
                "data": {"position": self.committed}, "step": self.committed}

    def load_state(self, state: dict[str, Any]) -> None:
        # Whatever slots the state holds (a recovery's donor gives its own): the next step's
        # redistribute brings the ones this rank wants and drops the others.
        kept = {}
        for key, buf in state["slots"].items():
            x = int(key)
            if not 0 <= x < self.ctx.data_slots or buf.shape != self._empty(x).shape:
                raise ValueError(f"slot {key}'s state does not fit this job's slot chunks")
            kept[x] = buf.clone()
        self.kept = kept
        self.committed = int(state["step"])


def whole_hand_off(cls: type[PlainJob]) -> type[PlainJob]:
    """``cls`` without ``apply_inputs``: its state crosses whole at the switch."""
    return type(f"WholeHandOff{cls.__name__}", (cls,),
                {"apply_inputs": TrainingJob.apply_inputs,
                 "load_apply_inputs": TrainingJob.load_apply_inputs})


WholeHandOffJob = whole_hand_off(PlainJob)


def landing_hand_off(cls: type[PlainJob]) -> type[PlainJob]:
    """``cls`` with ``apply_landing``: a joiner applies each step a range at a time as its
    gradients land (its torch.optim.Adam or FunctionalAdam over replicated parameters)."""
    if issubclass(cls, (ShardedJob, SlottedShardedJob)):
        raise ValueError("--hand-off landing applies Adam over whole parameters: not with "
                         "--shard-optimizer")
    return type(f"Landing{cls.__name__}", (cls,), {"apply_landing": PlainJob._apply_as_landed})


LandingJob = landing_hand_off(PlainJob)


def make_job(args: argparse.Namespace) -> PlainJob:
    cls: type[PlainJob] = (SlottedShardedJob if args.shard_optimizer and args.slots else
                           ShardedJob if args.shard_optimizer else
                           SlottedPlainJob if args.slots else PlainJob)
    if args.hand_off == "whole":
        cls = whole_hand_off(cls)
    elif args.hand_off == "landing":
        cls = landing_hand_off(cls)
    extra = {"copy": not args.no_shard_copy} if args.shard_optimizer else {}
    return cls(features=args.features, hidden=args.hidden, state_bytes=args.state_size,
               layers=args.layers, microbatches=args.microbatches, fail_at=args.fail_at,
               freeze_at=args.freeze_at, marker_dir=args.save, step_sleep=args.step_sleep,
               step_log=args.step_log, step_sleep_off=args.step_sleep_off, adam=args.adam,
               rng_by_layer=args.rng_by_layer,
               hold=None if args.hold_until is None else (args.hold_at, args.hold_until),
               interruptible=args.interruptible, **extra)


@record
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.environ.get("UNDERSTUDY_JOB"):
        return _under_understudy(args)
    if args.store is None:
        raise SystemExit("--store is needed when the job does not run under `understudy run`")
    logs.configure(stream=sys.stderr)
    if args.save is not None:
        args.save.mkdir(parents=True, exist_ok=True)
    groups = StaticGroups(dist.FileStore(args.store, args.world_size), rank=args.rank,
                          world_size=args.world_size, tp=args.tp, timeout=args.group_timeout,
                          prefix=f"{args.job}/groups", pp=args.pp)
    ctx = JobContext(job=args.job, rank=args.rank, world_size=args.world_size, tp=args.tp,
                     pp=args.pp,
                     groups=groups, seed=args.seed, collective_timeout=args.collective_timeout,
                     slots=args.slots or 0)
    job = make_job(args)
    runtime = Runtime(job, ctx)
    runtime.build()
    if args.load is not None:
        runtime.load_state(torch.load(args.load / f"rank{args.rank}.pt", weights_only=True))
    if args.snapshot_at is not None:
        runtime.run(args.snapshot_at)
        if args.save is not None:
            save(runtime, args.save / "snapshot", args.rank)
    runtime.run(args.steps)
    if args.save is not None:
        save(runtime, args.save, args.rank)
    groups.close()
    return 0


def _under_understudy(args: argparse.Namespace) -> int:
    """Under ``understudy run``: the launcher sets up the groups, migrations and standbys."""
    from understudy.worker.launch import main as launch

    def finish(runtime: Runtime) -> None:
        if args.save is not None:
            save(runtime, args.save, runtime.ctx.rank)

    return launch(lambda: make_job(args), args.steps, seed=args.seed, on_finish=finish,
                  collective_timeout=args.collective_timeout, slots=args.slots or 0)


def save(runtime: Runtime, directory: Path, rank: int) -> None:
    """The state as ``rank<r>.pt``, the counters and timings as ``rank<r>.json``."""
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(runtime.state(), directory / f"rank{rank}.pt")
    summary = {"step": runtime.step, "redone": runtime.redone,
               "timings": [asdict(t) for t in runtime.timings]}
    (directory / f"rank{rank}.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    sys.exit(main())
