"""megatron-core 0.16.1 on understudy: ``parallel_state`` wired to the job's stable groups, and a
TP x DP GPT training job.

**Groups.** Megatron modules keep the group objects they were built with (``self.tp_group``,
``pg_collection``...), so the adapter hands Megatron the job's
:class:`~understudy.groups.versioned.VersionedGroup` objects, whose communicator a migration
replaces underneath, and never rebinds anything. :func:`wire_parallel_state` installs them once,
before the model is built, **without** ``initialize_model_parallel`` (which needs a default
process group and builds every group itself through ``new_group``). For PP = CP = EP = 1 it sets:

- the job's **TP** group as ``_TENSOR_MODEL_PARALLEL_GROUP``, ``_MODEL_PARALLEL_GROUP``,
  ``_TENSOR_AND_CONTEXT_PARALLEL_GROUP``, ``_EXPERT_TENSOR_PARALLEL_GROUP``,
  ``_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP`` and
  ``_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP``;
- the job's **DP** group as ``_DATA_PARALLEL_GROUP``, ``_DATA_PARALLEL_GROUP_GLOO``,
  ``_DATA_PARALLEL_GROUP_WITH_CP`` (and ``_GLOO``),
  ``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP`` (and ``_GLOO``),
  ``_EXPERT_DATA_PARALLEL_GROUP`` (and ``_GLOO``) and
  ``_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP`` (and ``_GLOO``); the ``_GLOO`` ones may be the
  same object because a versioned group has a gloo backend for CPU tensors (beside NCCL);
- the job's **world** group as ``_TENSOR_AND_DATA_PARALLEL_GROUP`` (and ``_WITH_CP``) and
  ``_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP``;
- a **one-member group** of this process (:class:`~understudy.groups.lone.LoneGroup`: no
  peer, so nothing to migrate, and no backend, so no socket even in a sandbox) as
  ``_PIPELINE_MODEL_PARALLEL_GROUP``, ``_CONTEXT_PARALLEL_GROUP``, ``_EMBEDDING_GROUP``,
  ``_POSITION_EMBEDDING_GROUP`` and ``_EXPERT_MODEL_PARALLEL_GROUP``;
- the job-wide ranks of each: ``_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS``,
  ``_MODEL_PARALLEL_GLOBAL_RANKS``, ``_DATA_PARALLEL_GLOBAL_RANKS`` (and ``_WITH_CP``),
  ``_PIPELINE_GLOBAL_RANKS``, ``_CONTEXT_PARALLEL_GLOBAL_RANKS``, ``_EMBEDDING_GLOBAL_RANKS``,
  ``_POSITION_EMBEDDING_GLOBAL_RANKS``, ``_EXPERT_MODEL_PARALLEL_RANKS``; and
  ``_global_process_group_list``.

Left unset (None, Megatron's "not used"): ``_DATA_PARALLEL_GROUP_WITH_CP_AG``,
``_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP``, ``_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS``,
``_HYBRID_DP_CP_GROUPS`` and the ``_MPU_*`` rank and size overrides: Megatron asks the group
objects, whose ``rank()`` and ``size()`` never change (a joiner takes the leaver's slot).

Rank bookkeeping in ``torch.distributed``: each group is registered with its job-wide ranks
(``_world.pg_group_ranks``), and the world group becomes the default group
(``_update_default_pg`` plus its ``_world.pg_map`` and ``pg_names`` entries), because Megatron's
``get_*_rank()`` helpers call ``torch.distributed.get_rank(group=...)``. ``init_process_group``
is never called. A joiner takes the leaver's global rank, so none of this changes at a switch.

**CPU.** Without a GPU, Megatron's CUDA RNG tracker and global memory buffer are replaced by the
substitutes in :mod:`understudy.worker.megatron.cpu`, and the job trains with a replicated
Adam. On a GPU, :class:`~understudy.worker.megatron.distributed.ShardedMegatronJob` trains the
same model with Megatron's own DDP and ``DistributedOptimizer`` (CUDA only in megatron-core
0.16.1), and :meth:`MegatronJob.build` refuses CUDA with ``NotImplementedError`` pointing there.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.distributed import distributed_c10d as c10d

from understudy.common import logs
from understudy.common.layout import Layout as JobLayout
from understudy.groups.groupset import GroupSet
from understudy.groups.lone import LoneGroup
from understudy.groups.versioned import VersionedGroup
from understudy.worker import rng
from understudy.worker.api import (
    JobContext,
    TrainingJob,
    allreduce_options,
)
from understudy.worker.megatron import cpu
from understudy.worker.migration import JobGroups, group_members, member

log = logs.get("understudy.worker.megatron")


# -- parallel_state -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """This rank's place in a TP x DP job (TP fastest, as in Megatron's default order)."""

    rank: int
    world_size: int
    tp: int

    def ranks(self, name: str) -> list[int]:
        """Job-wide ranks of this rank's group ``name`` (``tp``, ``dp``, ``world``)."""
        return list(JobLayout(self.world_size, self.tp).group_ranks(name, self.rank))


