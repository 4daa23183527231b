"""The process grid: ``dp`` rows of data parallelism times ``mp`` columns of tensor model parallelism, and, with
pipeline parallelism, ``pp`` stages between them (``dp x pp x mp``).

Ranks are laid out with MP innermost, ``rank = dp_rank * mp + mp_rank``, so that the ``mp`` ranks of one MP
group are consecutive and, with Lightning's node-major rank order, sit on one node::

    dp=2, mp=4         mp_rank 0  1  2  3
        dp_rank 0:  ranks      0  1  2  3   <- one MP group (same batch, 1/mp of each split weight)
        dp_rank 1:  ranks      4  5  6  7
                               ^ one DP group per column: {0,4}, {1,5}, {2,6}, {3,7} (gradients averaged)

With ``pp > 1`` the order is MP innermost, then PP, then DP: ``rank = (dp_rank * pp + pp_rank) * mp + mp_rank``.
An MP group still holds consecutive ranks (one node); a PP group (the ranks holding the stages of one model replica
at one ``mp_rank``) is ``{(d * pp + s) * mp + m for s}``; a DP group the same ``(pp_rank, mp_rank)`` on each row; and a
*row* all ``pp * mp`` ranks of one DP replica (they train on one batch)::

    dp=2, pp=2, mp=2    rows: {0,1,2,3} {4,5,6,7}; MP groups {0,1} {2,3} ...; PP groups {0,2} {1,3} {4,6} {5,7};
                        DP groups {0,4} {1,5} {2,6} {3,7}

Nothing here is global: :func:`build_grid` returns a :class:`Grid` that callers pass on explicitly.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

__all__ = [
    "Grid", "build_grid", "check_parallel_size", "check_world_size", "coords_of", "device_mesh", "group_ranks",
    "pp_group_ranks", "pp_rank_of",
]


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


def check_world_size(dp: int, mp: int, world_size: int, *, devices: Optional[int] = None, num_nodes: int = 1,
                     pp: int = 1) -> None:
    """Raise a ``ValueError`` naming every number when ``dp * pp * mp`` does not match the processes available.

    Example:
        >>> check_world_size(2, 2, 4)
        >>> check_world_size(2, 2, 3, devices=3)
        Traceback (most recent call last):
        ...
        ValueError: DPMPStrategy(dp=2, mp=2) needs dp*mp = 4 processes, but devices=3 x num_nodes=1 = 3.
            Set devices*num_nodes = 4, or choose dp and mp with dp*mp = 3.
    """
    if dp * pp * mp == world_size:
        return
    need = dp * pp * mp
    if devices is not None:
        have = f"devices={devices} x num_nodes={num_nodes} = {world_size}"
        fix = f"Set devices*num_nodes = {need}"
    else:
        have = f"the process group has world size {world_size}"
        fix = f"Launch {need} processes (e.g. torchrun --nproc_per_node)"
    if pp == 1:
        raise ValueError(
            f"DPMPStrategy(dp={dp}, mp={mp}) needs dp*mp = {need} processes, but {have}."
            f" {fix}, or choose dp and mp with dp*mp = {world_size}."
        )
    raise ValueError(
        f"DPMPStrategy(dp={dp}, pp={pp}, mp={mp}) needs dp*pp*mp = {need} processes, but {have}."
        f" {fix}, or choose dp, pp and mp with dp*pp*mp = {world_size}."
    )


def coords_of(rank: int, mp: int, pp: int = 1) -> tuple[int, int]:
    """``(dp_rank, mp_rank)`` of a global rank; MP is the innermost (fastest-varying) axis, then PP.

    Example:
        >>> coords_of(5, mp=4)
        (1, 1)
        >>> coords_of(5, mp=2, pp=2)   # rank 5 = (1 * 2 + 0) * 2 + 1
        (1, 1)
    """
    return rank // (mp * pp), rank % mp


def pp_rank_of(rank: int, mp: int, pp: int) -> int:
    """The pipeline stage (``pp_rank``) of a global rank.

    Example:
        >>> pp_rank_of(6, mp=2, pp=2)   # rank 6 = (1 * 2 + 1) * 2 + 0
        1
    """
    return (rank // mp) % pp


def group_ranks(dp: int, mp: int, pp: int = 1) -> tuple[list[list[int]], list[list[int]]]:
    """All MP groups and all DP groups as lists of global ranks (with ``pp``: one MP group per (dp, pp) cell and one
    DP group per (pp, mp) cell).

    Example:
        >>> group_ranks(2, 2)
        ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
        >>> group_ranks(2, 1, pp=2)
        ([[0], [1], [2], [3]], [[0, 2], [1, 3]])
    """
    mp_groups = [[(d * pp + s) * mp + m for m in range(mp)] for d in range(dp) for s in range(pp)]
    dp_groups = [[(d * pp + s) * mp + m for d in range(dp)] for s in range(pp) for m in range(mp)]
    return mp_groups, dp_groups


def pp_group_ranks(dp: int, mp: int, pp: int) -> list[list[int]]:
    """All PP groups: the ``pp`` stages of one replica at one ``mp_rank``.

    Example:
        >>> pp_group_ranks(2, 2, 2)
        [[0, 2], [1, 3], [4, 6], [5, 7]]
    """
    return [[(d * pp + s) * mp + m for s in range(pp)] for d in range(dp) for m in range(mp)]


@dataclass(frozen=True)
class Grid:
    """One rank's view of the ``dp x (pp x) mp`` grid: its coordinates and the groups it belongs to.

    Attributes:
        dp: number of data-parallel replicas (rows).
        mp: tensor-model-parallel width (columns); every split weight is held 1/mp per rank.
        rank: this process's global rank.
        dp_group: the ranks holding the same shards on other data (gradients are averaged here).
        mp_group: the ranks sharing one batch and splitting the weights (activations cross here).
        pp: pipeline stages (1: no pipeline; the groups below are then ``None``).
        pp_group: the ranks holding the stages of this replica at this ``mp_rank`` (activations pass stage to stage).
        row_group: every rank of this DP replica (``pp * mp`` ranks, one batch).

    Example:
        >>> grid = build_grid(dp=2, mp=2)          # inside an initialised process group  # doctest: +SKIP
        >>> layer = ColumnParallelLinear.from_dense(nn.Linear(8, 8), grid.mp_group)  # doctest: +SKIP
    """

    dp: int
    mp: int
    rank: int
    dp_group: Any = None
    mp_group: Any = None
    pp: int = 1
    pp_group: Any = None
    row_group: Any = None

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.mp

    @property
    def dp_rank(self) -> int:
        return coords_of(self.rank, self.mp, self.pp)[0]

    @property
    def mp_rank(self) -> int:
        return coords_of(self.rank, self.mp, self.pp)[1]

    @property
    def pp_rank(self) -> int:
        return pp_rank_of(self.rank, self.mp, self.pp)

    @property
    def batch_group(self) -> Any:
        """The ranks that train on one batch: the MP group, or the whole row when there is a pipeline."""
        return self.row_group if self.pp > 1 else self.mp_group

    @property
    def batch_src(self) -> int:
        """Global rank of the first rank of :attr:`batch_group` (the one whose batch the others take)."""
        return self.dp_rank * self.pp * self.mp

    @property
    def batch_width(self) -> int:
        """Ranks in :attr:`batch_group` (``pp * mp``)."""
        return self.pp * self.mp

    def __str__(self) -> str:
        stage = f", pp_rank={self.pp_rank}" if self.pp > 1 else ""
        pp = f", pp={self.pp}" if self.pp > 1 else ""
        return (f"Grid(dp={self.dp}{pp}, mp={self.mp}, rank={self.rank} -> dp_rank={self.dp_rank}{stage},"
                f" mp_rank={self.mp_rank})")


def build_grid(dp: int, mp: int, timeout: Optional[timedelta] = None, pp: int = 1) -> Grid:
    """Create the MP and DP groups (and with ``pp > 1`` the PP groups and rows) of an initialised default process
    group and return this rank's :class:`Grid`.

    Every rank must call this, in the same order: ``new_group`` is collective over the world even for groups a
    rank does not belong to, and a rank that skips one leaves the others waiting.

    ``timeout`` bounds every collective on the two groups. Pass the world's: ``new_group`` does not inherit it and
    would default to torch's 30 minutes, so a stuck MP all-reduce would ignore ``DPMPStrategy(timeout=...)``.

    Example:
        >>> grid = build_grid(dp=2, mp=2)  # doctest: +SKIP
        >>> grid.dp_rank, grid.mp_rank     # doctest: +SKIP
        (1, 0)
    """
    check_parallel_size("dp", dp)
    check_parallel_size("mp", mp)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("build_grid() needs an initialised torch.distributed process group.")
    check_parallel_size("pp", pp)
    check_world_size(dp, mp, dist.get_world_size(), pp=pp)
    rank = dist.get_rank()
    mp_rows, dp_cols = group_ranks(dp, mp, pp)

    def mine(all_ranks: list[list[int]]) -> Any:  # every rank creates every group, in the same order
        found = None
        for ranks in all_ranks:
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                found = group
        return found

    mp_group, dp_group = mine(mp_rows), mine(dp_cols)
    pp_group = row_group = None
    if pp > 1:
        pp_group = mine(pp_group_ranks(dp, mp, pp))
        row_group = mine([list(range(d * pp * mp, (d + 1) * pp * mp)) for d in range(dp)])
    return Grid(dp=dp, mp=mp, rank=rank, dp_group=dp_group, mp_group=mp_group, pp=pp, pp_group=pp_group,
                row_group=row_group)


def device_mesh(grid: Grid, device_type: str) -> Any:
    """The grid as torch's 2-D ``DeviceMesh`` with dims ``("dp", "mp")``, over the grid's own groups (none is
    created): ``mesh["dp"].get_group()`` is ``grid.dp_group``, so DTensor and DCP tools run on our groups.

    Example:
        >>> mesh = device_mesh(grid, "cpu")               # doctest: +SKIP
        >>> mesh.shape, mesh.mesh_dim_names               # doctest: +SKIP
        ((2, 2), ('dp', 'mp'))
    """
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    if grid.pp > 1:
        raise RuntimeError(f"device_mesh is 2-D (dp, mp); this grid has pp={grid.pp} pipeline stages.")
    ranks = torch.arange(grid.world_size).view(grid.dp, grid.mp)  # rank = dp_rank * mp + mp_rank
    return DeviceMesh.from_group([grid.dp_group, grid.mp_group], device_type, mesh=ranks,
                                 mesh_dim_names=("dp", "mp"))
