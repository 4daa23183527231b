"""Replica-consistency guard: cheap proof that the dp x mp grid still holds one model and one batch per MP group.

Three invariants of DP x MP training fail silently when broken (the loss still goes down, the replicas drift):

* the ``dp`` replicas of every parameter shard are bitwise identical (DDP averaged the same gradients);
* a parameter *replicated* inside an MP group (LayerNorm, a ``replicate`` Linear, a row bias) is identical on
  every MP rank;
* the ``mp`` ranks of an MP group train on the same batch.

:class:`ConsistencyGuard` checks all three with integer checksums of the raw bits (exact and independent of
summation order, so bitwise-equal tensors always agree, on any device and thread count), one small
``all_gather`` of ``3 * (parameters + 1)`` int64 per rank, and a comparison that every rank does on the same
table: all ranks raise the same :class:`ReplicaDivergenceError` together, so nobody is left in a collective.

Example:
    >>> guard = ConsistencyGuard(every_n_steps=100)
    >>> guard.maybe_check(step, module, batch, grid, device)    # collective every 100 steps  # doctest: +SKIP
    >>> tensor_checksum(torch.ones(3)).tolist() == tensor_checksum(torch.ones(3)).tolist()
    True
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_dpmp.compat import tree_leaves
from lightning_dpmp.parallel.sharding import shard_dims

__all__ = ["ConsistencyGuard", "ReplicaDivergenceError", "batch_checksum", "first_divergence", "tensor_checksum"]

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 22  # elements per chunk: bounds the int64 temporaries of a large parameter to ~100 MB
_MODULUS = 8191  # position weights 1..8191: a swap of two different values changes the weighted sum


class ReplicaDivergenceError(RuntimeError):
    """Raised on every rank when replicas, MP-replicated parameters or an MP group's batches differ."""


def tensor_checksum(t: Tensor) -> Tensor:
    """``[numel, sum of raw words, position-weighted sum]`` of ``t``'s bits, as int64 on ``t``'s device.

    Integer sums wrap modulo 2**64, so they do not depend on summation order: bitwise-equal tensors give equal
    checksums on every rank, and any changed bit changes the plain sum.

    Example:
        >>> a = torch.tensor([1.0, 2.0])
        >>> same = lambda x, y: bool((tensor_checksum(x) == tensor_checksum(y)).all())
        >>> same(a, a.clone()), same(a, a.flip(0))
        (True, False)
    """
    flat = t.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    words = flat.view(_INT_OF_SIZE[flat.element_size()])
    total = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for start in range(0, words.numel(), _CHUNK):
        chunk = words[start : start + _CHUNK].to(torch.int64)
        weights = torch.arange(start, start + chunk.numel(), device=chunk.device) % _MODULUS + 1
        total += torch.stack([chunk.sum(), (chunk * weights).sum()])
    return torch.cat([torch.tensor([flat.numel()], dtype=torch.int64, device=flat.device), total])


def batch_checksum(batch: Any, device: torch.device) -> Tensor:
    """One checksum of every leaf of ``batch`` (tensors by their bits, other leaves by ``crc32(repr)``).

    Example:
        >>> b = {"x": torch.ones(2), "ids": [1, 2]}
        >>> batch_checksum(b, torch.device("cpu")).tolist() == batch_checksum(b, torch.device("cpu")).tolist()
        True
    """
    total = torch.zeros(3, dtype=torch.int64, device=device)
    for i, leaf in enumerate(tree_leaves(batch)):
        if isinstance(leaf, Tensor):
            c = tensor_checksum(leaf).to(device)
        else:  # repr, not hash(): str hashes are salted per process
            c = torch.full((3,), zlib.crc32(repr(leaf).encode()), dtype=torch.int64, device=device)
        total += c * (i + 1)  # leaf order matters: (x, y) and (y, x) differ
    return total


def _where(rank: int, mp: int) -> str:
    return f"rank {rank} (dp_rank {rank // mp}, mp_rank {rank % mp})"


