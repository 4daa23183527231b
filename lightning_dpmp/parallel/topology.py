"""The run's topology: every parallel degree (``dp``, ``pp``, ``mp``), the pipeline's schedule and the ZeRO level,
resolved and validated once, with the rank arithmetic of the grid they span.

One :class:`Topology` is the single source of those numbers, like torchtitan's ``ParallelDims``: the Trainer and the
Fabric strategies resolve it once (:meth:`Topology.resolve`, when the Trainer knows devices and nodes, before any
process starts), and everything downstream reads it from the :class:`~lightning_dpmp.parallel.grid.Grid` built from
it (:func:`~lightning_dpmp.parallel.grid.build_grid`), never from the strategy.

Ranks are laid out MP innermost, then PP, then DP: ``rank = (dp_rank * pp + pp_rank) * mp + mp_rank``, so that the
``mp`` ranks of one MP group are consecutive and, with Lightning's node-major rank order, sit on one node::

    dp=2, mp=4         mp_rank 0  1  2  3
        dp_rank 0:  ranks      0  1  2  3   <- one MP group (same batch, 1/mp of each split weight)
        dp_rank 1:  ranks      4  5  6  7
                               ^ one DP group per column: {0,4}, {1,5}, {2,6}, {3,7} (gradients averaged)

    dp=2, pp=2, mp=2    rows: {0,1,2,3} {4,5,6,7}; MP groups {0,1} {2,3} ...; PP groups {0,2} {1,3} {4,6} {5,7};
                        DP groups {0,4} {1,5} {2,6} {3,7}

A *row* is every rank of one DP replica (``pp * mp`` ranks: they train on one batch).

Example:
    >>> topo = Topology(dp=2, mp=2, pp=2, zero=1)
    >>> topo.world_size, tuple(topo.coords(6))      # rank 6 = (1 * 2 + 1) * 2 + 0
    (8, (1, 1, 0))
    >>> topo.dp_groups()
    [[0, 4], [1, 5], [2, 6], [3, 7]]
    >>> Topology.resolve("auto", 2, world=8).dp
    4
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, replace
from typing import Any, Literal, NamedTuple, Optional, Union

__all__ = ["SCHEDULES", "Coords", "Size", "Topology", "check_parallel_size", "check_zero"]

#: The pipeline schedules: torch's ``ScheduleGPipe``, ``Schedule1F1B`` and ``ScheduleInterleaved1F1B``.
SCHEDULES = ("gpipe", "1f1b", "interleaved")

Size = Union[int, Literal["auto"]]


def check_parallel_size(name: str, value: Any, allow_auto: bool = False) -> None:
    """Reject anything but a positive ``int`` (and ``"auto"`` when allowed) with a ``ValueError``.

    ``bool`` is an ``int`` subclass in Python, so ``dp=True`` is caught explicitly.

    Example:
        >>> check_parallel_size("dp", 2)
        >>> check_parallel_size("mp", 0)
        Traceback (most recent call last):
        ...
        ValueError: `mp` must be a positive integer, got 0 (int). For example DPMPStrategy(dp=2, mp=2).
    """
    if allow_auto and value == "auto" and isinstance(value, str):
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        extra = ' or "auto"' if allow_auto else ""
        raise ValueError(
            f"`{name}` must be a positive integer{extra}, got {value!r} ({type(value).__name__})."
            " For example DPMPStrategy(dp=2, mp=2)."
        )


class Coords(NamedTuple):
    """A rank's place in the grid."""

    dp_rank: int
    pp_rank: int
    mp_rank: int


