"""Capture and restore a process's random number generators, bitwise.

A migrated rank must draw the same random numbers as the rank it replaces (dropout masks, data
shuffles), and a redone step must draw the same numbers as its failed attempt; both come down to
restoring every generator to exactly the state it was in. :func:`capture` takes:

- ``cpu``: torch's default CPU generator;
- ``cuda``: one state per visible CUDA device, when CUDA is available;
- ``python``: the ``random`` module's generator;
- ``numpy``: numpy's global generator, when numpy has been imported;
- ``tracker``: the states of a tensor-parallel RNG tracker, when one is given. The tracker is
  duck-typed on ``get_states()`` / ``set_states(states)``, which Megatron-core's
  ``CudaRNGStatesTracker`` provides.

Generators a job creates itself (``torch.Generator()``) are the job's to save.
"""

from __future__ import annotations

import functools
import random
import sys
from typing import Any, Protocol

import torch


class RNGTracker(Protocol):
    """What :func:`capture` needs from a tensor-parallel RNG tracker (Megatron-core's has it)."""

    def get_states(self) -> dict[str, Any]: ...

    def set_states(self, states: dict[str, Any]) -> None: ...


def seed_all(seed: int) -> None:
    """Seed the process-global generators :func:`capture` takes (all but a tracker's), so that
    runs with the same seed draw the same numbers. Python's ``random`` is otherwise seeded from
    the OS at start-up."""
    if _accelerated():
        torch.manual_seed(seed)  # CPU and every CUDA (MPS, XPU) device
    else:
        # The same CPU generator state, without torch.manual_seed's queued seeding of a CUDA
        # that is not there: it formats the caller's stack each time (~3 ms a call, once a step).
        torch.default_generator.manual_seed(seed)
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % 2**32)


@functools.cache
def _accelerated() -> bool:
    """Whether any device but the CPU has generators to seed (asked once per process)."""
    return torch.cuda.is_available() or torch.backends.mps.is_available() or \
        torch.xpu.is_available()


def capture(tracker: RNGTracker | None = None) -> dict[str, Any]:
    """The current state of every generator listed in the module docstring.

    The result holds copies: drawing more numbers does not change it. Capturing the CUDA states
    initialises CUDA when it is available but not yet initialised.
    """
    state: dict[str, Any] = {"cpu": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = _numpy_state(numpy)
    if tracker is not None:
        state["tracker"] = {name: _copy(value) for name, value in tracker.get_states().items()}
    return state


def restore(state: dict[str, Any], tracker: RNGTracker | None = None) -> None:
    """Put every generator back to the state :func:`capture` returned.

    Generators absent from ``state`` are left alone (a source without numpy never used it).

    Raises:
        ValueError: ``state`` has no CPU state, has CUDA states for a different number of
            devices than this process sees, or has tracker states but no ``tracker`` is given.
    """
    if "cpu" not in state:
        raise ValueError(f"RNG state has no 'cpu' entry (keys: {sorted(state)})")
    if "cuda" in state:
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if len(state["cuda"]) != have:
            raise ValueError(f"RNG state holds {len(state['cuda'])} CUDA generator states, but "
                             f"this process sees {have} CUDA devices")
    if "tracker" in state and tracker is None:
        raise ValueError("RNG state holds tensor-parallel tracker states, but no tracker was "
                         "given to restore them into")
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "python" in state:
        random.setstate(state["python"])
    if "numpy" in state:
        import numpy  # only a state captured where numpy was loaded gets here

        saved = state["numpy"]
        keys = saved["keys"].numpy().view(numpy.uint32)
        numpy.random.set_state((saved["algorithm"], keys, saved["pos"], saved["has_gauss"],
                                saved["cached_gaussian"]))
    if tracker is not None and "tracker" in state:
        tracker.set_states({name: _copy(value) for name, value in state["tracker"].items()})


def _numpy_state(numpy: Any) -> dict[str, Any]:
    # As tensors and scalars rather than numpy's tuple with an array in it, so that the state
    # loads with torch.load(weights_only=True) and streams like any other tensor. The uint32 key
    # words travel as int32, bit for bit.
    algorithm, keys, pos, has_gauss, cached_gaussian = numpy.random.get_state()
    return {"algorithm": str(algorithm),
            "keys": torch.from_numpy(keys.view(numpy.int32).copy()),
            "pos": int(pos), "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian)}


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value

