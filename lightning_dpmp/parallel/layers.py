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

Example:
    >>> dense = nn.Linear(16, 64)
    >>> fc1 = ColumnParallelLinear.from_dense(dense, grid.mp_group)   # doctest: +SKIP
    >>> fc1.to_dense().weight.equal(dense.weight)                     # doctest: +SKIP
    True
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import Self

import lightning_dpmp.compat as compat
from lightning_dpmp.parallel.comm import (
    copy_to_group,
    gather_from_group,
    gather_from_sequence,
    group_rank,
    group_size,
    reduce_from_group,
    reduce_scatter_to_sequence,
    scatter_to_group,
)

__all__ = [
    "ColumnParallelEmbedding",
    "SHARDS_ATTR",
    "ColumnParallelLinear",
    "dense_template",
    "RowParallelLinear",
    "SharedInputCopy",
    "VocabParallelEmbedding",
    "divide",
    "gather_tensor",
    "interleave_blocks",
    "shard_blocks",
    "shard_dims",
    "shard_tensor",
]


def divide(total: int, parts: int, what: str = "dimension") -> int:
    """``total // parts``, or a ``ValueError`` naming both numbers when it does not divide evenly."""
    if total % parts:
        raise ValueError(f"{what} of size {total} cannot be split evenly across mp={parts} ranks.")
    return total // parts


class SharedInputCopy:
    """One ``copy_to_group`` shared by sibling column layers that read the same input tensor.

    q/k/v (or gate/up) each entering the parallel region on their own would all-reduce the input gradient once
    each; sharing the entry makes autograd sum their gradients first, so the group pays one all-reduce.

    Example:
        >>> entry = SharedInputCopy(grid.mp_group)                         # doctest: +SKIP
        >>> q = ColumnParallelLinear.from_dense(q, grid.mp_group, shared_input=entry)  # doctest: +SKIP
    """

    def __init__(self, group: Any, sequence_dim: Any = None) -> None:
        self.group = group
        self.sequence_dim = sequence_dim
        self._key: Optional[tuple[int, int, bool]] = None
        self._src: Optional[Tensor] = None
        self._out: Optional[Tensor] = None

    def __call__(self, x: Tensor) -> Tensor:
        # The key includes the version counter and grad mode so that a tensor modified in place, or a copy made
        # under no_grad, is never reused. The references are strong (autograd keeps the tensor's data, not its
        # Python object), and are dropped as soon as the gradient has gone through, so no activation outlives
        # its step.
        key = (id(x), compat.tensor_version(x), torch.is_grad_enabled())
        if key == self._key and self._src is x and self._out is not None:
            return self._out
        out = enter_region(x, self.group, self.sequence_dim)
        self._key, self._src, self._out = key, x, out
        if out.requires_grad:
            out.register_hook(self._release)
        return out

    def _release(self, grad: Tensor) -> None:
        self._key = self._src = self._out = None


GATHERED = "gathered"  # sequence_dim value: the enclosing module already all-gathered the sequence


def enter_region(x: Tensor, group: Any, sequence_dim: Any) -> Tensor:
    """A column layer's entry: copy (backward all-reduce); with sequence parallelism all-gather the sequence
    (backward reduce-scatter), or nothing when the enclosing module gathered it (its backward sums already)."""
    if sequence_dim is None:
        return copy_to_group(x, group)
    if sequence_dim == GATHERED:
        return x
    return gather_from_sequence(x, group, sequence_dim)


