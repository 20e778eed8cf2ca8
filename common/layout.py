"""Which ranks form which groups: the job's parallel layout.

Ranks are ordered TP fastest, then DP, then PP (Megatron's default order)::

    rank = (pp_index * dp + dp_index) * tp + tp_index

A job has a few *logical* groups, the same names on every rank (``ctx.group("tp")``), and each
logical group is one of several *concrete* groups, named for the group set and etcd::

    logical  concrete              ranks
    tp       tp-<rank // tp>       the tp ranks of one replica of one stage
    dp       dp-<pp_index*tp+tp_i> the dp replicas with this rank's TP index and stage
    pp       pp-<rank % (tp*dp)>   the stages of one pipeline (only when pp >= 2)
    world    world                 every rank

With ``pp == 1`` the names are those of a TP x DP job: ``dp-<tp_index>``, no ``pp`` group.
Pure arithmetic, no torch: the daemon's planner uses it too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: Every logical group name a job can have, in the order groups are built.
LOGICAL = ("tp", "dp", "pp", "world")
#: A concrete group's name (see the module docstring), or a transfer pair's (:func:`pair_name`).
CONCRETE_RE = re.compile(r"(?:tp|dp|pp)-\d+|world")
PAIR_RE = re.compile(r"pair-r\d+-v(?P<version>\d+)")


def pair_name(rank: int, version: int) -> str:
    """The transfer pair of one attempt: a new group each time (the rank that joined through
    one pair may be the leaver of the next)."""
    return f"pair-r{rank}-v{version}"


def retired_bootstrap(keys: list[str], base: str, version: int) -> list[str]:
    """The bootstrap namespaces among ``keys`` (under ``base``, a job's ``kv/<job>/``; a
    group version's keys are ``<group>/v<n>/...``) that a migration which built its groups at
    ``version`` retired once it committed: every older version of each group holding
    ``version`` (its members all switched to it), and every transfer pair of an earlier
    attempt (a pair serves one attempt). Each as a key prefix, ending in ``/``. Versions of a
    group the migration did not rebuild are kept, its current one among them."""
    found: dict[str, set[int]] = {}
    for key in keys:
        group, _, rest = key.removeprefix(base).partition("/")
        number, slash, _ = rest.partition("/")
        if (key.startswith(base) and slash and number[:1] == "v" and number[1:].isdigit()
                and (CONCRETE_RE.fullmatch(group) or PAIR_RE.fullmatch(group))):
            found.setdefault(group, set()).add(int(number[1:]))
    retired = []
    for group, numbers in sorted(found.items()):
        pair = PAIR_RE.fullmatch(group)
        if pair is not None:
            stale = numbers if int(pair["version"]) < version else set()
        else:
            stale = {n for n in numbers if n < version} if version in numbers else set()
        retired += [f"{base}{group}/v{n}/" for n in sorted(stale)]
    return retired


@dataclass(frozen=True)
class Layout:
    """A job's TP x DP x PP layout (see the module docstring).

    Raises (at construction):
        ValueError: a degree below one, or ``tp * pp`` does not divide ``world_size``.
    """

    world_size: int
    tp: int
    pp: int = 1

    def __post_init__(self) -> None:
        if min(self.world_size, self.tp, self.pp) < 1:
            raise ValueError(f"world_size={self.world_size}, tp={self.tp} and pp={self.pp} "
                             "must all be at least 1")
        if self.world_size % (self.tp * self.pp):
            raise ValueError(f"tp={self.tp} x pp={self.pp} does not divide "
                             f"world_size={self.world_size}")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """``(tp_index, dp_index, pp_index)`` of ``rank``.

        Raises:
            ValueError: ``rank`` is outside the world.
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        rest, tp_index = divmod(rank, self.tp)
        pp_index, dp_index = divmod(rest, self.dp)
        return tp_index, dp_index, pp_index

    def rank_of(self, tp_index: int, dp_index: int, pp_index: int) -> int:
        return (pp_index * self.dp + dp_index) * self.tp + tp_index

    def describe(self) -> str:
        return f"world {self.world_size} = TP {self.tp} x DP {self.dp} x PP {self.pp}"

    def logical(self) -> tuple[str, ...]:
        """The job's logical groups, in build order: ``pp`` only with two stages or more."""
        return tuple(n for n in LOGICAL if n != "pp" or self.pp > 1)

    def group_ranks(self, name: str, rank: int) -> tuple[int, ...]:
        """The global ranks of logical group ``name`` that contains ``rank``, in group-rank
        order.

        Raises:
            ValueError: ``name`` is not one of :meth:`logical`, or ``rank`` is outside.
        """
        return tuple(self.members(self.concrete(rank)[self._check(name)]))

    def concrete(self, rank: int) -> dict[str, str]:
        """Logical group name -> the concrete group ``rank`` is in."""
        tp_index, dp_index, pp_index = self.coordinates(rank)
        names = {"tp": f"tp-{rank // self.tp}", "dp": f"dp-{pp_index * self.tp + tp_index}",
                 "pp": f"pp-{dp_index * self.tp + tp_index}", "world": "world"}
        return {n: names[n] for n in self.logical()}

    def members(self, concrete: str) -> range:
        """The ranks of concrete group ``concrete``, in group-rank order.

        Raises:
            ValueError: not a group of this layout.
        """
        kind, _, index = concrete.partition("-")
        if concrete == "world":
            return range(self.world_size)
        try:
            k = int(index)
        except ValueError:
            raise ValueError(f"unknown group {concrete!r}") from None
        tp, dp = self.tp, self.dp
        if kind == "tp" and 0 <= k < dp * self.pp:
            return range(k * tp, (k + 1) * tp)
        if kind == "dp" and 0 <= k < tp * self.pp:
            pp_index, tp_index = divmod(k, tp)
            start = pp_index * dp * tp + tp_index
            return range(start, start + dp * tp, tp)
        if kind == "pp" and self.pp > 1 and 0 <= k < tp * dp:
            return range(k, self.world_size, tp * dp)
        raise ValueError(f"unknown group {concrete!r} in a layout of {self.describe()}")

    def stage_type(self, rank: int) -> str:
        """``only`` (no pipeline), ``first``, ``middle`` or ``last``: stages of one type run
        the same code paths."""
        pp_index = self.coordinates(rank)[2]
        if self.pp == 1:
            return "only"
        if pp_index == 0:
            return "first"
        return "last" if pp_index == self.pp - 1 else "middle"

    def role(self, rank: int) -> tuple[str, int]:
        """``(stage type, tp index)``: ranks with one role issue the same collectives with the
        same shapes; only their data and their parameters' values differ."""
        return self.stage_type(rank), self.coordinates(rank)[0]

    def replicas(self, rank: int) -> tuple[int, ...]:
        """The data-parallel replicas of ``rank`` (itself included): the ranks that hold the
        same parameters, with the same TP index in the same stage."""
        return self.group_ranks("dp", rank)

    def _check(self, name: str) -> str:
        if name not in self.logical():
            raise ValueError(f"unknown group {name!r}: this job's groups are "
                             f"{', '.join(self.logical())}")
        return name
