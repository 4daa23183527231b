"""Fail before anything starts: configuration checks that run when the ``Trainer`` is built, and a data warning.

Each check raises (or warns) with the numbers involved and the fix, before any process is launched or any
collective is issued, because a bad configuration found inside a collective is a hang, not an error.

* :func:`check_backend`: ``process_group_backend="nccl"`` on CPU devices (NCCL would fail or hang at init).
* :func:`check_sync_batchnorm`: ``sync_batchnorm=True`` with ``mp > 1`` (each batch would be counted mp times).
* :func:`warn_if_data_not_sharded`: ``use_distributed_sampler=False`` or an ``IterableDataset`` with ``dp > 1``:
  Lightning cannot shard such data, so the user must, by ``strategy.dp_rank`` / ``strategy.dp_size``.
* :func:`die_with_parent`: a rank started by a launcher (Lightning's popen launcher, torchrun) is killed by the
  kernel when its launcher dies, so that a rank stuck outside any collective cannot outlive the job as an orphan.

What happens when a rank fails at run time is measured in ``tests/integration/test_reliability.py``: gloo raises
"Connection closed by peer" on the survivors as soon as the failed process is gone, Lightning's launcher (or
torchrun's agent) kills the rest, and the process-group timeout (``DPMPStrategy(timeout=...)``) bounds the
remaining case, a peer that is alive but never joins the collective.

Example:
    >>> check_backend("gloo", [torch.device("cpu")] * 4)
    >>> check_sync_batchnorm(None, mp=2)
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import signal
import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment, TorchElasticEnvironment
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader, IterableDataset  # noqa: F401  (DataLoader: doctest)

__all__ = [
    "DataShardingWarning",
    "check_backend",
    "check_sync_batchnorm",
    "close_gloo_groups_at_exit",
    "die_with_parent",
    "is_launched_rank",
    "loaders_of",
    "warn_if_data_not_sharded",
    "warn_if_mp_spans_nodes",
]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class DataShardingWarning(UserWarning):
    """The training data is not sharded by Lightning; each DP rank must read its own part."""


def check_backend(backend: Optional[str], devices: Sequence[torch.device]) -> None:
    """Refuse NCCL for non-CUDA devices, or where this torch build has no NCCL.

    Example:
        >>> check_backend("nccl", [torch.device("cpu")] * 2)
        Traceback (most recent call last):
        ...
        ValueError: process_group_backend='nccl' needs CUDA devices, but the Trainer runs on 2 cpu device(s). ...
    """
    if backend != "nccl":
        return
    kinds = sorted({d.type for d in devices})
    if kinds != ["cuda"]:
        raise ValueError(
            f"process_group_backend='nccl' needs CUDA devices, but the Trainer runs on {len(devices)}"
            f" {'/'.join(kinds)} device(s). Use process_group_backend='gloo' (or leave it unset: gloo on CPU, nccl on"
            " CUDA), or Trainer(accelerator='gpu')."
        )
    if not (dist.is_available() and dist.is_nccl_available()):
        raise ValueError(
            f"process_group_backend='nccl', but this torch build ({torch.__version__}) has no NCCL. Install a CUDA"
            " build of torch, or use process_group_backend='gloo'."
        )


def check_sync_batchnorm(layer_sync: Any, mp: int) -> None:
    """Refuse ``Trainer(sync_batchnorm=True)`` with ``mp > 1`` (statistics would be synchronised over the world).

    Example:
        >>> check_sync_batchnorm(object(), mp=2)
        Traceback (most recent call last):
        ...
        ValueError: sync_batchnorm=True is not supported with mp=2: BatchNorm statistics would be synchronised ...
    """
    if layer_sync is not None and mp > 1:
        raise ValueError(
            f"sync_batchnorm=True is not supported with mp={mp}: BatchNorm statistics would be synchronised over the"
            f" whole world, where the mp={mp} ranks of an MP group hold the same batch, so each sample would count"
            f" {mp} times. Use Trainer(sync_batchnorm=False), or mp=1."
        )


def loaders_of(obj: Any) -> list[Any]:
    """The dataloaders inside ``trainer.train_dataloader``'s structure (mappings, sequences, a CombinedLoader)."""
    if isinstance(obj, Mapping):
        return [x for v in obj.values() for x in loaders_of(v)]
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in loaders_of(v)]
    if hasattr(obj, "flattened"):  # Lightning's CombinedLoader
        return loaders_of(list(obj.flattened))
    return [] if obj is None else [obj]


