"""Loading a peer's pickle without letting it run code: how a joiner reads a state manifest.

A pickle is a small program: its ``GLOBAL`` opcodes import any callable by name and ``REDUCE``
calls it, so ``pickle.loads`` of a peer's bytes runs whatever the peer chose (``os.system``,
``builtins.eval``, ``subprocess.Popen``...). :func:`load` runs the same C unpickler with every
import checked against an allow-list, in the spirit of ``torch.load(weights_only=True)``.

What a manifest may hold (the allow-list, also in ``docs/security.md``):

- without any global: ``dict``, ``list``, ``tuple``, ``set``, ``frozenset``, ``str``, ``bytes``,
  ``bytearray``, ``int``, ``float``, ``bool`` and ``None`` (pickle builds them with opcodes);
- the globals in :data:`ALLOWED`: ``builtins.complex``, ``collections.OrderedDict`` (a module's
  ``state_dict``, with its ``_metadata`` attribute), ``torch.Size``, ``torch.device`` and every
  ``torch`` dtype (``torch.float32``...);
- tensors, which are not pickled at all: the sender replaces each with a persistent id, the
  index of its entry in the manifest, and its bytes travel in the chunks.

This is also what ``torch.load(weights_only=True)`` takes by default, minus ``Counter`` (a
class written in Python, which a pickle could patch) and the tensor rebuild functions (tensors
travel as entries), so a state that can be snapshotted (``worker/snapshots.py`` loads with
``weights_only``) can be transferred. Anything else (a namedtuple, a dataclass, a numpy array,
a ``defaultdict``) is refused with :class:`RefusedGlobal`, which names the global, before it is
imported or called.

Why the allow-list is enough. The only callables a pickle can reach are what ``find_class``
returns: ``REDUCE``, ``NEWOBJ`` and ``INST`` can call nothing but the constructors above, which
run no user code. ``BUILD`` sets attributes: every allowed class is an immutable built-in type
(a pickle cannot patch ``OrderedDict.keys``), a dtype has no attributes to set, and an
``OrderedDict``'s own attributes may not shadow its methods (checked after loading). The
extension registry (``EXT`` opcodes) is empty, so those fail. A tensor id becomes an inert
placeholder while unpickling, so no opcode can write into, call or rebuild one of the joiner's
tensors; once the pickle is loaded, the placeholders are swapped for the tensors, and each must
appear exactly once, as a value of a dict or an item of a list or tuple (where the sender puts
them). What remains possible is using memory: a manifest is capped in size by its caller.
"""

from __future__ import annotations

import io
import pickle
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

#: (module, name) -> the object a pickle may refer to by that name.
ALLOWED: dict[tuple[str, str], Any] = {
    ("builtins", "complex"): complex,
    ("collections", "OrderedDict"): OrderedDict,
    ("torch", "Size"): torch.Size,
    ("torch", "device"): torch.device,
    **{("torch", name): value for name, value in vars(torch).items()
       if isinstance(value, torch.dtype)},
}


class RefusedGlobal(pickle.UnpicklingError):
    """The pickle refers to a global outside :data:`ALLOWED`; ``name`` is ``module.name``."""

    def __init__(self, name: str) -> None:
        super().__init__(f"the manifest refers to {name}, which a joiner does not load (only "
                         f"containers, scalars, OrderedDict, torch.Size, torch.device and "
                         f"dtypes travel)")
        self.name = name


class _Tensor:
    """Stands for one of the joiner's tensors while the pickle loads. No attributes, items or
    methods: no opcode can change it, and nothing can be built from it."""

    __slots__ = ()


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, tensors: int) -> None:
        super().__init__(io.BytesIO(data))
        self.tensors = tensors
        self.placeholders: dict[int, int] = {}  # id(placeholder) -> tensor index
        self.keep: list[_Tensor] = []  # keeps the ids above from being reused
        self.ordered_dicts = False  # whether the pickle may have built an OrderedDict

    def find_class(self, module: str, name: str) -> Any:
        found = ALLOWED.get((module, name))
        if found is None:
            raise RefusedGlobal(f"{module}.{name}")
        self.ordered_dicts = self.ordered_dicts or found is OrderedDict
        return found

    def persistent_load(self, pid: Any) -> Any:
        if type(pid) is not int or not 0 <= pid < self.tensors:
            raise pickle.UnpicklingError(f"the manifest refers to tensor {pid!r}, which it does "
                                         f"not list ({self.tensors} tensors)")
        placeholder = _Tensor()
        self.placeholders[id(placeholder)] = pid
        self.keep.append(placeholder)
        return placeholder


