"""A pipeline-parallel micro-batch schedule over the job's ``pp`` group, on any backend.

Megatron-core's pipeline schedules need CUDA (streams, NCCL batched point-to-point); this one
needs only a group with ``send`` and ``recv``, so a job on gloo (CPU) can have stages too, and
its groups can be rebuilt under it like any other (it fetches ``ctx.group("pp")`` at each
transfer). It is the GPipe schedule: every micro-batch forward through the stages, then every
micro-batch backward::

    def stage(mb: int, x: torch.Tensor | None) -> torch.Tensor:
        # x: the previous stage's output for micro-batch mb (None on the first stage)
        h = self.embed(inputs[mb]) if ctx.first_stage else x
        h = self.blocks(h)
        return loss_fn(self.head(h), targets[mb]) / microbatches if ctx.last_stage else h

    losses = run_schedule(ctx, microbatches=4, stage=stage, activation=(8, 16))

Each stage keeps its micro-batches' activations until their backward, receives the next
stage's gradient for its output and sends the gradient of its input back. Gradients accumulate
in the parameters' ``.grad`` as with any backward; data-parallel reduction is the job's, after
the schedule. Every wait is abortable (``ctx.wait``): a stage whose neighbour died is released
by the daemon's word or the collective timeout, like any collective.

Determinism: the order of every floating-point operation depends only on the micro-batch
count, so a run is bitwise repeatable and a rank rebuilt elsewhere computes what it would have.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from understudy.worker.api import JobContext, Work

#: Tags of the two directions, so that a forward and a backward transfer never pair up.
ACTIVATION_TAG = 0
GRADIENT_TAG = 1


def run_schedule(ctx: JobContext, *, microbatches: int,
                 stage: Callable[[int, torch.Tensor | None], torch.Tensor],
                 activation: Sequence[int], dtype: torch.dtype = torch.float32) -> list[float]:
    """Run one step's forward and backward passes of this rank's stage over ``microbatches``
    micro-batches (see the module docstring). ``activation`` is the shape of what one stage
    hands the next for one micro-batch. ``stage(mb, x)`` returns the stage's output; on the
    last stage, the micro-batch's loss (a scalar, already scaled as the job wants it summed).

    Returns the losses of the micro-batches on the last stage, an empty list elsewhere.

    Raises:
        ValueError: ``microbatches`` below one, or a stage output of the wrong shape.
        CollectiveAborted: a transfer failed, timed out or was aborted.
    """
    if microbatches < 1:
        raise ValueError(f"microbatches must be at least 1, got {microbatches}")
    first, last, s = ctx.first_stage, ctx.last_stage, ctx.pp_index
    shape = tuple(activation)
    # The sent tensors are kept until their sends complete.
    sends: list[tuple[Work, str, torch.Tensor]] = []
    kept: list[tuple[torch.Tensor | None, torch.Tensor]] = []

    for mb in range(microbatches):
        x: torch.Tensor | None = None
        if not first:
            x = torch.empty(shape, dtype=dtype, device=ctx.device)
            what = f"the activation of micro-batch {mb} from stage {s - 1}"
            ctx.wait(ctx.group("pp").recv([x], s - 1, ACTIVATION_TAG), what)
            x.requires_grad_(True)
        y = stage(mb, x)
        if not last:
            if tuple(y.shape) != shape:
                raise ValueError(f"stage {s} produced {tuple(y.shape)} for micro-batch {mb}, "
                                 f"the schedule expects {shape}")
            out = y.detach().contiguous()
            sends.append((ctx.group("pp").send([out], s + 1, ACTIVATION_TAG),
                          f"the activation of micro-batch {mb} to stage {s + 1}", out))
        kept.append((x, y))

    losses: list[float] = []
    for mb, (x, y) in enumerate(kept):
        if last:
            losses.append(float(y.detach()))
            y.backward()
        else:
            grad = torch.empty(shape, dtype=dtype, device=ctx.device)
            what = f"the gradient of micro-batch {mb} from stage {s + 1}"
            ctx.wait(ctx.group("pp").recv([grad], s + 1, GRADIENT_TAG), what)
            y.backward(grad)
        if x is not None:
            assert x.grad is not None, "the stage's input takes part in its output"
            back = x.grad.contiguous()
            sends.append((ctx.group("pp").send([back], s - 1, GRADIENT_TAG),
                          f"the gradient of micro-batch {mb} to stage {s - 1}", back))
    for work, what, _ in sends:
        ctx.wait(work, what)
    return losses
