"""One batch per MP group: the ranks of a tensor-parallel group train on the batch its first rank read.

The ranks of an MP group compute one model together, so they must see one batch. Samplers keyed on the DP rank give
them the same indices, but anything random or rank-keyed in the data pipeline (augmentation in seeded loader
workers, a loader that reads ``global_rank``) gives each MP rank different samples, and the embedding all-reduce then
silently mixes them. Two ways to hold the invariant, as Megatron's ``tensor_parallel/data.py`` does the first:

* :func:`broadcast_batch` (by construction): one all-reduce of a 2-int64 *signature* (structure, shapes, dtypes and
  the non-tensor leaves) proves the ranks' batches have one layout; then every tensor leaf travels in **one**
  broadcast of a byte buffer from the group's first rank, whatever the number and dtypes of the leaves. Batches
  whose layouts differ (a random crop that changes the length) are sent as one pickled object instead, and the
  caller is told so.
* :func:`check_batch` (cheap proof): one all-reduce of 8 int64 (signature and content checksum) and a
  :class:`BatchMismatchError` on every rank of the group together when the batches differ.

Both are collectives over ``group``: every member calls them with its batch, in the same order. ``group`` of one
member costs nothing.

Example:
    >>> import torch
    >>> batch = {"ids": torch.arange(6).view(2, 3), "mask": torch.ones(2, 3, dtype=torch.bool), "name": "a"}
    >>> out, same_layout = broadcast_batch(batch, group=None, src=0)   # no group: returned as is
    >>> out is batch, same_layout
    (True, True)
    >>> batch_signature(batch) == batch_signature({**batch, "ids": torch.zeros(2, 3, dtype=torch.long)})
    True
"""

from __future__ import annotations

import zlib
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor

from lightning_dpmp.integration.guard import batch_checksum
from lightning_dpmp.parallel.comm import group_size

__all__ = ["BatchMismatchError", "batch_signature", "broadcast_batch", "check_batch"]

_I64_MASK = (1 << 63) - 1


class BatchMismatchError(RuntimeError):
    """Raised on every rank of an MP group together when its ranks hold different batches."""


def _tensors(batch: Any) -> list[Tensor]:
    found: list[Tensor] = []
    apply_to_collection(batch, Tensor, found.append)
    return found


def batch_signature(batch: Any) -> int:
    """A 63-bit hash of the batch's layout: container types and keys, tensor shapes and dtypes, and the values of
    the non-tensor leaves (strings, numbers). Equal on two ranks when their batches can share one byte buffer.

    Example:
        >>> batch_signature((torch.ones(2), 3)) == batch_signature((torch.zeros(2), 3))
        True
        >>> batch_signature((torch.ones(2), 3)) == batch_signature((torch.ones(3), 3))
        False
    """
    described = apply_to_collection(batch, Tensor, lambda t: f"T{tuple(t.shape)}{t.dtype}")
    return zlib.crc32(repr(described).encode()) & _I64_MASK  # repr, not hash(): str hashes are salted per process


def _as_bytes(t: Tensor) -> Tensor:
    flat = t.detach().contiguous().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    return flat.view(torch.uint8)


def _agree(values: Tensor, group: Any) -> bool:
    """Whether ``values`` (int64) is equal on every rank of ``group``: one all-reduce of ``[v, -v]`` with MAX gives
    the maximum and minus the minimum of each entry together."""
    both = torch.cat([values, -values])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    n = values.numel()
    return bool(torch.equal(both[:n], -both[n:]))