def wire_parallel_state(tp: VersionedGroup, dp: VersionedGroup, world: VersionedGroup,
                        layout: Layout) -> None:
    """Point ``megatron.core.parallel_state`` at the job's stable groups (see the module
    docstring for every global set) and make ``world`` torch's default group. Once per
    process, before the model is built.

    Raises:
        TypeError: a group is not a stable :class:`VersionedGroup` (Megatron would hold a
            communicator that a migration cannot replace).
        ValueError: a group's size or rank does not match ``layout``.
        RuntimeError: ``parallel_state`` was initialized already in this process.
    """
    if ps.model_parallel_is_initialized():
        raise RuntimeError("megatron.core.parallel_state is initialized already; the adapter "
                           "wires it once per process")
    groups = {"tp": tp, "dp": dp, "world": world}
    for name, group in groups.items():
        if not isinstance(group, VersionedGroup):
            raise TypeError(f"the {name} group is a {type(group).__name__}; Megatron holds its "
                            "groups for the whole job, so it needs the job's stable "
                            "VersionedGroup objects (standalone: use file_store_groups)")
        ranks = layout.ranks(name)
        if (group.size(), group.rank()) != (len(ranks), ranks.index(layout.rank)):
            raise ValueError(f"the {name} group is rank {group.rank()} of {group.size()}, but "
                             f"rank {layout.rank} of a TP={layout.tp} x world="
                             f"{layout.world_size} job is rank {ranks.index(layout.rank)} of "
                             f"{len(ranks)} there")
    for name, group in groups.items():
        group.register(layout.ranks(name))
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    c10d._update_default_pg(world)
    # No store: nothing may bootstrap a group through the default one (GroupSet builds every
    # group), and a new_group() attempt fails at once instead of waiting for peers.
    c10d._world.pg_map[world] = (backend, None)  # type: ignore[assignment]
    c10d._world.pg_names[world] = world.logical_name  # type: ignore[assignment]
    own = LoneGroup(layout.rank)
    tp_ranks, dp_ranks = layout.ranks("tp"), layout.ranks("dp")
    values: dict[str, Any] = {
        "_TENSOR_MODEL_PARALLEL_GROUP": tp, "_MODEL_PARALLEL_GROUP": tp,
        "_TENSOR_AND_CONTEXT_PARALLEL_GROUP": tp, "_EXPERT_TENSOR_PARALLEL_GROUP": tp,
        "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": tp,
        "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": tp,
        "_DATA_PARALLEL_GROUP": dp, "_DATA_PARALLEL_GROUP_GLOO": dp,
        "_DATA_PARALLEL_GROUP_WITH_CP": dp, "_DATA_PARALLEL_GROUP_WITH_CP_GLOO": dp,
        "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": dp,
        "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO": dp,
        "_EXPERT_DATA_PARALLEL_GROUP": dp, "_EXPERT_DATA_PARALLEL_GROUP_GLOO": dp,
        "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": dp,
        "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO": dp,
        "_TENSOR_AND_DATA_PARALLEL_GROUP": world,
        "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": world,
        "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP": world,
        "_PIPELINE_MODEL_PARALLEL_GROUP": own, "_CONTEXT_PARALLEL_GROUP": own,
        "_EMBEDDING_GROUP": own, "_POSITION_EMBEDDING_GROUP": own,
        "_EXPERT_MODEL_PARALLEL_GROUP": own,
        "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": tp_ranks, "_MODEL_PARALLEL_GLOBAL_RANKS": tp_ranks,
        "_DATA_PARALLEL_GLOBAL_RANKS": dp_ranks, "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP": dp_ranks,
        "_PIPELINE_GLOBAL_RANKS": [layout.rank], "_CONTEXT_PARALLEL_GLOBAL_RANKS": [layout.rank],
        "_EMBEDDING_GLOBAL_RANKS": [layout.rank],
        "_POSITION_EMBEDDING_GLOBAL_RANKS": [layout.rank],
        "_EXPERT_MODEL_PARALLEL_RANKS": [layout.rank],
        # None stands for the default group, as in Megatron's create_group.
        "_global_process_group_list": [None, tp, dp, own],
    }
    for name, value in values.items():
        assert hasattr(ps, name), f"megatron.core.parallel_state has no {name}"
        setattr(ps, name, value)


