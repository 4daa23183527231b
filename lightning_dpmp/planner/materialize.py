"""Models bigger than one process: build on the meta device, split, then allocate only this rank's shards.

With ``Trainer.init_module(empty_init=True)`` (or ``configure_model`` under the strategy's init context) the dense
model is built on the ``meta`` device: shapes, no memory. The plan is traced on meta tensors, the layers are split
(still meta), and only then does each rank allocate and initialise what it holds.

Initialisation: every module's own ``reset_parameters()`` (torch's default distributions; the parallel layers use
the *dense* fan-in, so a shard has the distribution the dense layer would have), under a generator seeded from the
global seed and the module's name, and, for split layers, the MP rank. Replicated parameters are therefore equal
on every rank, shards differ across MP ranks, and DP replicas agree. The values are not those of a single-process
run (those would need the dense tensors this path exists to avoid), and custom initialisation written in a
model's ``__init__`` does not run on meta tensors: apply it in ``on_fit_start`` or load weights from a checkpoint.

Example:
    >>> materialize(lightning_module, torch.device("cpu"), seed=0, mp_rank=grid.mp_rank)   # doctest: +SKIP
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from lightning_dpmp.parallel.sharding import ParallelLinear

__all__ = ["is_meta", "materialize"]


def is_meta(module: nn.Module) -> bool:
    """Whether any parameter of ``module`` is on the meta device."""
    return any(p.is_meta for p in module.parameters())



def materialize(module: nn.Module, device: torch.device, seed: int, mp_rank: int) -> int:
    """Allocate every meta parameter/buffer of ``module`` on ``device`` and initialise it; returns elements made."""
    made = 0
    devices = [device.index or 0] if device.type == "cuda" else []
    for name, mod in module.named_modules():
        own = [t for t in list(mod.parameters(recurse=False)) + list(mod.buffers(recurse=False)) if t.is_meta]
        if not own:
            continue
        mod.to_empty(device=device, recurse=False)
        made += sum(t.numel() for t in own)
        split = isinstance(mod, ParallelLinear)
        key = f"{seed}:{name}:{mp_rank if split else 'replicated'}".encode()
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(zlib.crc32(key))
            if hasattr(mod, "reset_parameters"):
                mod.reset_parameters()
            else:
                raise RuntimeError(
                    f"{name or type(module).__name__} ({type(mod).__name__}) was built on the meta device but has no"
                    " reset_parameters() to initialise it; give it one, or build it outside"
                    " init_module(empty_init=True)."
                )
    return made
