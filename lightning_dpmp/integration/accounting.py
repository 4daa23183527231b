"""Count the collectives a block of code issues, by operation and process group, with the bytes they move.

Works like torch's ``CommDebugMode`` (a dispatch mode seeing every c10d call made from Python or autograd, forward
and backward) without its module tracking, so it can be entered in one Lightning hook and left in another. DDP's
C++ reducer is invisible to it, as to ``CommDebugMode``.

Example:
    >>> with CommCounter(names={"mp": grid.mp_group, "dp": grid.dp_group}) as c:   # doctest: +SKIP
    ...     loss = model(x).sum(); loss.backward()
    >>> c.counts                                                                    # doctest: +SKIP
    {('mp', 'all_reduce'): 2, ('mp', 'all_gather'): 1}
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from lightning_dpmp.compat import TorchDispatchMode, op_name, script_object_type, tree_leaves

__all__ = ["CommAccounting", "CommCounter"]

# c10d op name -> the name users know. The c10d ops are what the ``torch.distributed`` calls dispatch to (their
# names read from the dispatcher under torch 2.13; ``tests/distributed/test_layers.py`` counts each call once);
# the ``_c10d_functional`` ones are the traceable collectives (DTensor, compiled graphs).
_OPS = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "allgather_": "all_gather",
    "_allgather_base_": "all_gather",
    "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "reduce_scatter_": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "broadcast_": "broadcast",
    "reduce_": "reduce",
    "gather_": "gather",
    "scatter_": "scatter",
    "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all",
    "barrier": "barrier",
    "send": "send",
    "recv_": "recv",
    "recv_any_source_": "recv",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "isend": "send",
    "irecv": "recv",
}


def _group_name(group: Any) -> Optional[str]:
    """The c10d name of a ProcessGroup, also when the dispatcher hands it over boxed in a ScriptObject."""
    try:
        if isinstance(group, torch.ScriptObject):
            if "ProcessGroup" not in script_object_type(group):
                return None
            group = dist.ProcessGroup.unbox(group)
        return str(group.group_name)
    except Exception:
        return None


class CommCounter(TorchDispatchMode):
    """Count c10d collectives (and payload bytes) by ``(group label, operation)``.

    Args:
        names: ``{label: process group}``; a collective on another group is labelled ``"other"``.
    """

    def __init__(self, names: Optional[dict[str, Any]] = None) -> None:
        super().__init__()
        self._labels = {}
        for label, group in (names or {}).items():
            key = _group_name(group) if group is not None else None
            if key is not None:
                self._labels[key] = label
        self.counts: Counter = Counter()
        self.bytes: Counter = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        namespace, packet_name = op_name(func)
        op = _OPS.get(packet_name) if namespace in ("c10d", "_c10d_functional") else None
        if op is not None:
            leaves = tree_leaves((args, kwargs or {}))
            label = "other"
            for leaf in leaves:
                name = leaf if isinstance(leaf, str) else _group_name(leaf)
                if name is not None and name in self._labels:
                    label = self._labels[name]
                    break
            payload = sum(t.numel() * t.element_size() for t in leaves if isinstance(t, Tensor))
            self.counts[(label, op)] += 1
            self.bytes[(label, op)] += payload
        return func(*args, **(kwargs or {}))

    def summary(self) -> dict[str, int]:
        """Flat ``{"<group>/<op>_calls": n, "<group>/<op>_bytes": b}`` for logging."""
        out: dict[str, int] = {}
        for (label, op), n in self.counts.items():
            out[f"{label}/{op}_calls"] = n
            out[f"{label}/{op}_bytes"] = self.bytes[(label, op)]
        return out


class CommAccounting(Callback):
    """Log what each training step sends: ``comm/mp_calls``, ``comm/mp_bytes``, ``comm/dp_calls``,
    ``comm/dp_bytes`` (this rank's payload; forward, backward and optimizer step together).

    Args:
        every_n_steps: measure one step in this many (the dispatch mode costs a little Python per op).

    Example:
        >>> trainer = L.Trainer(strategy=DPMPStrategy(dp=2, mp=2), callbacks=[CommAccounting()])  # doctest: +SKIP
        >>> trainer.callback_metrics["comm/mp_calls"]                                            # doctest: +SKIP
    """

    def __init__(self, every_n_steps: int = 1) -> None:
        self.every_n_steps = every_n_steps
        self.counter: Optional[CommCounter] = None
        self.last: dict[str, int] = {}

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        grid = getattr(trainer.strategy, "grid_or_none", None)  # None: not a DPMPStrategy, or before setup
        if trainer.global_step % self.every_n_steps == 0 and grid is not None:
            self.counter = CommCounter({"mp": grid.mp_group, "dp": grid.dp_group})
            self.counter.__enter__()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.counter is None:
            return
        self.counter.__exit__(None, None, None)
        totals = {"mp_calls": 0, "mp_bytes": 0, "dp_calls": 0, "dp_bytes": 0}
        for (label, _), n in self.counter.counts.items():
            if label in ("mp", "dp"):
                totals[f"{label}_calls"] += n
                totals[f"{label}_bytes"] += self.counter.bytes[(label, _)]
        self.counter, self.last = None, totals
        # No sync_dist: logging must not add collectives to what it measures; each rank reports its own.
        pl_module.log_dict({f"comm/{k}": float(v) for k, v in totals.items()}, on_step=True, sync_dist=False)
