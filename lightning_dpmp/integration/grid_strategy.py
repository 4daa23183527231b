"""The strategy's process grid: its topology resolved once, the DP-only sampler, and the DP/PP/MP process groups.

:class:`GridStrategy` is the part of :class:`~lightning_dpmp.DPMPStrategy` that knows nothing of models: it
resolves its :class:`~lightning_dpmp.parallel.topology.Topology` when the Trainer sets devices and nodes
(``set_world_ranks``, before any process starts),
installs the launcher, builds the :class:`~lightning_dpmp.parallel.grid.Grid` in ``setup_environment``, shards the
sampler over DP only, gives each MP group one batch (``batch_to_device``, :mod:`lightning_dpmp.integration.mp_batch`),
checks loader lengths at each run's first batch, and reduces and gathers over the DP group
(:mod:`lightning_dpmp.integration.data_path`). It owns every attribute it reads.

With ``dp="auto", mp="auto"`` only the world size is fixed before launch: the layout stays *pending*
(:attr:`layout_pending`; reading ``dp``/``mp`` raises a clear error), ``setup_environment`` initialises the world
group only, and the subclass chooses the split at setup, once it has traced the model, through :meth:`set_layout`,
which builds the DP/MP groups then (:mod:`lightning_dpmp.integration.autolayout`).

Example:
    >>> s = GridStrategy()
    >>> s.init_grid(dp=2, mp="auto")
    >>> s.grid_or_none is None   # built in setup_environment, once the processes exist
    True
"""

from __future__ import annotations

import warnings
from datetime import timedelta
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor
from typing_extensions import override

import lightning_dpmp.compat as compat
from lightning_dpmp.integration.data_path import (
    check_even_batches,
    first_batch_of_run,
    mute_prediction_writers,
    seed_workers_by_dp_rank,
    trainer_of,
)
from lightning_dpmp.integration.launcher import (
    DPMPScriptLauncher,
    close_gloo_groups_at_exit,
    die_with_parent,
    is_launched_rank,
)
from lightning_dpmp.integration.mp_batch import broadcast_batch, check_batch
from lightning_dpmp.integration.validate import check_backend, check_sync_batchnorm, warn_if_mp_spans_nodes
from lightning_dpmp.parallel.bridge import plain_value
from lightning_dpmp.parallel.grid import Grid, build_grid, device_mesh
from lightning_dpmp.parallel.topology import Size, Topology, check_parallel_size

__all__ = ["GridStrategy"]

MP_BATCH_MODES = ("broadcast", "check")


def check_mp_batch(mode: Any) -> None:
    """Refuse an unknown ``mp_batch`` mode, naming the ones there are."""
    if mode not in MP_BATCH_MODES:
        raise ValueError(
            f"`mp_batch` must be 'broadcast' (the first rank of each MP group sends its batch to the others) or"
            f" 'check' (one small all-reduce per step proves the MP ranks read the same batch), got {mode!r}."
        )