def file_store_groups(path: str, *, job: str, rank: int, world_size: int, tp: int,
                      timeout: float = 300.0) -> tuple[GroupSet, JobGroups]:
    """The job's groups for a standalone run (no daemons): a :class:`GroupSet` that bootstraps
    through a ``FileStore`` at ``path`` shared by every rank, with the same group names and
    members as under ``understudy run`` (all ranks on node ``standalone``), and the runtime's
    provider over it. Every rank must call it at the same time; it returns once each of the
    rank's groups is connected."""
    store = dist.FileStore(path, world_size)

    def factory(namespace: str, cancel: threading.Event) -> dist.Store:
        return dist.PrefixStore(namespace, store)

    # With CUDA (ShardedMegatronJob), NCCL for CUDA tensors beside gloo, connected on the
    # current device.
    cuda = torch.cuda.is_available()
    groups = GroupSet(job, member(rank, "standalone"), timeout=timeout, store_factory=factory,
                      backends={"cpu": "gloo", **({"cuda": "nccl"} if cuda else {})},
                      device=torch.device("cuda", torch.cuda.current_device()) if cuda else None)
    nodes = ("standalone",) * world_size
    layout = JobLayout(world_size, tp)
    names = tuple(layout.concrete(rank).values())
    for name in names:
        groups.prepare(name, 1, group_members(name, nodes, layout))
    groups.switch(names)
    return groups, JobGroups(groups, rank, layout)


# -- the job --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GPTShape:
    """The model, the data and the optimizer of :class:`MegatronJob`."""

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    vocab_size: int = 128
    seq_length: int = 32
    micro_batch: int = 8
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    lr: float = 3e-3
    warmup: int = 5
    #: probability that a token breaks the pattern the model is to learn
    noise: float = 0.1