def load(data: bytes, tensors: Sequence[Any] = ()) -> Any:
    """Unpickle ``data``, a peer's bytes, allowing only the types in the module docstring;
    persistent id ``i`` is ``tensors[i]``, and each must be used exactly once.

    Raises:
        RefusedGlobal: ``data`` refers to a global outside :data:`ALLOWED` (nothing of it was
            imported or called).
        pickle.UnpicklingError: ``data`` is not such a pickle: truncated, malformed, a tensor
            used twice, left out or placed elsewhere than in a dict, list or tuple, an
            attribute shadowing a method, or nested too deeply.
    """
    unpickler = _Unpickler(data, len(tensors))
    try:
        obj = unpickler.load()
    except RefusedGlobal:
        raise
    except Exception as exc:  # anything a malformed pickle raises
        raise pickle.UnpicklingError(f"the manifest is not a valid pickle: "
                                     f"{type(exc).__name__}: {exc}") from exc
    if not unpickler.placeholders and not unpickler.ordered_dicts and not tensors:
        return obj  # nothing to swap or check: plain containers and scalars (the outer manifest)
    swap = _Swap(unpickler.placeholders, tensors)
    try:
        obj = swap.value(obj)
    except RecursionError:
        raise pickle.UnpicklingError("the manifest is nested too deeply") from None
    if len(swap.used) != len(tensors):
        raise pickle.UnpicklingError(f"the manifest places {len(swap.used)} of its "
                                     f"{len(tensors)} tensors")
    return obj


_CONTAINERS = frozenset({dict, OrderedDict, list, tuple, set, frozenset})


class _Swap:
    """One walk over everything the pickle built: the placeholders where a tensor may stand (a
    dict value, a list or tuple item, the root) become the tensors; anywhere else (a key, a set
    member, an attribute, and all they contain) a tensor is refused. A container shared between
    places is walked once per kind of place; a cycle is refused (a sender never makes one)."""

    def __init__(self, placeholders: dict[int, int], tensors: Sequence[Any]) -> None:
        self.placeholders = placeholders
        self.tensors = tensors
        self.tensor_ids = {id(t) for t in tensors}
        self.used: set[int] = set()
        self.swapped: dict[int, Any] = {}  # id(container) -> the container with tensors
        self.inert: set[int] = set()       # ids of containers seen to hold no tensor
        self.open: set[int] = set()        # ids of the containers being walked

    def value(self, obj: Any) -> Any:
        """``obj`` where a tensor may stand, with its placeholders swapped for tensors."""
        kind = type(obj)
        if kind is _Tensor:
            index = self.placeholders[id(obj)]
            if index in self.used:
                raise pickle.UnpicklingError(f"the manifest uses tensor {index} twice")
            self.used.add(index)
            return self.tensors[index]
        if kind not in _CONTAINERS:
            return obj
        if kind is set or kind is frozenset:
            self.check(obj)
            return obj
        key = id(obj)
        if key in self.swapped:
            return self.swapped[key]
        self._enter(key)
        out = obj
        if kind is list:
            obj[:] = [self.value(v) for v in obj]
        elif kind is tuple:
            items = tuple(self.value(v) for v in obj)
            out = obj if all(a is b for a, b in zip(items, obj, strict=True)) else items
        else:
            for k in list(obj):
                self.check(k)
                obj[k] = self.value(obj[k])
            if kind is OrderedDict:
                self._attributes(obj)
        self.open.discard(key)
        self.swapped[key] = out
        return out

    def check(self, obj: Any) -> None:
        """``obj`` where no tensor may stand: refuse one anywhere inside it."""
        kind = type(obj)
        if kind is _Tensor or id(obj) in self.tensor_ids:
            raise pickle.UnpicklingError("the manifest places a tensor elsewhere than in a "
                                         "dict value or a list or tuple item")
        if kind not in _CONTAINERS or id(obj) in self.inert:
            return
        key = id(obj)
        self._enter(key)
        for v in obj:
            self.check(v)
            if kind in (dict, OrderedDict):
                self.check(obj[v])
        if kind is OrderedDict:
            self._attributes(obj)
        self.open.discard(key)
        self.inert.add(key)

    def _enter(self, key: int) -> None:
        if key in self.open:
            raise pickle.UnpicklingError("the manifest contains a reference cycle")
        self.open.add(key)

    def _attributes(self, obj: OrderedDict[Any, Any]) -> None:
        for name, attr in vars(obj).items():
            if hasattr(OrderedDict, name):
                raise pickle.UnpicklingError(f"the manifest sets attribute {name!r} of an "
                                             f"OrderedDict, which would hide its method")
            self.check(attr)