def check_batch(batch: Any, group: Any, device: torch.device, where: str = "") -> None:
    """Raise :class:`BatchMismatchError` on every rank of ``group`` when its ranks' batches differ (collective)."""
    if group is None or group_size(group) == 1:
        return
    wire = _wire_device(group, device)
    sig = torch.tensor([batch_signature(batch)], dtype=torch.int64, device=wire)
    # The guard's exact checksum over the tensor leaves (found as Lightning finds them, in Mappings such as
    # transformers' BatchEncoding too); the non-tensor leaves are in the signature.
    values = torch.cat([sig, batch_checksum(_tensors(batch), wire)])
    if not _agree(values, group):
        raise BatchMismatchError(
            f"the ranks of a tensor-parallel group hold different batches{where}: every rank of an MP group must"
            " train on the same samples. Causes: random augmentation or random choices in the dataset (loader"
            " workers are seeded by DP rank under DPMPStrategy, other sources of randomness are not), a loader or"
            " sampler keyed on trainer.global_rank instead of trainer.strategy.dp_rank / dp_size. Fix the data"
            " pipeline, or let DPMPStrategy(mp_batch='broadcast') (the default) send the first MP rank's batch"
            " to the others."
        )


def broadcast_batch(batch: Any, group: Any, src: int) -> tuple[Any, bool]:
    """Every rank of ``group`` returns the batch of global rank ``src`` (collective over ``group``).

    The tensors keep each receiver's devices.

    Returns ``(batch, same_layout)``: ``same_layout`` is False when the ranks' batches had different layouts and the
    slower pickled path was taken (tensors come back on the device the caller's own leaves were on).
    """
    if group is None or group_size(group) == 1:
        return batch, True
    tensors = _tensors(batch)
    device = tensors[0].device if tensors else torch.device("cpu")
    wire = _wire_device(group, device)
    if not _agree(torch.tensor([batch_signature(batch)], dtype=torch.int64, device=wire), group):
        return _broadcast_object(batch, group, src, device), False
    if not tensors:
        return batch, True  # no tensors and equal signatures: the non-tensor leaves are equal already
    # One byte buffer for all leaves: a single broadcast, whatever the dtypes (bool and complex included).
    mine = dist.get_rank() == src
    if mine:
        buffer = _pack(tensors, wire)
    else:
        buffer = torch.empty(_packed_size(tensors), dtype=torch.uint8, device=wire)
    dist.broadcast(buffer, src=src, group=group)
    if mine:
        return batch, True
    received = iter(_split_like(buffer, tensors))
    return apply_to_collection(batch, Tensor, lambda t: next(received).to(t.device)), True


def _wire_device(group: Any, device: torch.device) -> torch.device:
    """NCCL sends device tensors; gloo is given CPU tensors (it has no CUDA path for every op)."""
    return device if dist.get_backend(group) == "nccl" else torch.device("cpu")


_ALIGN = 8  # bytes: every leaf starts at a multiple of the widest real element, so its bytes view as its dtype


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _packed_size(tensors: list[Tensor]) -> int:
    return sum(_padded(t.numel() * t.element_size()) for t in tensors)


def _pack(tensors: list[Tensor], device: torch.device) -> Tensor:
    """The leaves' bytes one after another in one buffer, each padded to :data:`_ALIGN`."""
    buffer = torch.zeros(_packed_size(tensors), dtype=torch.uint8, device=device)
    start = 0
    for t in tensors:
        raw = _as_bytes(t)
        buffer[start : start + raw.numel()] = raw.to(device)
        start += _padded(raw.numel())
    return buffer


def _split_like(buffer: Tensor, like: list[Tensor]) -> list[Tensor]:
    """The leaves of :func:`_pack` back from ``buffer``, as views of it, with ``like``'s dtypes and shapes."""
    out, start = [], 0
    for t in like:
        n = t.numel() * t.element_size()
        chunk = buffer[start : start + n]
        start += _padded(n)
        if t.is_complex():
            real = chunk.view(torch.view_as_real(torch.empty(0, dtype=t.dtype)).dtype)
            out.append(torch.view_as_complex(real.view(*t.shape, 2)))
        else:
            out.append(chunk.view(t.dtype).view(t.shape))
    return out


def _broadcast_object(batch: Any, group: Any, src: int, device: Optional[torch.device]) -> Any:
    box = [apply_to_collection(batch, Tensor, lambda t: t.detach().cpu()) if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=group)
    return apply_to_collection(box[0], Tensor, lambda t: t.to(device)) if device is not None else box[0]