class _ParallelLinear(nn.Module):
    """Shared state of the two layouts: sizes, the group and this rank's place in it."""

    # Dimension along which each parameter is split; None means replicated across the MP group.
    _shard_dims: dict[str, Optional[int]] = {}

    def __init__(self, in_features: int, out_features: int, group: Any) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.group = group
        self.mp = group_size(group)
        self.mp_rank = group_rank(group)

    # Fused projections (q|k|v in one weight) are split block by block, so that each rank holds the same heads
    # of every block: weight rows viewed as (blocks, rows/blocks) are chunked along the second axis.
    blocks: int = 1

    out_dim: int = 0  # dim of the stored weight holding the output features: 0 (out, in) or 1 (in, out)

    @classmethod
    def from_dense(cls, linear: nn.Module, group: Any, out_dim: int = 0, **kwargs: Any) -> Self:
        """Slice an initialised ``nn.Linear`` (or a linear-like module with ``weight``/``bias`` stored
        ``out_dim``-major, e.g. ``Conv1D`` with ``out_dim=1``) so that training starts from exactly its weights."""
        w = linear.weight
        out_f, in_f = (w.shape[0], w.shape[1]) if out_dim == 0 else (w.shape[1], w.shape[0])
        layer = cls(  # type: ignore[call-arg]
            in_f, out_f, getattr(linear, "bias", None) is not None, group=group, out_dim=out_dim,
            device=w.device, dtype=w.dtype, **kwargs,
        )
        layer._init_from(linear)
        layer.train(linear.training)
        if type(linear) is not nn.Linear:  # Conv1D, NonDynamicallyQuantizableLinear...: to_dense gives it back
            layer.__dict__["_template"] = dense_template(linear)
        for name in ("weight", "bias"):  # frozen (fine-tuned) parameters stay frozen
            if getattr(layer, name, None) is not None:
                getattr(layer, name).requires_grad_(getattr(linear, name).requires_grad)
        return layer

    def _init_from(self, dense: nn.Module) -> None:
        """Copy this rank's slices of ``dense``'s parameters, and their ``requires_grad`` (frozen stays frozen)."""
        with torch.no_grad():
            for name, dim in self._shard_dims.items():
                full = getattr(dense, name)
                if full is None:
                    continue
                local = full if dim is None else shard_tensor(full, dim, self.mp, self.mp_rank, self.blocks)
                getattr(self, name).copy_(local)
                getattr(self, name).requires_grad_(full.requires_grad)

    def _dense_module(self) -> nn.Module:
        p = self.weight
        template = self.__dict__.get("_template")
        if template is None:
            return nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device=p.device, dtype=p.dtype)
        dense = copy.deepcopy(template)
        shape = (self.out_features, self.in_features) if self.out_dim == 0 else (self.in_features, self.out_features)
        dense.weight = nn.Parameter(torch.empty(shape, device=p.device, dtype=p.dtype), requires_grad=p.requires_grad)
        if self.bias is not None:
            dense.bias = nn.Parameter(torch.empty(self.out_features, device=p.device, dtype=p.dtype),
                                      requires_grad=self.bias.requires_grad)
        return dense

    def _matmul(self, x: Tensor, bias: Optional[Tensor]) -> Tensor:
        """``x @ W.T + b`` for the ``(out, in)`` layout, ``x @ W + b`` for ``(in, out)``."""
        return F.linear(x, self.weight if self.out_dim == 0 else self.weight.t(), bias)

    def reset_parameters(self) -> None:
        """nn.Linear's default distribution with the *dense* fan-in (a shard's own fan-in would differ for rows).

        ``from_dense`` is the exact path (the very values of an initialised dense layer); this one serves fresh
        layers and models materialised from the meta device.
        """
        bound = 1 / self.in_features**0.5  # kaiming_uniform(a=sqrt(5)) on the dense weight has this bound
        with torch.no_grad():
            self.weight.uniform_(-bound, bound)
            if self.bias is not None:
                self.bias.uniform_(-bound, bound)

    def to_dense(self) -> nn.Module:
        """Gather the shards into the dense module (collective: every rank of the group must call it)."""
        dense = self._dense_module()
        with torch.no_grad():
            for name, dim in self._shard_dims.items():
                local = getattr(self, name, None)
                if local is not None:
                    full = local if dim is None else gather_tensor(local.detach(), dim, self.group, self.blocks)
                    getattr(dense, name).copy_(full)
                    getattr(dense, name).requires_grad_(local.requires_grad)
        dense.train(self.training)
        return dense

    def extra_repr(self) -> str:
        layout = ", weight=(in, out)" if self.out_dim == 1 else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, mp={self.mp}{layout}"


def dense_template(dense: nn.Module) -> nn.Module:
    """A deep copy of ``dense`` whose parameters are meta tensors: its class and attributes, no memory.

    ``to_dense`` copies it and sets full-size parameters, so a consolidated model holds the original classes.
    """
    memo = {id(p): nn.Parameter(torch.empty(p.shape, device="meta", dtype=p.dtype), requires_grad=p.requires_grad)
            for p in dense.parameters()}
    return copy.deepcopy(dense, memo)