def first_divergence(table: Tensor, names: Sequence[str], sharded: Sequence[bool], mp: int) -> Optional[str]:
    """Explain the first broken invariant in a gathered checksum table, or return ``None`` when all hold.

    Args:
        table: ``(world, len(names) + 1, 3)`` int64: per rank, one checksum per parameter, then the batch's.
        names: parameter names, in the same order on every rank.
        sharded: whether each parameter is split over the MP group (then only its DP replicas must agree).
        mp: the MP width; rank = dp_rank * mp + mp_rank.

    Example:
        >>> t = torch.zeros(4, 2, 3, dtype=torch.int64); t[3, 0, 1] = 7
        >>> first_divergence(t, ["w"], [False], mp=2)[:48]
        "parameter 'w' (replicated over MP) on rank 3 (dp"
    """
    world = table.shape[0]
    problems: list[str] = []
    for i, name in enumerate(names):
        for r in range(world):
            ref = r % mp if sharded[i] else 0  # sharded: compare with dp_rank 0 of the same MP slot
            if not torch.equal(table[r, i], table[ref, i]):
                kind = "sharded over MP; DP replicas" if sharded[i] else "replicated over MP"
                problems.append(f"parameter {name!r} ({kind}) on {_where(r, mp)} differs from {_where(ref, mp)}")
                break
        if problems:
            break
    for r in range(world):
        ref = (r // mp) * mp  # mp_rank 0 of the same MP group
        if not torch.equal(table[r, -1], table[ref, -1]):
            problems.append(
                f"the batch on {_where(r, mp)} differs from the batch on {_where(ref, mp)}: every rank of an MP group"
                " must see the same batch (shard data by strategy.dp_rank / strategy.dp_size, not by global rank)"
            )
            break
    return "; ".join(problems) or None


class ConsistencyGuard:
    """Every ``every_n_steps`` optimizer steps, verify the three invariants with one small ``all_gather``.

    Args:
        every_n_steps: check at steps 0, N, 2N, ... (0 disables the guard).

    Example:
        >>> ConsistencyGuard(0).maybe_check(5, nn.Linear(2, 2), None, None, torch.device("cpu"))  # disabled: no-op
    """

    def __init__(self, every_n_steps: int) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 0:
            raise ValueError(
                f"`check_consistency_every_n_steps` must be a non-negative int (0 = off), got {every_n_steps!r}."
            )
        self.every_n_steps = every_n_steps
        self._last_step: Optional[int] = None

    def due(self, step: int, grid: Any) -> bool:
        """Whether :meth:`maybe_check` checks at this batch: the first batch of every N-th optimizer step."""
        return bool(self.every_n_steps) and grid is not None and step % self.every_n_steps == 0 \
            and step != self._last_step

    def maybe_check(self, step: int, module: nn.Module, batch: Any, grid: Any, device: torch.device) -> None:
        """Check at the first batch of every N-th optimizer step (once per step under gradient accumulation)."""
        if not self.due(step, grid):
            return
        self._last_step = step
        self.check(module, batch, grid, device, where=f"step {step}")

    def check(self, module: nn.Module, batch: Any, grid: Any, device: torch.device, where: str = "") -> None:
        """Collective over the world: gather every rank's checksums and raise on every rank if any differ."""
        split = shard_dims(module)
        named = list(module.named_parameters())
        local = torch.stack([tensor_checksum(p).to(device) for _, p in named] + [batch_checksum(batch, device)])
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local)
        names = [n for n, _ in named]
        problem = first_divergence(torch.stack(parts).cpu(), names, [n in split for n in names], grid.mp)
        if problem is not None:
            raise ReplicaDivergenceError(
                f"DPMPStrategy consistency check failed at {where} (dp={grid.dp}, mp={grid.mp}): {problem}. Causes:"
                " code that changes parameters on some ranks only, rank-dependent randomness outside the model, or data"
                " not sharded by DP rank."
            )