class MegatronJob(TrainingJob):
    """A Megatron-core GPT (local layer spec) trained with TP x DP on the job's groups.

    - **Model**: built from the seed alone with ``use_cpu_initialization`` (each TP rank takes
      its slice of the same full matrices), so every run with the same seed and layout starts
      from the same parameters.
    - **Data**: token sequences that follow a fixed random successor table with some noise;
      the batch of a step derives from ``(seed, step, dp_index)``, so the data position is the
      step.
    - **Step**: forward and backward (Megatron's TP collectives run inside), then one
      all-reduce of every gradient over DP, waited abortably; ``apply`` steps a plain
      ``torch.optim.Adam`` and a linear-warmup schedule.
    - **RNG**: the process-global generators (hidden and embedding dropout, identical within a
      TP group) are seeded from ``(seed, dp_index, step)`` before every step (:meth:`reseed`),
      so a rank rebuilt from a data-parallel replica draws what it would have; the TP tracker's
      streams (attention dropout, one per TP rank) are saved here and rewound by
      :meth:`discard`.

    **Standbys.** In the sandbox the job is built on the stable groups of the rank the standby
    warms as, answered by replay groups standing in as their version 0
    (:mod:`understudy.sandbox.warmup`), so ``parallel_state`` is wired once, to the objects the
    real versions are switched into after promotion. A joiner the launcher built without a
    sandbox gets the stable objects reserved before their first version (building issues no
    collective). Where no group exists at all when :meth:`build` runs (a sandbox whose
    recording was refused), the model is built in :meth:`load_state`.
    """

    def __init__(self, shape: GPTShape | None = None) -> None:
        self.shape = shape or GPTShape()
        self.model: GPTModel | None = None
        #: loss of each committed step this process ran (not training state)
        self.losses: dict[int, float] = {}
        self._loss: float | None = None
        self._tracker_before: dict[str, torch.Tensor] = {}
        #: where the model and the batches live (CUDA in ShardedMegatronJob)
        self.device = torch.device("cpu")

    # -- building ---------------------------------------------------------------------------

    def build(self, ctx: JobContext) -> None:
        self._check_device()
        if self.shape.num_attention_heads % ctx.tp or self.shape.vocab_size % ctx.tp:
            raise ValueError(f"tp={ctx.tp} must divide the attention heads "
                             f"({self.shape.num_attention_heads}) and the vocabulary "
                             f"({self.shape.vocab_size})")
        self.ctx = ctx
        try:
            groups = [ctx.group(name) for name in ("tp", "dp", "world")]
        except ValueError as exc:
            log.info("the job's groups are not switched in yet; the model is built when the "
                     "state arrives", rank=ctx.rank, reason=str(exc))
            return
        self._materialize(groups)

    def _check_device(self) -> None:
        if torch.cuda.is_available():
            raise NotImplementedError(
                "MegatronJob trains on CPU only (replicated Adam, Megatron's CUDA RNG tracker "
                "and memory buffer replaced by CPU ones); on a GPU use ShardedMegatronJob "
                "(understudy.worker.megatron.distributed: Megatron's DistributedDataParallel "
                "and DistributedOptimizer on the job's groups)")

    def _install_rng(self, ctx: JobContext) -> Any:
        """Megatron's tensor-parallel RNG tracker, seeded; returns it."""
        tracker = cpu.install()
        cpu.model_parallel_cpu_manual_seed(tracker, ctx.seed, tp_rank=ctx.tp_index)
        return tracker

    def _precision(self) -> dict[str, Any]:
        """The model's number format, as ``TransformerConfig`` arguments: fp32 here."""
        return {"params_dtype": torch.float32}

    def _build_optimizer(self, config: TransformerConfig, groups: Sequence[Any]) -> None:
        """The optimizer and its schedule over the model just built (``self.model``)."""
        self.params = [p for p in self._require_model().parameters() if p.requires_grad]
        self.optimizer = torch.optim.Adam(self.params, lr=self.shape.lr)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)

    def _lr_factor(self, step: int) -> float:
        """The schedule: a linear warm-up over ``shape.warmup`` steps, then constant."""
        return min(1.0, (step + 1) / max(1, self.shape.warmup))

    def _materialize(self, groups: Sequence[Any]) -> None:
        ctx, shape = self.ctx, self.shape
        tp, dp, world = groups
        if ps.model_parallel_is_initialized():
            # A standby warmed as one rank and chosen for another builds a new job in the same
            # process: the new rank's groups replace the warmed rank's (which are closed).
            log.info("replacing the parallel_state wiring of the job built before in this "
                     "process", rank=ctx.rank)
            ps.destroy_model_parallel()
        wire_parallel_state(tp, dp, world, Layout(ctx.rank, ctx.world_size, ctx.tp))
        self.tracker = self._install_rng(ctx)
        config = TransformerConfig(
            num_layers=shape.num_layers, hidden_size=shape.hidden_size,
            num_attention_heads=shape.num_attention_heads, tensor_model_parallel_size=ctx.tp,
            hidden_dropout=shape.hidden_dropout, attention_dropout=shape.attention_dropout,
            use_cpu_initialization=True, **self._precision(),
            bias_activation_fusion=False, masked_softmax_fusion=False,
            bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
            gradient_accumulation_fusion=False,
            # The default ("full") is deprecated and warns; empty means the same.
            cuda_graph_scope=[])
        # Initialisation draws from the global CPU generator: the same full matrices on every
        # rank, whatever its place.
        torch.manual_seed(ctx.seed)
        self.model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                              vocab_size=shape.vocab_size, max_sequence_length=shape.seq_length,
                              share_embeddings_and_output_weights=True,
                              position_embedding_type="learned_absolute")
        self.forward_module: torch.nn.Module = self.model
        self._build_optimizer(config, groups)
        self.committed = 0
        gen = torch.Generator().manual_seed(ctx.seed)
        self.successor = torch.randperm(shape.vocab_size, generator=gen)
        self.causal_mask = torch.triu(torch.ones(shape.seq_length, shape.seq_length,
                                                 dtype=torch.bool, device=self.device),
                                      diagonal=1)[None, None]
        # Dropout outside TP regions must match within a TP group, which holds the same
        # activations; replicas differ.
        rng.seed_all(ctx.seed * 1_000_003 + ctx.dp_index)
        log.info("built the Megatron GPT model", rank=ctx.rank, tp=ctx.tp, dp=ctx.dp,
                 parameters=sum(p.numel() for p in self.params))

    def forget_shadow_steps(self) -> None:
        """The sandbox's shadow iterations logged losses of steps this rank never ran."""
        self.losses.clear()

    def reseed(self, step: int) -> None:
        """The process-global streams follow ``(seed, dp_index, step)``; the TP tracker's
        streams are the same on every data-parallel replica and travel with the state."""
        rng.seed_all((self.ctx.seed * 1_000_003 + self.ctx.dp_index) * 1_000_033 + step)

    def _require_model(self) -> GPTModel:
        if self.model is None:
            raise RuntimeError("the model is not built: the job's groups were missing at "
                               "build() and no state was loaded")
        return self.model

    # -- data ---------------------------------------------------------------------------------

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens, labels)`` of ``step`` for this rank's replica, each ``[batch, seq]``."""
        shape, ctx = self.shape, self.ctx
        g = torch.Generator().manual_seed((ctx.seed * 1_000_003 + step) * 1_009 + ctx.dp_index)
        seq = torch.empty(shape.micro_batch, shape.seq_length + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(shape.vocab_size, (shape.micro_batch,), generator=g)
        noise = torch.rand(shape.micro_batch, shape.seq_length, generator=g) < shape.noise
        random_tokens = torch.randint(shape.vocab_size, (shape.micro_batch, shape.seq_length),
                                      generator=g)
        for i in range(shape.seq_length):
            seq[:, i + 1] = torch.where(noise[:, i], random_tokens[:, i],
                                        self.successor[seq[:, i]])
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    # -- the step -----------------------------------------------------------------------------

    def compute(self, step: int) -> float:
        self._begin_step()
        return self._forward_backward(step)

    def _begin_step(self) -> None:
        """Before the step's first collective that may be aborted: what :meth:`discard`
        rewinds the TP tracker to."""
        self._require_model()
        self._tracker_before = _clone(self.tracker.get_states())

    def _forward_backward(self, step: int) -> float:
        """Forward, backward and the DP gradient synchronisation; returns the loss."""
        tokens, labels = (t.to(self.device) for t in self.batch(step))
        positions = torch.arange(self.shape.seq_length, device=self.device).expand_as(tokens)
        for p in self.params:
            p.grad = None
        self.forward_module.train()
        per_token = self.forward_module(tokens, positions, self.causal_mask, labels=labels)
        loss = per_token.float().mean()
        loss.backward()
        self._sync_gradients()
        self._loss = float(loss.item())
        if not math.isfinite(self._loss):
            raise FloatingPointError(f"the loss of step {step} is {self._loss}")
        return self._loss

    def _sync_gradients(self) -> None:
        """Every gradient averaged over DP, in place."""
        ctx = self.ctx
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.flatten() for g in grads])
        work = ctx.group("dp").allreduce([flat], allreduce_options(dist.ReduceOp.SUM))
        ctx.wait(work, "the DP gradient all-reduce")
        flat /= ctx.dp
        offset = 0
        for p in self.params:
            p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()

    def apply(self, step: int) -> None:
        self.optimizer.step()
        self.schedule.step()
        self._commit(step)

    def handed_off(self, step: int) -> None:
        # The joiner applies this step with the rank; this process leaves: its loss only.
        self._commit(step)

    def _commit(self, step: int) -> None:
        """``step`` is committed here: the counter, and its loss in the log."""
        self.committed = step + 1
        if self._loss is not None:
            self.losses[step] = self._loss

    def apply_inputs(self, step: int) -> dict[str, Any]:
        """What apply takes from compute: the averaged gradients, the loss it logs, and the TP
        tracker's streams as compute left them (compute advances them; apply does not)."""
        return {"grads": [p.grad for p in self.params], "loss": self._loss,
                "tracker": _clone(self.tracker.get_states())}

    def load_apply_inputs(self, step: int, inputs: dict[str, Any]) -> None:
        grads = inputs["grads"]
        if len(grads) != len(self.params) or any(
                g.shape != p.shape or g.dtype != p.dtype
                for g, p in zip(grads, self.params, strict=True)):
            raise ValueError(f"step {step}'s gradients do not fit this rank's parameters")
        for p, g in zip(self.params, grads, strict=True):
            p.grad = g
        self.tracker.set_states(_clone(inputs["tracker"]))
        self._loss = inputs["loss"]

    def discard(self, step: int) -> None:
        for p in self.params:
            p.grad = None
        self.tracker.set_states(_clone(self._tracker_before))
        self._loss = None

    # -- state --------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        model = self._require_model()
        return {"model": model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "schedule": self.schedule.state_dict(),
                "tracker": _clone(self.tracker.get_states()),
                "data": {"position": self.committed}, "step": self.committed}

    def load_state(self, state: dict[str, Any]) -> None:
        if self.model is None:
            self._materialize([self.ctx.group(name) for name in ("tp", "dp", "world")])
        model = self._require_model()
        # Strict: the same keys on both sides, Megatron's ``_extra_state`` entries included
        # (None for the local spec).
        model.load_state_dict(state["model"], strict=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        self.tracker.set_states(_clone(state["tracker"]))
        self.committed = int(state["step"])


def _clone(states: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in states.items()}


__all__ = ["GPTShape", "Layout", "MegatronJob", "file_store_groups", "wire_parallel_state"]