@dataclass(frozen=True)
class Topology:
    """Every parallel degree of a run and the settings that depend on them, validated once at construction.

    Attributes:
        dp: data-parallel replicas (each trains on its own slice of the data).
        mp: tensor-model-parallel width (every split weight is held 1/mp per rank).
        pp: pipeline stages (1: no pipeline).
        zero: ZeRO level over the DP group: 0 off, 1/2 optimizer state and gradients, 3 parameters too.
        microbatches: micro-batches per step under a pipeline (``-1``, the default: one per stage).
        schedule: the pipeline schedule, one of :data:`SCHEDULES`.
        stages_per_rank: stages each pipeline rank holds (``"interleaved"`` only: >= 2).

    With ``pp == 1`` the pipeline settings are checked for their types and then hold their defaults.

    Example:
        >>> Topology(dp=1, mp=2, pp=2, schedule="interleaved", stages_per_rank=2).microbatches
        4
        >>> Topology(dp=2, mp=2, zero=4)
        Traceback (most recent call last):
        ...
        ValueError: `zero` must be 0 (off), 1 (optimizer state sharded over DP), 2 (and gradients) or 3 (and
            parameters), got 4.
    """

    dp: int = 1
    mp: int = 1
    pp: int = 1
    zero: int = 0
    microbatches: int = -1
    schedule: str = "1f1b"
    stages_per_rank: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "mp", "pp"):
            check_parallel_size(name, getattr(self, name))
        check_zero(self.zero)
        for name, value in (("pp_stages_per_rank", self.stages_per_rank), ("pp_microbatches", self.microbatches)):
            if (isinstance(value, bool) or not isinstance(value, int) or value < 1) and not (
                    name == "pp_microbatches" and value == -1):
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"`pp_schedule` must be one of {SCHEDULES}, got {self.schedule!r}.")
        if self.pp == 1:  # no pipeline: its settings are unused, and compare equal whatever was passed
            object.__setattr__(self, "microbatches", 1)
            object.__setattr__(self, "schedule", "1f1b")
            object.__setattr__(self, "stages_per_rank", 1)
            return
        if self.schedule == "interleaved" and self.stages_per_rank < 2:
            raise ValueError(f"pp_schedule='interleaved' runs several stages per rank: set pp_stages_per_rank >= 2,"
                             f" got {self.stages_per_rank}.")
        if self.schedule != "interleaved" and self.stages_per_rank != 1:
            raise ValueError(f"pp_stages_per_rank={self.stages_per_rank} needs pp_schedule='interleaved'"
                             f" ({self.schedule!r} runs one stage per rank).")
        if self.microbatches == -1:
            object.__setattr__(self, "microbatches", self.pp * self.stages_per_rank)
        if self.schedule == "interleaved" and self.microbatches % self.pp:
            raise ValueError(f"pp_schedule='interleaved' needs pp_microbatches ({self.microbatches}) to be a multiple"
                             f" of pp ({self.pp}).")

    # ------------------------------------------------------------------ resolution
    @classmethod
    def resolve(cls, dp: Size, mp: Size, world: int, *, devices: Optional[int] = None, num_nodes: int = 1,
                **settings: Any) -> Topology:
        """The topology for ``world`` processes: one ``"auto"`` size is ``world // (pp * the other)``; both
        ``"auto"`` give (``num_nodes``, the rest), the rule ``DPMPStrategy(dp="auto", mp="auto")`` falls back to
        where it cannot choose by measurement at setup. ``settings``: ``pp``, ``zero`` and the pipeline's. Raises a
        ``ValueError`` naming every number when the sizes do not fit the world (``devices``/``num_nodes``, when
        given, word the message as the Trainer's arguments).

        Example:
            >>> Topology.resolve(2, "auto", world=8, pp=2)
            Topology(dp=2, mp=2, pp=2, zero=0, microbatches=2, schedule='1f1b', stages_per_rank=1)
            >>> Topology.resolve("auto", 3, world=4)
            Traceback (most recent call last):
            ...
            ValueError: DPMPStrategy(dp='auto', mp=3): devices*num_nodes = 4 is not divisible by mp=3.
        """
        check_parallel_size("dp", dp, allow_auto=True)
        check_parallel_size("mp", mp, allow_auto=True)
        pp = settings.get("pp", 1)
        check_parallel_size("pp", pp)
        if world % pp:
            raise ValueError(f"DPMPStrategy(pp={pp}): devices*num_nodes = {world} is not divisible by pp.")
        per_stage = world // pp
        if dp == "auto" and mp == "auto":
            nodes = num_nodes if per_stage % num_nodes == 0 else 1
            dp, mp = nodes, per_stage // nodes
        elif mp == "auto":
            assert isinstance(dp, int)
            if per_stage % dp:
                raise ValueError(f"DPMPStrategy(dp={dp}, mp='auto'): devices*num_nodes = {world} is not divisible"
                                 f" by dp={dp}{_times_pp(pp)}.")
            mp = per_stage // dp
        elif dp == "auto":
            assert isinstance(mp, int)
            if per_stage % mp:
                raise ValueError(f"DPMPStrategy(dp='auto', mp={mp}): devices*num_nodes = {world} is not divisible"
                                 f" by mp={mp}{_times_pp(pp)}.")
            dp = per_stage // mp
        topology = cls(dp=int(dp), mp=int(mp), **settings)
        topology.check_world(world, devices=devices, num_nodes=num_nodes)
        return topology

    def settings(self) -> dict[str, Any]:
        """Everything but ``dp`` and ``mp``, as :meth:`resolve` takes it.

        Example:
            >>> Topology(pp=2, zero=1).settings()
            {'pp': 2, 'zero': 1, 'microbatches': 2, 'schedule': '1f1b', 'stages_per_rank': 1}
        """
        return {"pp": self.pp, "zero": self.zero, "microbatches": self.microbatches, "schedule": self.schedule,
                "stages_per_rank": self.stages_per_rank}

    def with_sizes(self, dp: int, mp: int) -> Topology:
        """The same settings over another split of the world into ``dp`` and ``mp`` (a layout chosen at setup).

        Example:
            >>> Topology(dp=4, mp=1, zero=2).with_sizes(2, 2)
            Topology(dp=2, mp=2, pp=1, zero=2, microbatches=1, schedule='1f1b', stages_per_rank=1)
        """
        return replace(self, dp=dp, mp=mp)

    def check_world(self, world: int, *, devices: Optional[int] = None, num_nodes: int = 1) -> None:
        """Raise a ``ValueError`` naming every number when ``dp * pp * mp`` is not ``world``.

        Example:
            >>> Topology(dp=2, mp=2).check_world(3, devices=3)
            Traceback (most recent call last):
            ...
            ValueError: DPMPStrategy(dp=2, mp=2) needs dp*mp = 4 processes, but devices=3 x num_nodes=1 = 3.
                Set devices*num_nodes = 4, or choose dp and mp with dp*mp = 3.
        """
        need = self.world_size
        if need == world:
            return
        if devices is not None:
            have = f"devices={devices} x num_nodes={num_nodes} = {world}"
            fix = f"Set devices*num_nodes = {need}"
        else:
            have = f"the process group has world size {world}"
            fix = f"Launch {need} processes (e.g. torchrun --nproc_per_node)"
        if self.pp == 1:
            raise ValueError(f"DPMPStrategy(dp={self.dp}, mp={self.mp}) needs dp*mp = {need} processes, but {have}."
                             f" {fix}, or choose dp and mp with dp*mp = {world}.")
        raise ValueError(f"DPMPStrategy(dp={self.dp}, pp={self.pp}, mp={self.mp}) needs dp*pp*mp = {need} processes,"
                         f" but {have}. {fix}, or choose dp, pp and mp with dp*pp*mp = {world}.")

    # ------------------------------------------------------------------ sizes
    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.mp

    @property
    def stages(self) -> int:
        """Pipeline stages in all (``pp * stages_per_rank``)."""
        return self.pp * self.stages_per_rank

    @property
    def row_size(self) -> int:
        """Ranks that train on one batch: every stage and MP rank of one DP replica (``pp * mp``)."""
        return self.pp * self.mp

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def mp_enabled(self) -> bool:
        return self.mp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def zero_enabled(self) -> bool:
        """ZeRO shards something: a level >= 1 and more than one DP replica to shard over."""
        return self.zero >= 1 and self.dp > 1

    # ------------------------------------------------------------------ rank arithmetic
    def coords(self, rank: int) -> Coords:
        """``(dp_rank, pp_rank, mp_rank)`` of a global rank (MP innermost, then PP).

        Example:
            >>> Topology(dp=2, mp=4).coords(5)
            Coords(dp_rank=1, pp_rank=0, mp_rank=1)
        """
        return Coords(rank // self.row_size, (rank // self.mp) % self.pp, rank % self.mp)

    def rank_of(self, dp_rank: int, pp_rank: int, mp_rank: int) -> int:
        """The global rank at these coordinates.

        Example:
            >>> Topology(dp=2, mp=2, pp=2).rank_of(1, 1, 0)
            6
        """
        return (dp_rank * self.pp + pp_rank) * self.mp + mp_rank

    def mp_groups(self) -> list[list[int]]:
        """Every MP group (one per (dp, pp) cell), as global ranks.

        Example:
            >>> Topology(dp=2, mp=2).mp_groups()
            [[0, 1], [2, 3]]
        """
        return [[self.rank_of(d, s, m) for m in range(self.mp)] for d in range(self.dp) for s in range(self.pp)]

    def dp_groups(self) -> list[list[int]]:
        """Every DP group (one per (pp, mp) cell).

        Example:
            >>> Topology(dp=2, mp=1, pp=2).dp_groups()
            [[0, 2], [1, 3]]
        """
        return [[self.rank_of(d, s, m) for d in range(self.dp)] for s in range(self.pp) for m in range(self.mp)]

    def pp_groups(self) -> list[list[int]]:
        """Every PP group: the ``pp`` stages of one replica at one ``mp_rank``.

        Example:
            >>> Topology(dp=2, mp=2, pp=2).pp_groups()
            [[0, 2], [1, 3], [4, 6], [5, 7]]
        """
        return [[self.rank_of(d, s, m) for s in range(self.pp)] for d in range(self.dp) for m in range(self.mp)]

    def rows(self) -> list[list[int]]:
        """Every row: the ``pp * mp`` ranks of one DP replica.

        Example:
            >>> Topology(dp=2, mp=2).rows()
            [[0, 1], [2, 3]]
        """
        return [list(range(d * self.row_size, (d + 1) * self.row_size)) for d in range(self.dp)]

    def __str__(self) -> str:
        pp = f", pp={self.pp}" if self.pp > 1 else ""
        zero = f", zero={self.zero}" if self.zero else ""
        return f"dp={self.dp}{pp}, mp={self.mp}{zero}"


def check_zero(zero: Any, allow_auto: bool = False) -> None:
    """Refuse a ZeRO level other than 0, 1, 2, 3 (and ``"auto"`` when allowed: chosen at setup).

    Example:
        >>> check_zero("auto", allow_auto=True)
        >>> check_zero("auto")
        Traceback (most recent call last):
        ...
        ValueError: `zero` must be 0 (off), 1 (optimizer state sharded over DP), 2 (and gradients) or 3 (and
            parameters), got 'auto'.
    """
    if allow_auto and zero == "auto" and isinstance(zero, str):
        return
    if zero not in (0, 1, 2, 3) or isinstance(zero, bool) or isinstance(zero, str):
        extra = ' or "auto" (the lowest level that fits, chosen at setup)' if allow_auto else ""
        raise ValueError(
            f"`zero` must be 0 (off), 1 (optimizer state sharded over DP), 2 (and gradients) or 3 (and parameters)"
            f"{extra}, got {zero!r}."
        )


def _times_pp(pp: int) -> str:
    return f" x pp={pp}" if pp > 1 else ""