def warn_if_data_not_sharded(loaders: Any, use_distributed_sampler: bool, dp: int, mp: int) -> Optional[str]:
    """Warn (and return the message) when the training data cannot have been sharded over DP by Lightning.

    Example:
        >>> warn_if_data_not_sharded(DataLoader(range(8)), use_distributed_sampler=True, dp=2, mp=2) is None
        True
    """
    if dp == 1:
        return None  # a single replica reads everything; MP ranks read the same loader with the same seed
    iterable = [dl for dl in loaders_of(loaders) if isinstance(getattr(dl, "dataset", None), IterableDataset)]
    if iterable:
        kind = type(iterable[0].dataset).__name__
        why = f"the training data is an IterableDataset ({kind}), which no sampler can shard"
    elif not use_distributed_sampler:
        why = "Trainer(use_distributed_sampler=False) leaves the DataLoaders as given"
    else:
        return None
    msg = (
        f"DPMPStrategy(dp={dp}, mp={mp}): {why}. The data must be sharded by DP rank: give each of the dp={dp}"
        " replicas a different part (`trainer.strategy.dp_rank` in 0..dp-1 and `trainer.strategy.dp_size`), and the"
        f" same batches to the mp={mp} ranks of one MP group (those with the same dp_rank). Otherwise every replica"
        " trains on the same samples. `check_consistency_every_n_steps` verifies the MP side."
    )
    warnings.warn(msg, DataShardingWarning, stacklevel=2)
    return msg


def die_with_parent() -> bool:
    """Ask Linux to SIGKILL this process when its parent exits; returns whether that is now in place.

    Call it only in a process whose parent is a launcher (never in the main process: a training started with
    ``nohup`` would die with its shell). Lightning's popen launcher kills its children only on Ctrl-C, so when
    rank 0 fails and exits, a rank that is not waiting on rank 0 (stuck in a dataloader or a long computation)
    would otherwise live on. Elsewhere than Linux this is a no-op, and ``timeout`` bounds the wait instead.

    Example:
        >>> die_with_parent() if False else None   # in a launched rank: True on Linux
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() == 1:  # the parent died before the request: it will never fire
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def close_gloo_groups_at_exit() -> None:
    """Have this process destroy its gloo process groups when the interpreter exits, while it is still whole
    (registered once per process, however often it is called).

    Left to the interpreter's teardown, gloo's threads were sometimes destroyed while still joinable: "terminate
    called without an active exception", a SIGABRT after all the work was done (seen in torchrun and two-node launches
    on 2 busy cores). NCCL groups are left alone. A process dying of an uncaught exception (``sys.excepthook`` ran)
    leaves at once with exit code 1, its output and log handlers flushed, past the interpreter's teardown: destroying
    a group that still has work queued for a dead peer can block, and gloo's threads torn down by the interpreter
    turned that exit code 1 into a SIGABRT (-6) now and then.

    Example:
        >>> close_gloo_groups_at_exit()   # in setup_environment, once the process group exists
    """
    if not isinstance(sys.excepthook, _ExitWatch):
        sys.excepthook = _ExitWatch(sys.excepthook)
    atexit.unregister(_close_gloo_groups)  # at most one registration
    atexit.register(_close_gloo_groups)


class _ExitWatch:
    """``sys.excepthook`` wrapper noting that the process dies of an uncaught exception (then the previous hook)."""

    def __init__(self, previous: Any) -> None:
        self.previous, self.dying = previous, False

    def __call__(self, kind: Any, value: Any, tb: Any) -> None:
        self.dying = not issubclass(kind, KeyboardInterrupt)  # (Ctrl-C keeps Python's own exit)
        self.previous(kind, value, tb)


def _close_gloo_groups() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        return
    if isinstance(sys.excepthook, _ExitWatch) and sys.excepthook.dying:  # a peer may be stuck: leave at once
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(1)
    if getattr(sys, "last_value", None) is not None:  # an exception shown elsewhere (a debugger, a test runner)
        return
    try:
        if dist.get_backend() == "gloo":
            dist.destroy_process_group()
    except Exception:  # exiting anyway: a group that cannot be closed must not turn a clean exit into an error
        pass


def is_launched_rank(environment: Any, local_rank: int) -> bool:
    """Whether this process was started by a launcher that owns it: a torchrun worker, or a popen child
    (local rank > 0).

    Example:
        >>> is_launched_rank(LightningEnvironment(), 0)
        False
    """
    if isinstance(environment, TorchElasticEnvironment):
        return True
    return type(environment) is LightningEnvironment and environment.creates_processes_externally and local_rank > 0


def warn_if_mp_spans_nodes(mp: int, devices_per_node: int, num_nodes: int) -> None:
    """MP groups are consecutive ranks: if mp does not divide the devices of a node, some groups cross nodes."""
    if mp > 1 and devices_per_node % mp and num_nodes > 1:
        rank_zero_warn(
            f"mp={mp} does not divide the {devices_per_node} devices per node: MP groups span nodes, and every"
            " tensor-parallel all-reduce crosses the slower inter-node link."
        )
