"""``DPMPStrategy(activation_checkpointing=...)``: which repeated blocks recompute their activations in the backward,
decided at setup, and the wrapping applied after the split (:mod:`lightning_dpmp.parallel.recompute`).

* ``None`` (default): nothing is recomputed.
* ``"blocks"``: every repeated block (the ZeRO engine's units: children of ``nn.ModuleList``/``nn.Sequential``
  that own parameters), as Lightning's FSDP strategy does through an ``activation_checkpointing_policy``.
* ``"auto"``: the fewest blocks per pipeline stage (the first ``k`` of each) whose peak, as the layout estimator
  predicts it (:func:`lightning_dpmp.tools.estimate.fewest_recomputed`, on a profile of the first batch's step
  read from meta tensors: :func:`lightning_dpmp.tools.profile.profile_step`), fits this device's memory: on CUDA the
  free memory plus what this process's allocator holds (``torch.cuda.mem_get_info`` at setup). A CPU has no such
  limit: ``"auto"`` recomputes nothing there, and the setup printout says so.

Example:
    >>> check_activation_checkpointing("blocks")
    >>> check_activation_checkpointing("all")
    Traceback (most recent call last):
    ...
    ValueError: `activation_checkpointing` must be None, "blocks" or "auto", got 'all'.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

import lightning_dpmp.compat as compat
from lightning_dpmp.integration.metrics import shapes_only
from lightning_dpmp.integration.stepdata import isolated, real_tensors_on_meta, step_runner
from lightning_dpmp.parallel.dtensor_params import DTensorParams
from lightning_dpmp.parallel.recompute import checkpoint_blocks, first_blocks
from lightning_dpmp.parallel.rng import RNGTracker
from lightning_dpmp.parallel.topology import Topology
from lightning_dpmp.parallel.zero_engine import find_units
from lightning_dpmp.planner.estimate import PRECISIONS, LayoutSpec, fewest_recomputed
from lightning_dpmp.planner.profile import ModelProfile, profile_step, token_tensor

__all__ = ["NO_LIMIT", "SETTINGS", "apply_recompute", "batch_sequences", "check_activation_checkpointing", "describe",
           "device_budget", "layout_spec", "profile_module", "recompute_count"]

SETTINGS = (None, "blocks", "auto")


def check_activation_checkpointing(value: Any) -> None:
    """Refuse anything but ``None``, ``"blocks"`` or ``"auto"`` (at construction, before any process starts)."""
    if value not in SETTINGS or isinstance(value, bool):
        raise ValueError(f'`activation_checkpointing` must be None, "blocks" or "auto", got {value!r}.')


def device_budget(device: torch.device) -> Optional[float]:
    """Bytes this process can hold on ``device``: CUDA's free memory plus what its caching allocator reserved;
    ``None`` (no limit) elsewhere."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return float(free + torch.cuda.memory_reserved(device))


def _sizes(module: nn.Module) -> tuple[int, int]:
    """(vocabulary, width) of the largest embedding table (what the profile reads logits and messages by)."""
    tables = [m for m in module.modules() if isinstance(m, nn.Embedding)]
    if not tables:
        return 0, 0
    big = max(tables, key=lambda m: m.num_embeddings)
    return big.num_embeddings, big.embedding_dim


def batch_sequences(batch: Any) -> tuple[int, int]:
    """(sequences, tokens per sequence) of a DP rank's ``batch``: its token tensor's shape, else one "token" per
    sample of its first tensor.

    Example:
        >>> batch_sequences((torch.zeros(4, 16, dtype=torch.long), torch.zeros(4)))
        (4, 16)
    """
    try:
        tokens = token_tensor(batch)
        return int(tokens.shape[0]), int(tokens.shape[1])
    except ValueError:
        first = next((t for t in compat.tree_leaves(batch) if isinstance(t, torch.Tensor)), None)
        return (int(first.shape[0]) if first is not None and first.dim() else 1), 1


