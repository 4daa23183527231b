"""The data path over a dp x mp grid: worker seeds by DP rank, loader lengths agreed before a step can hang, and
prediction writers that write once per DP rank.

* Lightning seeds each loader worker (``seed_everything(..., workers=True)``) from the *global* rank, so the ranks of
  one MP group, which must read the same samples, draw different augmentations. :func:`seed_workers_by_dp_rank`
  installs Lightning's own worker init function keyed on the DP rank instead.
* A rank whose loader is one batch shorter than its peers' leaves them waiting in a collective until the
  process-group timeout, with a message that does not name the cause. :func:`check_even_batches` compares the
  number of batches every rank will run, once at the first batch of every epoch or evaluation run, and raises on
  every rank together with the numbers.
* A ``BasePredictionWriter`` runs on every rank, and the ranks of an MP group predict the same samples:
  :func:`mute_prediction_writers` lets only MP rank 0 of each group write.

Example:
    >>> check_even_batches([4], "train", grid=None, device=torch.device("cpu"))   # one process: nothing to compare
"""

from __future__ import annotations

import math
import os
from functools import partial
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import pl_worker_init_function
from lightning.pytorch.callbacks import BasePredictionWriter

__all__ = [
    "UnevenBatchesError",
    "check_even_batches",
    "first_batch_of_run",
    "mute_prediction_writers",
    "seed_workers_by_dp_rank",
    "trainer_of",
]


class UnevenBatchesError(RuntimeError):
    """Raised on every rank together when the ranks would run different numbers of batches."""


def seed_workers_by_dp_rank(loader: Any, dp_rank: int) -> bool:
    """Give ``loader`` Lightning's worker init function keyed on ``dp_rank`` where Lightning would add its own
    (``PL_SEED_WORKERS`` set by ``seed_everything(workers=True)``, no user ``worker_init_fn``); returns whether it
    did. The ranks of an MP group then seed their workers alike; DP ranks still differ."""
    if not int(os.environ.get("PL_SEED_WORKERS", 0)) or getattr(loader, "worker_init_fn", False) is not None:
        return False
    loader.worker_init_fn = partial(pl_worker_init_function, rank=dp_rank)
    return True


def _as_int(n: Any) -> int:
    return -1 if n is None or (isinstance(n, float) and math.isinf(n)) else int(n)  # -1: unsized (iterable)


def check_even_batches(counts: Sequence[Any], where: str, grid: Any, device: torch.device) -> None:
    """Raise :class:`UnevenBatchesError` on every rank when the ranks' batch counts differ (collective over the
    world: one all-gather of ``len(counts)`` int64 per rank).

    Args:
        counts: the number of batches of each dataloader this rank will run (``inf`` or ``None`` for unsized).
        where: the stage, for the message ("training epoch 3", "validation").
        grid: the :class:`~lightning_dpmp.parallel.grid.Grid` (for naming ranks); ``None`` outside a world.
    """
    if grid is None or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = torch.tensor([_as_int(n) for n in counts] or [0], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    table = [t.tolist() for t in every]
    if all(row == table[0] for row in table):
        return
    topology = grid.topology

    def coords(r: int) -> str:
        at = topology.coords(r)
        stage = f", pp_rank {at.pp_rank}" if topology.pp > 1 else ""
        return f"dp_rank {at.dp_rank}{stage}, mp_rank {at.mp_rank}"

    shown = "; ".join(
        f"rank {r} ({coords(r)}): " + ", ".join("unsized" if n < 0 else str(n) for n in row)
        for r, row in enumerate(table)
    )
    raise UnevenBatchesError(
        f"DPMPStrategy: the ranks would run different numbers of batches in {where} ({shown}); the shorter ranks"
        " would stop while the others wait in a collective until the timeout. Every rank must run the same number of"
        " batches: let Lightning's DistributedSampler shard the data (use_distributed_sampler=True), make a custom"
        " sampler or IterableDataset give each DP rank (trainer.strategy.dp_rank of dp_size) the same length, and"
        " give the ranks of an MP group identical loaders; or set limit_*_batches to the shortest."
    )


def _skip_write(*args: Any, **kwargs: Any) -> None:
    """What a prediction writer does on MP ranks other than 0: nothing (MP rank 0 holds the same predictions)."""


def mute_prediction_writers(callbacks: Sequence[Any], mp_rank: int) -> Callable[[], None]:
    """On MP ranks other than 0, make every :class:`BasePredictionWriter` skip its writes (MP rank 0 of each group
    writes its DP rank's predictions once); returns a function that undoes it."""
    if mp_rank == 0:
        return lambda: None
    names = ("write_on_batch_end", "write_on_epoch_end")
    muted: list[tuple[Any, dict[str, Any]]] = []
    for cb in callbacks:
        if isinstance(cb, BasePredictionWriter):
            saved: dict[str, Any] = {k: cb.__dict__[k] for k in names if k in cb.__dict__}
            for k in names:  # instance attributes shadow the methods; the class is left alone
                setattr(cb, k, _skip_write)
            muted.append((cb, saved))

    def undo() -> None:
        for cb, saved in muted:
            for k in names:
                cb.__dict__.pop(k, None)
            cb.__dict__.update(saved)

    return undo


def trainer_of(module: Any) -> Any:
    """The Trainer ``module`` is attached to, or ``None``."""
    try:
        return module.trainer if module is not None else None
    except RuntimeError:  # LightningModule.trainer raises when not attached
        return None


def first_batch_of_run(trainer: Any) -> Optional[tuple[str, list[Any]]]:
    """``(where, batch counts)`` when the loop about to run its step is at the first batch of its epoch or
    evaluation run (its ``batch_progress`` has readied none), else ``None``."""
    if trainer.training:
        loop, counts, where = trainer.fit_loop.epoch_loop, [trainer.num_training_batches], "training epoch"
        where += f" {trainer.current_epoch}"
    elif trainer.sanity_checking:
        loop, counts, where = trainer.fit_loop.epoch_loop.val_loop, trainer.num_sanity_val_batches, "the sanity check"
    elif trainer.validating:
        fitting = trainer.state.fn == "fit"
        loop = trainer.fit_loop.epoch_loop.val_loop if fitting else trainer.validate_loop
        counts, where = trainer.num_val_batches, "validation"
    elif trainer.testing:
        loop, counts, where = trainer.test_loop, trainer.num_test_batches, "test"
    elif trainer.predicting:
        loop, counts, where = trainer.predict_loop, trainer.num_predict_batches, "predict"
    else:
        return None
    if loop.batch_progress.current.ready != 0:
        return None
    return where, list(counts)