def shard_tensor(full: Tensor, dim: int, mp: int, rank: int, blocks: int = 1) -> Tensor:
    """This rank's slice of ``full`` along ``dim``; with ``blocks > 1``, the same slice of each of the blocks."""
    if blocks == 1:
        return full.chunk(mp, dim=dim)[rank]
    return torch.cat([b.chunk(mp, dim=dim)[rank] for b in full.chunk(blocks, dim=dim)], dim=dim)


def gather_tensor(local: Tensor, dim: int, group: Any, blocks: int = 1) -> Tensor:
    """Inverse of :func:`shard_tensor` (collective over ``group``)."""
    if group_size(group) == 1:
        return local
    if blocks == 1:
        return gather_from_group(local, group, dim)
    return torch.cat([gather_from_group(b.contiguous(), group, dim) for b in local.chunk(blocks, dim=dim)], dim=dim)


class ColumnParallelLinear(_ParallelLinear):
    """``nn.Linear`` split by output features.

    Forward: identity into the region (backward: all-reduce of the input gradient), a local matmul giving
    ``out_features / mp`` features, then, with ``gather_output``, an all-gather (backward: split).

    Args:
        in_features, out_features, bias: as ``nn.Linear``; ``out_features`` must be divisible by the group size.
        group: the MP process group (explicit; never a global).
        gather_output: return the full output (replicated) instead of this rank's shard.
        shared_input: a :class:`SharedInputCopy` shared with sibling layers reading the same input.
        vocab_logits: an LM head whose logits feed a vocab-parallel loss: in ``vocab_mode`` (``(training, grad
            enabled)`` of the traced step that proved it) it returns them split, as
            :class:`~lightning_dpmp.parallel.loss.VocabShardedLogits`; in every other mode (validation, test,
            predict, a ``no_grad`` forward) it all-gathers them here, in its own forward, which every rank runs,
            so no later code (rank-conditional or not) can start a collective.
        name: the module name, for error messages of the sharded logits.

    Example:
        >>> fc = ColumnParallelLinear(16, 64, group=grid.mp_group)  # weight: (64 // mp, 16)  # doctest: +SKIP
    """

    _shard_dims = {"weight": 0, "bias": 0}

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        group: Any = None,
        gather_output: bool = False,
        shared_input: Optional[SharedInputCopy] = None,
        blocks: int = 1,
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
        local_out = divide(divide(out_features, blocks, "out_features (fused blocks)"), self.mp, "out_features") * blocks
        self.gather_output = gather_output
        self.shared_input = shared_input
        self.blocks = blocks
        self.vocab_logits = vocab_logits
        self.vocab_mode = (bool(vocab_mode[0]), bool(vocab_mode[1]))
        self.name = name
        self.rng = rng
        shape = (local_out, in_features) if out_dim == 0 else (in_features, local_out)
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(local_out, device=device, dtype=dtype)) if bias else None
        if self.weight.device.type != "meta":
            self.reset_parameters()

    def forward(self, x: Tensor) -> Tensor:
        x = self.shared_input(x) if self.shared_input is not None else enter_region(x, self.group, self.sequence_dim)
        y = self._matmul(x, self.bias)
        if self.gather_output or self.vocab_logits and (self.training, torch.is_grad_enabled()) != self.vocab_mode:
            return gather_tensor(y, y.dim() - 1, self.group, self.blocks)  # full logits outside the proven mode
        if self.vocab_logits:
            from lightning_dpmp.parallel.loss import VocabShardedLogits  # avoids an import cycle

            return VocabShardedLogits.wrap(y, self.group, self.out_features, self.name)
        if self.rng is not None:
            self.rng.enter()  # a sharded region starts: dropout masks differ per MP rank until the row layer
        return y

    def extra_repr(self) -> str:
        extra = f", blocks={self.blocks}" if self.blocks > 1 else ""
        return super().extra_repr() + f", gather_output={self.gather_output}{extra}" + (", vocab" if self.vocab_logits else "")