def profile_module(trainer: Any, module: nn.Module, plugin: Any, device: torch.device, batch: Any) -> ModelProfile:
    """The estimator's profile of ``module``'s step on ``batch``, run on meta copies of its tensors (nothing is
    allocated, the module is untouched)."""
    sequences, seq = batch_sequences(batch)
    vocab, hidden = _sizes(module)
    run = step_runner(trainer, module, plugin, device, batch, meta=True)
    with isolated(module), shapes_only(module), real_tensors_on_meta(module):
        return profile_step(module, run, vocab, hidden, seq, sequences)


NO_LIMIT = ('activation checkpointing "auto": no block recomputed (no device memory limit on this device; '
            '"blocks" recomputes them all)')


def layout_spec(topology: Topology, sequence_parallel: bool) -> LayoutSpec:
    """The estimator's :class:`~lightning_dpmp.tools.estimate.LayoutSpec` of this run's layout (no recomputation).

    Example:
        >>> spec = layout_spec(Topology(dp=2, mp=2, pp=2, microbatches=4), True)
        >>> spec.microbatches, spec.schedule, spec.recompute
        (4, '1f1b', False)
    """
    pp = topology.pp
    return LayoutSpec(topology.dp, pp, topology.mp, topology.zero, sequence_parallel,
                      (topology.microbatches if topology.microbatches > 0 else pp) if pp > 1 else 1,
                      topology.schedule if pp > 1 else "none")


def recompute_count(prof: ModelProfile, topology: Topology, sequence_parallel: bool, sequences: int,
                    precision: str, budget: float) -> tuple[int, str]:
    """``"auto"``: how many blocks of each stage to recompute for a DP rank's batch of ``sequences`` at
    ``topology`` within ``budget`` bytes per rank, and the printout's line.

    Example:
        >>> from lightning_dpmp.tools.costmodel import GPTShape
        >>> p = ModelProfile.from_gpt(GPTShape(layers=4, hidden=64, heads=4, vocab=128, seq=16, batch=8))
        >>> recompute_count(p, Topology(dp=1, mp=2), False, 8, "32-true", 2**30)[0]
        0
    """
    n = -(-prof.layers // topology.pp)
    k, row = fewest_recomputed(prof, layout_spec(topology, sequence_parallel), sequences * topology.dp, budget,
                               precision if precision in PRECISIONS else "32-true")
    fits = "fits" if row.fits else "does NOT fit even so"
    per = " per stage" if topology.pp > 1 else ""
    return k, (f'activation checkpointing "auto": {k} of {n} blocks{per} recomputed (predicted peak '
               f"{row.peak_mem_gib:.2f} GiB, {fits} the {budget / 2**30:.2f} GiB available)")


def apply_recompute(module: nn.Module, count: Optional[int], rng: Optional[RNGTracker],
                    params: Optional[DTensorParams], ranges: Optional[list[tuple[int, int]]] = None,
                    blocks: Optional[list[tuple[str, nn.Module]]] = None) -> list[str]:
    """Checkpoint ``module``'s repeated blocks after the split: all of them (``count`` ``None``) or the first
    ``count`` of each stage (``ranges`` over ``blocks``, a pipeline's; without, over the ZeRO engine's units).
    ``rng`` and ``params``: the split's dropout stream and DTensor parameters, which the recompute restores.
    Returns the names of the blocks wrapped."""
    units = blocks if blocks is not None else find_units(module)
    chosen = units if count is None else first_blocks(units, count, ranges)
    views = params.computing if params is not None else None
    return checkpoint_blocks(chosen, rng, views) if chosen else []


def describe(names: list[str], total: int) -> str:
    """The printout's line for ``"blocks"``."""
    return f'activation checkpointing "blocks": {len(names)} of {total} blocks recomputed' + (
        f" ({names[0]} .. {names[-1]})" if names else "")

