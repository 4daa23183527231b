"""Tensor-parallel drop-in replacements for ``nn.Linear`` (Megatron-style), against an explicit process group.

Layouts, for ``y = x @ W.T + b`` with ``W`` of shape ``(out_features, in_features)`` and ``mp`` ranks:

* :class:`ColumnParallelLinear` holds rows ``W[r*o/mp:(r+1)*o/mp]`` (a slice of the *output* features).
  Requires a replicated input; produces an output sharded on its last dim, or replicated with ``gather_output``.
* :class:`RowParallelLinear` holds columns ``W[:, r*i/mp:(r+1)*i/mp]`` (a slice of the *input* features).
  Requires an input sharded on its last dim (or splits a replicated one); produces a replicated output.

A column layer feeding a row layer through element-wise ops costs one all-reduce forward (in the row layer) and one
backward (the column layer's input gradient): the Megatron MLP.

Linear-like layers that store the weight transposed, ``(in_features, out_features)`` (GPT-2's ``Conv1D``:
``addmm(b, x, W)``), are split in that storage layout (``out_dim=1``): the column layer holds ``W[:, slice]``, the
row layer ``W[slice, :]``, so parameter names and dense shapes stay the original module's, and :meth:`to_dense`
gives back the original class (any ``nn.Linear`` subclass or linear-like module, not a plain ``nn.Linear``).

The shared base, the sharding helpers and ``shard_dims`` live in :mod:`lightning_dpmp.parallel.sharding`, the
region entry shared by sibling layers (:class:`SharedInputCopy`) in :mod:`lightning_dpmp.parallel.entry`, the
embeddings in :mod:`lightning_dpmp.parallel.embeddings`.

Example:
    >>> dense = torch.nn.Linear(16, 64)
    >>> fc1 = ColumnParallelLinear.from_dense(dense, grid.mp_group)
    >>> fc1.to_dense().weight.equal(dense.weight)
    True
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from lightning_dpmp.parallel.comm import reduce_from_group, reduce_scatter_to_sequence, scatter_to_group
from lightning_dpmp.parallel.entry import SharedInputCopy, enter_region
from lightning_dpmp.parallel.fused import FusedOutput
from lightning_dpmp.parallel.overlap import linear_with_async_input_grad
from lightning_dpmp.parallel.sharding import (
    Blocks,
    ParallelLinear,
    divide,
    gather_tensor,
    local_block_sizes,
    padded_blocks,
)

__all__ = ["ColumnParallelLinear", "EnteredLinear", "RowParallelLinear", "set_async_grad_allreduce"]


class ColumnParallelLinear(ParallelLinear):
    """``nn.Linear`` split by output features.

    Forward: identity into the region (backward: all-reduce of the input gradient), a local matmul giving
    ``out_features / mp`` features, then, with ``gather_output``, an all-gather (backward: split).

    Args:
        in_features, out_features, bias: as ``nn.Linear``; ``out_features`` must be divisible by the group size,
            except for an LM head (``vocab_logits`` or ``gather_output``), whose vocabulary is padded with zero rows
            to a multiple of it; the gathered logits are stripped of the padding, the sharded ones mask it.
        group: the MP process group (explicit; never a global).
        gather_output: return the full output (replicated) instead of this rank's shard.
        shared_input: a :class:`SharedInputCopy` shared with sibling layers reading the same input.
        vocab_logits: an LM head whose logits feed a vocab-parallel loss: in ``vocab_mode`` (``(training, grad
            enabled)`` of the traced step that proved it) it returns them split, as
            :class:`~lightning_dpmp.parallel.loss.VocabShardedLogits`; in every other mode (validation, test,
            predict, a ``no_grad`` forward) it all-gathers them here, in its own forward, which every rank runs,
            so no later code (rank-conditional or not) can start a collective.
        name: the module name, for error messages of the sharded logits.

    ``async_grad_allreduce`` (attribute, default False; :func:`set_async_grad_allreduce`): overlap the input-gradient
    all-reduce with the weight gradient (:mod:`lightning_dpmp.parallel.overlap`) when this layer has its own entry.

    Example:
        >>> fc = ColumnParallelLinear(16, 64, group=grid.mp_group)  # weight: (64 // mp, 16)
    """

    _shard_dims = {"weight": 0, "bias": 0}
    async_grad_allreduce: bool = False

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        group: Any = None,
        gather_output: bool = False,
        shared_input: Optional[SharedInputCopy] = None,
        blocks: Blocks = 1,
        vocab_logits: bool = False,
        vocab_mode: tuple[bool, bool] = (True, True),
        name: str = "",
        rng: Optional[Any] = None,
        sequence_dim: Optional[int] = None,
        out_dim: int = 0,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__(in_features, out_features, group)
        self.sequence_dim = sequence_dim
        self.out_dim = out_dim
        if out_dim == 1:  # weight stored (in, out): the output features are its columns
            self._shard_dims = {"weight": 1, "bias": 0}
        if (vocab_logits or gather_output) and blocks == 1:  # a vocabulary mp does not divide is padded (Megatron)
            blocks = padded_blocks(out_features, self.mp)
        if isinstance(blocks, int):
            per_block = divide(out_features, blocks, "out_features (fused blocks)")
            local_out = divide(per_block, self.mp, "out_features") * blocks
        elif sum(blocks) != out_features:
            raise ValueError(f"fused blocks {blocks} do not add up to out_features={out_features}")
        else:
            local_out = sum(local_block_sizes(blocks, 0, self.mp))
        self.gather_output = gather_output
        self.shared_input = shared_input
        self.blocks = blocks
        self.vocab_logits = vocab_logits
        self.vocab_mode = (bool(vocab_mode[0]), bool(vocab_mode[1]))
        self.name = name
        self.rng = rng
        self._create_parameters(local_out, in_features, local_out if bias else None, device, dtype)

    @property
    def overlaps_input_grad(self) -> bool:
        """The backward all-reduces its input gradient asynchronously, beside the weight gradient."""
        own_copy = self.shared_input is None and self.sequence_dim is None and self.mp > 1
        return self.async_grad_allreduce and own_copy

    def forward(self, x: Tensor) -> Tensor:
        if self.overlaps_input_grad:
            y = linear_with_async_input_grad(x, self.weight, self.bias, self.group, transposed=self.out_dim == 1)
        else:
            entry = self.shared_input
            x = entry(x) if entry is not None else enter_region(x, self.group, self.sequence_dim)
            y = self._matmul(x, self.bias)
        if self.gather_output or self.vocab_logits and (self.training, torch.is_grad_enabled()) != self.vocab_mode:
            return gather_tensor(y, y.dim() - 1, self.group, self.blocks)  # full logits outside the proven mode
        if self.vocab_logits:
            from lightning_dpmp.parallel.loss import VocabShardedLogits  # avoids an import cycle

            return VocabShardedLogits.wrap(y, self.group, self.out_features, self.name)  # knows the padding
        if self.rng is not None:
            self.rng.enter_for(self.training)  # a sharded region starts: masks differ per MP rank until the row layer
        if isinstance(self.blocks, tuple) and len(self.blocks) > 1 and self.mp > 1:
            return FusedOutput.wrap(y, self.blocks, self.mp)  # the code's cuts into blocks are read per rank
        return y

    def extra_repr(self) -> str:
        extra = f", blocks={self.blocks}" if self.blocks != 1 else ""
        vocab = ", vocab" if self.vocab_logits else ""
        return super().extra_repr() + f", gather_output={self.gather_output}{extra}{vocab}"


class RowParallelLinear(ParallelLinear):
    """``nn.Linear`` split by input features.

    Forward: a local matmul on this rank's ``in_features / mp`` input features gives a partial sum, all-reduced
    across the group (backward: identity); the bias, replicated, is added once after the reduce.

    Args:
        in_features, out_features, bias: as ``nn.Linear``; ``in_features`` must be divisible by the group size.
        group: the MP process group.
        input_is_parallel: the input arrives sharded on its last dim (from a column layer). If False, the
            replicated input is split here (backward: all-gather).

    Example:
        >>> fc = RowParallelLinear(64, 16, group=grid.mp_group)  # weight: (16, 64 // mp)
    """

    _shard_dims = {"weight": 1, "bias": None}

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        group: Any = None,
        input_is_parallel: bool = True,
        rng: Optional[Any] = None,
        sequence_dim: Optional[int] = None,
        out_dim: int = 0,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__(in_features, out_features, group)
        self.sequence_dim = sequence_dim
        self.out_dim = out_dim
        if out_dim == 1:  # weight stored (in, out): the input features are its rows
            self._shard_dims = {"weight": 0, "bias": None}
        local_in = divide(in_features, self.mp, "in_features")
        self.input_is_parallel = input_is_parallel
        self.rng = rng
        self._create_parameters(out_features, local_in, out_features if bias else None, device, dtype)

    def forward(self, x: Tensor) -> Tensor:
        if self.rng is not None:
            self.rng.exit()  # back to the replicated stream: the output is the same on every MP rank
        if not self.input_is_parallel:
            x = scatter_to_group(x, self.group)
        y = self._matmul(x, None)
        if self.sequence_dim is None:
            y = reduce_from_group(y, self.group)
        else:  # sequence parallel: each rank keeps the summed output for its slice of the sequence
            y = reduce_scatter_to_sequence(y, self.group, self.sequence_dim)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return super().extra_repr() + f", input_is_parallel={self.input_is_parallel}"


class EnteredLinear(ParallelLinear):
    """A whole ``nn.Linear`` that reads its input inside a column layer's region: through the entry copy that layer
    shares (identity forward, one backward all-reduce for every layer reading it).

    The first factor ``A`` of a low-rank product ``B(A(x))`` added to a column layer's output (a LoRA adapter on a
    column-parallel base): ``B`` is split by output features like the base and takes ``A``'s output as already
    inside the region (:data:`~lightning_dpmp.parallel.entry.GATHERED`), so its input gradient, and with it this
    layer's input gradient and its weight gradient, are partial sums over the MP group. The input gradient joins
    the base's in the shared entry's one all-reduce; the weight gradient is summed over MP once per step with the
    other partial gradients (:func:`~lightning_dpmp.parallel.clipping.sync_partial_grads`). No collective of its
    own, no all-gather.

    Example:
        >>> entry = SharedInputCopy(grid.mp_group)
        >>> base = ColumnParallelLinear.from_dense(torch.nn.Linear(32, 32), grid.mp_group, shared_input=entry)
        >>> lora_a = EnteredLinear.from_dense(torch.nn.Linear(32, 4, bias=False), grid.mp_group, shared_input=entry)
    """

    _shard_dims = {"weight": None, "bias": None}

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        group: Any = None,
        shared_input: Optional[SharedInputCopy] = None,
        out_dim: int = 0,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__(in_features, out_features, group)
        if shared_input is None:
            raise ValueError("EnteredLinear reads its input through a column layer's shared entry: give shared_input")
        self.shared_input = shared_input
        self.out_dim = out_dim
        self._create_parameters(out_features, in_features, out_features if bias else None, device, dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self._matmul(self.shared_input(x), self.bias)


def set_async_grad_allreduce(module: torch.nn.Module, enabled: bool) -> int:
    """Turn the overlapped input-gradient all-reduce on or off in every column layer of ``module``; returns how
    many layers overlap now (those with their own entry: shared and sequence-parallel entries keep theirs)."""
    count = 0
    for mod in module.modules():
        if isinstance(mod, ColumnParallelLinear):
            mod.async_grad_allreduce = bool(enabled)
            count += int(mod.overlaps_input_grad)
    return count