class RowParallelLinear(_ParallelLinear):
    """``nn.Linear`` split by input features.

    Forward: a local matmul on this rank's ``in_features / mp`` input features gives a partial sum, all-reduced
    across the group (backward: identity); the bias, replicated, is added once after the reduce.

    Args:
        in_features, out_features, bias: as ``nn.Linear``; ``in_features`` must be divisible by the group size.
        group: the MP process group.
        input_is_parallel: the input arrives sharded on its last dim (from a column layer). If False, the
            replicated input is split here (backward: all-gather).

    Example:
        >>> fc = RowParallelLinear(64, 16, group=grid.mp_group)  # weight: (16, 64 // mp)  # doctest: +SKIP
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
        shape = (out_features, local_in) if out_dim == 0 else (local_in, out_features)
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        if self.weight.device.type != "meta":
            self.reset_parameters()

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


class VocabParallelEmbedding(_ParallelLinear):
    """``nn.Embedding`` split by vocabulary rows: rank ``r`` holds ids ``[r*V/mp, (r+1)*V/mp)``.

    Forward: ids outside the local range look up row 0 and are zeroed, then one all-reduce sums the shards' rows
    (backward: identity; each rank's weight gradient touches only its own rows).

    Example:
        >>> emb = VocabParallelEmbedding.from_dense(nn.Embedding(256, 64), grid.mp_group)  # weight (256 // mp, 64)  # doctest: +SKIP
    """

    _shard_dims = {"weight": 0}
    bias = None

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group: Any = None, padding_idx: Optional[int] = None,
                 sequence_dim: Optional[int] = None, device: Optional[torch.device] = None,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__(num_embeddings, embedding_dim, group)  # (in, out) slots hold (V, dim) for the printout
        self.sequence_dim = sequence_dim
        self.rng: Optional[Any] = None
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        local = divide(num_embeddings, self.mp, "num_embeddings")
        self.start = self.mp_rank * local
        self.padding_idx = padding_idx
        self.weight = nn.Parameter(torch.empty(local, embedding_dim, device=device, dtype=dtype))
        if self.weight.device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Embedding's default: N(0, 1), with the padding row (if this rank holds it) zeroed."""
        with torch.no_grad():
            self.weight.normal_()
            pad = None if self.padding_idx is None else self.padding_idx - self.start
            if pad is not None and 0 <= pad < self.weight.shape[0]:
                self.weight[pad].zero_()

    @classmethod
    def from_dense(cls, emb: nn.Embedding, group: Any, sequence_dim: Optional[int] = None) -> Self:  # type: ignore[override]
        if emb.max_norm is not None or emb.sparse or emb.scale_grad_by_freq:
            raise ValueError("VocabParallelEmbedding supports plain embeddings (no max_norm, sparse, scale_grad_by_freq).")
        layer = cls(emb.num_embeddings, emb.embedding_dim, group=group, padding_idx=emb.padding_idx,
                    sequence_dim=sequence_dim, device=emb.weight.device, dtype=emb.weight.dtype)
        layer._init_from(emb)
        layer.train(emb.training)
        return layer

    def _dense_module(self) -> nn.Module:
        p = self.weight
        return nn.Embedding(self.num_embeddings, self.embedding_dim, padding_idx=self.padding_idx, device=p.device, dtype=p.dtype)

    def forward(self, ids: Tensor) -> Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        pad = None
        if self.padding_idx is not None and 0 <= self.padding_idx - self.start < self.weight.shape[0]:
            pad = self.padding_idx - self.start  # nn.Embedding gives the padding row no gradient
        rows = F.embedding(local.masked_fill(outside, 0), self.weight, padding_idx=pad)
        rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_dim is not None:  # sequence parallel: sum the shards and keep this rank's tokens
            if self.rng is not None:
                self.rng.enter()  # from here on each rank holds different tokens: per-rank dropout masks
            return reduce_scatter_to_sequence(rows, self.group, self.sequence_dim)
        return reduce_from_group(rows, self.group)

    def extra_repr(self) -> str:
        return f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, mp={self.mp}"


class ColumnParallelEmbedding(VocabParallelEmbedding):
    """``nn.Embedding`` split by ``embedding_dim``: rank ``r`` holds columns ``E[:, r*D/mp:(r+1)*D/mp]``.

    For tables whose output is consumed split along its last dim, e.g. a relative position bias
    ``(buckets, heads)`` that reaches head-parallel attention (T5): each rank looks up its own heads. No
    communication at all, forward or backward (the ids carry no gradient).

    Example:
        >>> bias = ColumnParallelEmbedding.from_dense(nn.Embedding(32, 8), grid.mp_group)  # weight (32, 8 // mp)  # doctest: +SKIP
    """

    _shard_dims = {"weight": 1}

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group: Any = None, padding_idx: Optional[int] = None,
                 sequence_dim: Optional[int] = None, device: Optional[torch.device] = None,
                 dtype: Optional[torch.dtype] = None) -> None:
        _ParallelLinear.__init__(self, num_embeddings, embedding_dim, group)
        if sequence_dim is not None:
            raise ValueError("ColumnParallelEmbedding does not take a sequence dim (its output is feature-split).")
        self.sequence_dim, self.rng = None, None
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.start = 0
        self.padding_idx = padding_idx
        local = divide(embedding_dim, self.mp, "embedding_dim")
        self.weight = nn.Parameter(torch.empty(num_embeddings, local, device=device, dtype=dtype))
        if self.weight.device.type != "meta":
            self.reset_parameters()

    def forward(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self.weight, padding_idx=self.padding_idx)


