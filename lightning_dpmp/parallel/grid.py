"""The process grid: this rank's coordinates in a :class:`~lightning_dpmp.parallel.topology.Topology` and the
process groups of its axes (DP, MP, and with a pipeline PP and rows), and the grid as one N-D ``DeviceMesh``.

The sizes and the rank arithmetic are the topology's (``rank = (dp_rank * pp + pp_rank) * mp + mp_rank``, MP
innermost); this module only creates the groups. Nothing here is global: :func:`build_grid` returns a :class:`Grid`
that callers pass on explicitly.

Example:
    >>> grid = Grid(Topology(dp=2, mp=2, pp=2), rank=6)    # groups None: no process group needed to read it
    >>> grid.dp_rank, grid.pp_rank, grid.mp_rank, grid.batch_src
    (1, 1, 0, 4)
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

import lightning_dpmp.compat as compat
from lightning_dpmp.parallel.topology import Topology

__all__ = ["DEFAULT_TIMEOUT", "Grid", "build_grid", "device_mesh"]

#: The process-group timeout of the strategies when given ``timeout=None``: shorter than torch's 30 minutes, so a
#: collective that one rank never joins fails in minutes.
DEFAULT_TIMEOUT = timedelta(seconds=600)


@dataclass(frozen=True)
class Grid:
    """One rank's view of the ``dp x (pp x) mp`` grid: its :class:`Topology`, its rank and the groups it belongs to.

    Attributes:
        topology: the degrees and settings of the run (``grid.dp``, ``grid.mp``, ``grid.pp`` read it).
        rank: this process's global rank.
        dp_group: the ranks holding the same shards on other data (gradients are averaged here).
        mp_group: the ranks sharing one batch and splitting the weights (activations cross here).
        pp_group: the ranks holding the stages of this replica at this ``mp_rank`` (activations pass stage to
            stage); ``None`` without a pipeline.
        row_group: every rank of this DP replica (``pp * mp`` ranks, one batch); ``None`` without a pipeline.

    Example:
        >>> grid = build_grid(Topology(dp=2, mp=2))      # inside an initialised process group  # doctest: +SKIP
        >>> layer = ColumnParallelLinear.from_dense(nn.Linear(8, 8), grid.mp_group)  # doctest: +SKIP
    """

    topology: Topology
    rank: int
    dp_group: Any = None
    mp_group: Any = None
    pp_group: Any = None
    row_group: Any = None

    @property
    def dp(self) -> int:
        return self.topology.dp

    @property
    def mp(self) -> int:
        return self.topology.mp

    @property
    def pp(self) -> int:
        return self.topology.pp

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def dp_rank(self) -> int:
        return self.topology.coords(self.rank).dp_rank

    @property
    def mp_rank(self) -> int:
        return self.topology.coords(self.rank).mp_rank

    @property
    def pp_rank(self) -> int:
        return self.topology.coords(self.rank).pp_rank

    @property
    def batch_group(self) -> Any:
        """The ranks that train on one batch: the MP group, or the whole row when there is a pipeline."""
        return self.row_group if self.pp > 1 else self.mp_group

    @property
    def batch_src(self) -> int:
        """Global rank of the first rank of :attr:`batch_group` (the one whose batch the others take)."""
        return self.topology.rank_of(self.dp_rank, 0, 0)

    @property
    def batch_width(self) -> int:
        """Ranks in :attr:`batch_group` (``pp * mp``)."""
        return self.topology.row_size

    def __str__(self) -> str:
        stage = f", pp_rank={self.pp_rank}" if self.pp > 1 else ""
        pp = f", pp={self.pp}" if self.pp > 1 else ""
        return (f"Grid(dp={self.dp}{pp}, mp={self.mp}, rank={self.rank} -> dp_rank={self.dp_rank}{stage},"
                f" mp_rank={self.mp_rank})")


def build_grid(topology: Topology, timeout: Optional[timedelta] = None) -> Grid:
    """Create the MP and DP groups (and with ``pp > 1`` the PP groups and rows) of ``topology`` in an initialised
    default process group and return this rank's :class:`Grid`.

    Every rank must call this, in the same order: ``new_group`` is collective over the world even for groups a
    rank does not belong to, and a rank that skips one leaves the others waiting.

    ``timeout`` bounds every collective on the groups. Pass the world's: ``new_group`` does not inherit it and
    would default to torch's 30 minutes, so a stuck MP all-reduce would ignore ``DPMPStrategy(timeout=...)``.

    Example:
        >>> grid = build_grid(Topology(dp=2, mp=2))    # doctest: +SKIP
        >>> grid.dp_rank, grid.mp_rank                 # doctest: +SKIP
        (1, 0)
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("build_grid() needs an initialised torch.distributed process group.")
    topology.check_world(dist.get_world_size())
    rank = dist.get_rank()

    def mine(all_ranks: list[list[int]]) -> Any:  # every rank creates every group, in the same order
        found = None
        for ranks in all_ranks:
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                found = group
        return found

    mp_group, dp_group = mine(topology.mp_groups()), mine(topology.dp_groups())
    pp_group = row_group = None
    if topology.pp > 1:
        pp_group, row_group = mine(topology.pp_groups()), mine(topology.rows())
    return Grid(topology, rank, dp_group=dp_group, mp_group=mp_group, pp_group=pp_group, row_group=row_group)


def device_mesh(grid: Grid, device_type: str) -> Any:
    """The grid as torch's 3-D ``DeviceMesh`` with dims ``("dp", "pp", "mp")`` over the grid's own groups:
    ``mesh["dp"].get_group()`` is ``grid.dp_group``, so DTensor and DCP tools run on our groups. Without a pipeline
    the ``"pp"`` dim has size 1 (a one-rank group, made here by this rank alone).

    Example:
        >>> mesh = device_mesh(grid, "cpu")               # doctest: +SKIP
        >>> mesh.shape, mesh.mesh_dim_names               # doctest: +SKIP
        ((2, 1, 2), ('dp', 'pp', 'mp'))
    """
    from torch.distributed.device_mesh import DeviceMesh

    # DTensor caches shardings by mesh equality, which ignores the groups: an earlier job's mesh of the same shape
    # would lend this one its (destroyed) groups
    compat.clear_dtensor_sharding_cache()
    topo = grid.topology
    pp_group = grid.pp_group if topo.pp > 1 else dist.new_group([grid.rank], use_local_synchronization=True)
    ranks = torch.arange(topo.world_size).view(topo.dp, topo.pp, topo.mp)  # rank = (dp * pp + pp_rank) * mp + mp
    return DeviceMesh.from_group([grid.dp_group, pp_group, grid.mp_group], device_type, mesh=ranks,
                                 mesh_dim_names=("dp", "pp", "mp"))