class GridStrategy(DDPStrategy):
    """``DDPStrategy`` over a dp x (pp x) mp grid (MP innermost: rank = (dp_rank * pp + pp_rank) * mp + mp_rank); no
    model logic. Its sizes are one :class:`~lightning_dpmp.parallel.topology.Topology`, resolved once."""

    _dp_arg: Size = "auto"
    _mp_arg: Size = "auto"
    _settings: Topology = Topology()  # pp, zero and the pipeline's settings, validated at construction
    _topology: Optional[Topology] = None  # resolved in set_world_ranks, once devices and nodes are known
    _grid: Optional[Grid] = None  # built in setup_environment (or in set_layout when the layout was pending)
    _device_mesh: Any = None  # made from _grid on first use
    _pending: bool = False  # dp="auto", mp="auto" (or pp/zero "auto"): the layout is chosen at setup (set_layout)
    _pp_auto: bool = False  # pp="auto": chosen at setup with the rest
    _zero_auto: bool = False  # zero="auto": chosen at setup with the rest
    _pipeline_args: dict[str, Any] = {}  # the pipeline's settings as given, for whatever pp > 1 is chosen
    _chosen: Optional[Topology] = None  # a measured choice, kept for later runs of the same strategy
    _layout_report: str = ""  # how the layout was chosen, for the plan printout
    _mp_batch: str = "broadcast"  # how the ranks of an MP group come to train on one batch (MP_BATCH_MODES)
    _warned_batch_layout: bool = False
    _undo_writers: Any = None

    def init_grid(self, dp: Size, mp: Size, settings: Optional[Topology] = None, pp_auto: bool = False,
                  zero_auto: bool = False, pipeline: Optional[dict[str, Any]] = None) -> None:
        """Record the requested sizes (``"auto"`` allowed for dp and mp) and the rest of the topology (``settings``:
        pp, zero and the pipeline's, already validated); refuse a bad value before anything starts.

        ``pp_auto``/``zero_auto``: ``pp``/``zero`` are chosen at setup (``settings`` then holds
        placeholders pp=1, zero=0); ``pipeline``: the pipeline's settings as given (``microbatches``, ``schedule``,
        ``stages_per_rank``), applied to whatever ``pp > 1`` is chosen."""
        check_parallel_size("dp", dp, allow_auto=True)
        check_parallel_size("mp", mp, allow_auto=True)
        settings = settings if settings is not None else Topology()
        self._dp_arg, self._mp_arg, self._settings = dp, mp, settings
        self._pp_auto, self._zero_auto = pp_auto, zero_auto
        self._pipeline_args = dict(pipeline) if pipeline is not None else {
            "microbatches": settings.microbatches if settings.pp > 1 else -1, "schedule": settings.schedule,
            "stages_per_rank": settings.stages_per_rank}
        self._topology, self._grid, self._pending, self._chosen, self._layout_report = None, None, False, None, ""

    @property
    def chooses_layout(self) -> bool:
        """Whether the layout is chosen at setup by measurement and the estimator rather than given: dp and mp both
        ``"auto"``, or pp or zero ``"auto"``."""
        return (self._dp_arg == "auto" and self._mp_arg == "auto") or self._pp_auto or self._zero_auto

    def _arguments(self) -> str:
        """The sizes as given, ``DPMPStrategy(dp='auto', mp=2, ...)`` style (pp/zero only when not the default)."""
        parts = [f"dp={self._dp_arg!r}", f"mp={self._mp_arg!r}"]
        if self._pp_auto or self._settings.pp > 1:
            parts.append("pp='auto'" if self._pp_auto else f"pp={self._settings.pp}")
        if self._zero_auto or self._settings.zero:
            parts.append("zero='auto'" if self._zero_auto else f"zero={self._settings.zero}")
        return "DPMPStrategy(" + ", ".join(parts) + ")"

    @property
    def layout_pending(self) -> bool:
        """True between launch and setup while a layout chosen at setup (:attr:`chooses_layout`) waits for its
        choice (:meth:`set_layout`)."""
        return self._pending

    @property
    def layout_report(self) -> str:
        """How the layout was chosen (the ranked table of ``mp="auto"``), ``""`` for given sizes."""
        return self._layout_report

    # ------------------------------------------------------------------ sizes and topology
    @property
    def topology(self) -> Topology:
        """The resolved :class:`~lightning_dpmp.parallel.topology.Topology` (dp, pp, mp, zero, the pipeline's
        settings), known once the Trainer has set devices and nodes (``set_world_ranks``)."""
        if self._pending:
            what = "dp and mp" if not (self._pp_auto or self._zero_auto) else "the layout (dp, pp, mp, zero)"
            raise RuntimeError(
                f"{self._arguments()} chooses {what} at setup, after tracing the model and measuring the links; they"
                " are not known before Trainer.fit/validate/test/predict reaches the strategy's setup (give the"
                " sizes as integers to know them earlier)."
            )
        if self._topology is None:
            raise RuntimeError("DPMPStrategy's dp and mp are resolved when the Trainer sets devices and num_nodes.")
        return self._topology

    @property
    def dp(self) -> int:
        """Resolved data-parallel size."""
        return self.topology.dp

    @property
    def mp(self) -> int:
        """Resolved tensor-parallel size."""
        return self.topology.mp

    @property
    def pp(self) -> int:
        """Pipeline stages (1: no pipeline); known from construction unless ``pp="auto"`` (then from setup)."""
        return self.topology.pp if self._pp_auto or self._topology is not None else self._settings.pp

    @property
    def zero(self) -> int:
        """The ZeRO level (0: off; 1/2: optimizer state and gradients; 3: + parameters): given to the constructor,
        or chosen at setup with ``zero="auto"``."""
        return self.topology.zero if self._zero_auto or self._topology is not None else self._settings.zero

    @property
    def grid(self) -> Grid:
        """This rank's :class:`Grid` (process groups and coordinates); available after ``setup_environment``."""
        if self._grid is None:
            raise RuntimeError(
                "DPMPStrategy.grid is built in setup_environment(); it is not available before fit/validate starts."
            )
        return self._grid

    @property
    def device_mesh(self) -> Any:
        """The grid as torch's 3-D ``DeviceMesh``, dims ``("dp", "pp", "mp")`` (``"pp"`` of size 1 without a
        pipeline), over :attr:`grid`'s groups, for torch's DTensor and DCP tools (as
        ``ModelParallelStrategy.device_mesh``); available after ``setup_environment``.

        Example:
            >>> mesh = trainer.strategy.device_mesh                              # doctest: +SKIP
            >>> mesh["mp"].get_group() is trainer.strategy.grid.mp_group        # doctest: +SKIP
            True
        """
        if self._device_mesh is None:
            self._device_mesh = device_mesh(self.grid, self.root_device.type)
        return self._device_mesh

    @property
    def grid_or_none(self) -> Optional[Grid]:
        """:attr:`grid`, or ``None`` before ``setup_environment``."""
        return self._grid

    @property
    def timeout(self) -> timedelta:
        """The process-group timeout (``DPMPStrategy(timeout=...)``, 10 minutes by default)."""
        return compat.ddp_timeout(self)

    @property
    def dp_rank(self) -> int:
        """Index of this rank's data shard (also the DistributedSampler rank)."""
        return self.topology.coords(self.global_rank).dp_rank

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage (0 without a pipeline)."""
        return self.topology.coords(self.global_rank).pp_rank

    @property
    def mp_rank(self) -> int:
        return self.topology.coords(self.global_rank).mp_rank

    @property
    def dp_size(self) -> int:
        """Number of data shards (= ``dp``): shard an IterableDataset by ``dp_rank`` of ``dp_size``."""
        return self.dp

    @override
    def set_world_ranks(self) -> None:
        # Called by the Trainer's connector as soon as devices and num_nodes are known: before any process starts.
        if self.parallel_devices:
            check_backend(self.process_group_backend, self.parallel_devices)
            world = self.num_processes * self.num_nodes
            if self._chosen is not None and self._chosen.world_size != world:
                self._chosen = None  # chosen for another world size (a new Trainer): choose again
            if self.chooses_layout and self._chosen is None:
                self._topology, self._pending = None, True  # any world splits; the split is chosen at setup
            else:
                self._topology = self._chosen or Topology.resolve(
                    self._dp_arg, self._mp_arg, world, devices=self.num_processes, num_nodes=self.num_nodes,
                    **self._settings.settings())
                self._pending = False
                if self._chosen is not None:
                    self._layout_report = (f"  layout: {self._chosen}, kept from this strategy's earlier"
                                           " mp='auto' choice")
                # The connector sets the layer sync just before this call.
                check_sync_batchnorm(compat.layer_sync(self), self.mp)
        super().set_world_ranks()

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # All ranks of an MP group read the same batch: the sampler shards over DP only.
        return {"num_replicas": self.dp, "rank": self.dp_rank}

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if compat.start_method(self) == "popen":
            compat.set_launcher(self, DPMPScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes))
        else:
            super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        if is_launched_rank(self.cluster_environment, self.local_rank):
            die_with_parent()  # a rank whose launcher has gone must not live on as an orphan (launcher.py)
        super().setup_environment()  # initialises the default process group
        close_gloo_groups_at_exit()
        if not self._pending:  # else the groups are built in set_layout, once the subclass has chosen (dp, mp)
            self._build_grid()

    def set_layout(self, dp: int, mp: int, report: str = "", keep: bool = False, pp: Optional[int] = None,
                   zero: Optional[int] = None) -> None:
        """Fix a pending layout at ``dp`` x ``pp`` x ``mp`` (``pp``/``zero``: the chosen ones where they were
        ``"auto"``, else the given ones) and build its groups (collective over the world: every rank, same layout).

        ``keep``: later runs of this strategy (``fit`` then ``validate``) reuse it instead of choosing again.
        """
        self._topology = self.layout_of(dp, mp, pp, zero)
        self._pending, self._layout_report = False, report
        if keep:
            self._chosen = self._topology
        self._build_grid()

    def layout_of(self, dp: int, mp: int, pp: Optional[int] = None, zero: Optional[int] = None) -> Topology:
        """The full topology of a candidate: these sizes with the constructor's other settings (a ``ValueError``
        where the pipeline's settings do not suit this ``pp``, e.g. interleaved micro-batches).

        Example:
            >>> s = GridStrategy()
            >>> s.init_grid("auto", "auto", pp_auto=True, pipeline={"schedule": "gpipe"})
            >>> s.layout_of(1, 2, pp=2)
            Topology(dp=1, mp=2, pp=2, zero=0, microbatches=2, schedule='gpipe', stages_per_rank=1)
        """
        pp = self._settings.pp if pp is None else pp
        zero = self._settings.zero if zero is None else zero
        return Topology(dp=dp, mp=mp, pp=pp, zero=zero, **(self._pipeline_args if pp > 1 else {}))

    def _build_grid(self) -> None:
        topology = self.topology
        warn_if_mp_spans_nodes(topology.mp, self.num_processes, self.num_nodes)
        # subgroups do not inherit the world's timeout
        self._grid, self._device_mesh = build_grid(topology, timeout=self.timeout), None

    # ------------------------------------------------------------------ the data path
    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        if self._grid is not None and self._grid.batch_width > 1:
            seed_workers_by_dp_rank(dataloader, self._grid.dp_rank)  # before Lightning seeds them by global rank
        return dataloader

    @override
    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        """Move the batch, check at the first batch of an epoch or evaluation run that every rank will run as many
        batches, and give the ranks of an MP group one batch (``mp_batch``)."""
        batch = super().batch_to_device(batch, device, dataloader_idx)
        grid = self._grid
        trainer = trainer_of(self.lightning_module)
        if grid is None or trainer is None or grid.world_size == 1:
            return batch
        first = first_batch_of_run(trainer)
        if first is not None:
            check_even_batches(first[1], first[0], grid, self.root_device)
        if grid.batch_width == 1:
            return batch
        # the ranks of an MP group (with a pipeline: of the whole row of stages) train on one batch
        if self._mp_batch == "check":
            check_batch(batch, grid.batch_group, self.root_device,
                        where=f" (rank {grid.rank}, dp_rank {grid.dp_rank})")
            return batch
        batch, same_layout = broadcast_batch(batch, grid.batch_group, src=grid.batch_src)
        if not same_layout and not self._warned_batch_layout and grid.rank == grid.batch_src:
            self._warned_batch_layout = True
            warnings.warn(
                f"DPMPStrategy: the ranks of MP group {grid.dp_rank} read batches of different structure or shapes;"
                f" each trains on MP rank 0's batch (global rank {grid.batch_src}), sent as a pickled object"
                " (slower). Give every rank of an MP group the same samples (seed by trainer.strategy.dp_rank).",
                stacklevel=2,
            )
        return batch

    @override
    def on_predict_start(self) -> None:
        trainer = trainer_of(self.lightning_module)
        if self._grid is not None and trainer is not None:
            # one writer per DP replica: the first rank of its MP group (and of its pipeline)
            first = self._grid.rank == self._grid.batch_src
            self._undo_writers = mute_prediction_writers(trainer.callbacks, 0 if first else 1)
        super().on_predict_start()

    @override
    def on_predict_end(self) -> None:
        if self._undo_writers is not None:
            self._undo_writers()
            self._undo_writers = None
        super().on_predict_end()

    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        """Gather over the DP group by default: the ranks of an MP group hold the same samples, so the world would
        return each of them ``mp`` times. ``LightningModule.all_gather`` comes here with ``group=WORLD`` when given
        none, so the world group means the default too; gather over every rank with ``torch.distributed`` itself."""
        if (group is None or group is dist.group.WORLD) and self._grid is not None:
            group = self._grid.dp_group
        return super().all_gather(plain_value(tensor), group=group, sync_grads=sync_grads)

    # ------------------------------------------------------------------ reductions
    @override
    def reduce(
        self, tensor: Union[Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Union[Any, str]] = "mean"
    ) -> Union[Tensor, Any]:
        """Reduce across the DP group by default: MP ranks hold the same values, so the world would count each mp
        times."""
        if group is None and self._grid is not None:
            group = self._grid.dp_group
        # a value computed from DTensor parameters (a logged L2 term) reduces as the plain value one process holds
        return super().reduce(plain_value(tensor), group=group, reduce_op=reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        # Decisions (early stopping, checkpointing) must agree on every rank: reduce over the whole world.
        if not compat.distributed_is_initialized():
            return decision
        t = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return bool(t == self.world_size) if all else bool(t)