# A module that keeps its own class but holds some parameters split in place (experts, :mod:`.experts`) carries
# ``{parameter name: (dim, blocks)}`` under this attribute.
SHARDS_ATTR = "_dpmp_param_shards"


def shard_dims(module: nn.Module) -> dict[str, int]:
    """Fully qualified names of the split parameters of ``module`` and the dimension each is split along.

    Parameters not listed are replicated across the MP group. A module registered under several names (an
    embedding shared as ``encoder.embed_tokens`` and ``decoder.embed_tokens``) is listed under each.

    Example:
        >>> shard_dims(parallel_model)   # doctest: +SKIP
        {'blocks.0.fc1.weight': 0, 'blocks.0.fc1.bias': 0, 'blocks.0.fc2.weight': 1}
    """
    out: dict[str, int] = {}
    for prefix, mod in module.named_modules(remove_duplicate=False):  # every alias is a state_dict key
        if isinstance(mod, _ParallelLinear) and mod.mp > 1:
            for name, dim in mod._shard_dims.items():
                if dim is not None and getattr(mod, name, None) is not None:
                    out[f"{prefix}.{name}" if prefix else name] = dim
        for name, (dim, _) in mod.__dict__.get(SHARDS_ATTR, {}).items():
            out[f"{prefix}.{name}" if prefix else name] = dim
    return _with_aliases(module, out)


def _with_aliases(module: nn.Module, by_name: dict[str, int]) -> dict[str, int]:
    """``by_name`` extended to every other name a listed parameter is registered under (a bias held by both a
    layer and its parent), so that state_dict keys and deduplicated parameter names all find their entry."""
    params = dict(module.named_parameters(remove_duplicate=False))
    by_id = {id(params[n]): v for n, v in by_name.items() if n in params}
    return {**by_name, **{n: by_id[id(p)] for n, p in params.items() if id(p) in by_id}}


def shard_blocks(module: nn.Module) -> dict[str, int]:
    """Split parameters of fused layers (q|k|v in one weight) and their block count; others have one block.

    A fused parameter's shards do not concatenate to the dense tensor: use :func:`shard_tensor` and
    :func:`gather_tensor` (or :func:`interleave_blocks`) with this count.
    """
    out: dict[str, int] = {}
    for prefix, mod in module.named_modules(remove_duplicate=False):
        if isinstance(mod, _ParallelLinear) and mod.mp > 1 and mod.blocks > 1:
            for name, dim in mod._shard_dims.items():  # only column-style layers are fused: every split is by blocks
                if dim is not None and getattr(mod, name, None) is not None:
                    out[f"{prefix}.{name}" if prefix else name] = mod.blocks
        for name, (_, blocks) in mod.__dict__.get(SHARDS_ATTR, {}).items():
            if blocks > 1:
                out[f"{prefix}.{name}" if prefix else name] = blocks
    return _with_aliases(module, out)


def interleave_blocks(parts: list[Tensor], dim: int, blocks: int) -> Tensor:
    """The dense tensor from per-rank shards ``parts`` (rank order) of a ``blocks``-fused parameter."""
    if blocks == 1:
        return torch.cat(parts, dim=dim)
    chunks = [p.chunk(blocks, dim=dim) for p in parts]
    return torch.cat([c[b] for b in range(blocks) for c in chunks], dim=dim)
