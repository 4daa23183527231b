"""Tensor-parallel drop-in replacements for ``nn.Embedding``, against an explicit process group.

* :class:`VocabParallelEmbedding` holds vocabulary rows ``E[r*V/mp:(r+1)*V/mp]``: local lookup of the ids in
  range, one all-reduce (or a reduce-scatter over the sequence with sequence parallelism). A vocabulary ``mp``
  does not divide is padded with zero rows to the next multiple (``ceil(V/mp)`` rows per rank, Megatron's
  layout); no id reaches them, and gathers, checkpoints and exports strip them.
* :class:`ColumnParallelEmbedding` holds columns ``E[:, r*D/mp:(r+1)*D/mp]`` (a per-head relative position bias):
  no communication.
* :func:`vocab_parallel` splits any ``nn.Embedding`` by rows, subclasses included: a subclass whose ``forward``
  does more than the lookup (Gemma's and BART's ``embed_scale``) keeps its class and code, and only the lookup it
  reaches through ``super().forward`` becomes the vocab-parallel one.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import Self

from lightning_dpmp.parallel.comm import group_rank, group_size, reduce_from_group, reduce_scatter_to_sequence
from lightning_dpmp.parallel.sharding import (
    DenseGather,
    ParallelLinear,
    dense_template,
    divide,
    padded_blocks,
    shard_tensor,
)

__all__ = ["ColumnParallelEmbedding", "VocabParallelEmbedding", "vocab_parallel"]


def _require_plain(emb: nn.Embedding) -> None:
    """Refuse the lookups a vocab split cannot do locally (``max_norm`` renormalises rows, ``sparse`` gradients)."""
    if emb.max_norm is not None or emb.sparse or emb.scale_grad_by_freq:
        raise ValueError(
            "VocabParallelEmbedding supports plain embeddings (no max_norm, sparse, scale_grad_by_freq)."
        )


def _local_pad(padding_idx: Optional[int], start: int, rows: int) -> Optional[int]:
    """The padding row's index in a shard of ``rows`` rows from ``start``; ``None`` when there is none or another
    rank holds it."""
    pad = None if padding_idx is None else padding_idx - start
    return pad if pad is not None and 0 <= pad < rows else None


class VocabParallelEmbedding(ParallelLinear):
    """``nn.Embedding`` split by vocabulary rows: rank ``r`` holds ids ``[r*V/mp, (r+1)*V/mp)``.

    Forward: ids outside the local range look up row 0 and are zeroed, then one all-reduce sums the shards' rows
    (backward: identity; each rank's weight gradient touches only its own rows).

    Example:
        >>> emb = VocabParallelEmbedding.from_dense(nn.Embedding(256, 64), grid.mp_group)  # weight (256 // mp, 64)
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
        self.blocks = padded_blocks(num_embeddings, self.mp)  # rows padded to a multiple of mp, never looked up
        local = -(-num_embeddings // self.mp)
        self.start = self.mp_rank * local
        self.padding_idx = padding_idx
        self.weight = nn.Parameter(torch.empty(local, embedding_dim, device=device, dtype=dtype))
        if self.weight.device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Embedding's default: N(0, 1), with the padding row (if this rank holds it) zeroed."""
        with torch.no_grad():
            self.weight.normal_()
            pad = _local_pad(self.padding_idx, self.start, self.weight.shape[0])
            if pad is not None:
                self.weight[pad].zero_()
        self.zero_padding()

    @classmethod
    def from_dense(cls, emb: nn.Embedding, group: Any, sequence_dim: Optional[int] = None) -> Self:  # type: ignore[override]
        _require_plain(emb)
        layer = cls(emb.num_embeddings, emb.embedding_dim, group=group, padding_idx=emb.padding_idx,
                    sequence_dim=sequence_dim, device=emb.weight.device, dtype=emb.weight.dtype)
        layer._init_from(emb)
        layer.train(emb.training)
        return layer

    def _dense_module(self, device: torch.device, gather: DenseGather) -> nn.Module:
        return nn.Embedding(
            self.num_embeddings, self.embedding_dim, padding_idx=self.padding_idx, device=device,
            dtype=self.weight.dtype,
        )

    def forward(self, ids: Tensor) -> Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        pad = _local_pad(self.padding_idx, self.start, self.weight.shape[0])  # it gets no gradient in nn.Embedding
        rows = F.embedding(local.masked_fill(outside, 0), self.weight, padding_idx=pad)
        rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_dim is not None:  # sequence parallel: sum the shards and keep this rank's tokens
            if self.rng is not None:
                self.rng.enter_for(self.training)  # from here on each rank holds different tokens: per-rank masks
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
        >>> bias = ColumnParallelEmbedding.from_dense(nn.Embedding(32, 8), grid.mp_group)  # weight (32, 8 // mp)
    """

    _shard_dims = {"weight": 1}

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group: Any = None, padding_idx: Optional[int] = None,
                 sequence_dim: Optional[int] = None, device: Optional[torch.device] = None,
                 dtype: Optional[torch.dtype] = None) -> None:
        ParallelLinear.__init__(self, num_embeddings, embedding_dim, group)
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


class _VocabRows(nn.Embedding, ParallelLinear):  # type: ignore[misc]  # both declare weight: one Parameter
    """What a split nn.Embedding subclass gains: ``nn.Embedding.forward`` (which the subclass reaches through
    ``super().forward``) becomes the vocab-parallel lookup, and the split layer's interface (shards, ``to_dense``).

    Never constructed: :func:`vocab_parallel` builds ``type("VocabParallel<Cls>", (Cls, _VocabRows), {})``, whose
    method order puts the subclass's own code first and this lookup in place of ``nn.Embedding``'s.
    """

    _shard_dims = {"weight": 0}
    bias = None
    start: int
    sequence_dim: Optional[int]
    rng: Optional[Any]
    forward = VocabParallelEmbedding.forward  # type: ignore[assignment]
    reset_parameters = VocabParallelEmbedding.reset_parameters

    def _fill_padding_idx_with_zero(self) -> None:  # nn.Embedding's reads a global row of the local shard
        pad = _local_pad(self.padding_idx, self.start, self.weight.shape[0])
        if pad is not None:
            with torch.no_grad():
                self.weight[pad].zero_()

    def _dense_module(self, device: torch.device, gather: DenseGather) -> nn.Module:
        dense = copy.deepcopy(self.__dict__["_template"])  # the subclass itself, with its attributes and buffers
        dense.weight = nn.Parameter(torch.empty(self.num_embeddings, self.embedding_dim, device=device,
                                                dtype=self.weight.dtype), requires_grad=self.weight.requires_grad)
        return dense

    def extra_repr(self) -> str:
        return f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, mp={self.mp}"


_ROW_CLASSES: dict[type, type[_VocabRows]] = {}  # one split class per subclass


def vocab_parallel(emb: nn.Embedding, group: Any, sequence_dim: Optional[int] = None, rng: Optional[Any] = None
                   ) -> nn.Module:
    """``emb`` split by vocabulary rows over ``group`` (its weights sliced, training starts from them); ``rng``:
    the dropout tracker a sequence-parallel lookup switches to per-rank masks.

    A plain ``nn.Embedding`` becomes a :class:`VocabParallelEmbedding`. A subclass keeps its class, attributes,
    buffers and ``forward``, in a derived class whose ``nn.Embedding.forward`` is the vocab-parallel lookup: code
    around ``super().forward(ids)`` (a scale) runs on the summed rows. The planner splits a subclass only when the
    traced step showed its lookup going through ``nn.Embedding.forward``. ``to_dense`` gives the subclass back.

    Example:
        >>> class Scaled(nn.Embedding):
        ...     def forward(self, ids):
        ...         return super().forward(ids) * 8.0
        >>> vocab_parallel(Scaled(256, 64), grid.mp_group)   # doctest: +SKIP
        VocabParallelScaled(num_embeddings=256, embedding_dim=64, mp=2)
    """
    if type(emb) is nn.Embedding:
        plain = VocabParallelEmbedding.from_dense(emb, group, sequence_dim=sequence_dim)
        plain.rng = rng
        return plain
    _require_plain(emb)
    cls = type(emb)
    if cls not in _ROW_CLASSES:
        _ROW_CLASSES[cls] = type(f"VocabParallel{cls.__name__}", (cls, _VocabRows), {"__module__": __name__})
    layer = _ROW_CLASSES[cls].__new__(_ROW_CLASSES[cls])
    # the subclass's state as it is (attributes, buffers, hooks), in containers of its own
    layer.__dict__.update({k: type(v)(v) if isinstance(v, dict) else v for k, v in emb.__dict__.items()})
    layer.in_features, layer.out_features = emb.num_embeddings, emb.embedding_dim  # ParallelLinear's sizes
    layer.group, layer.mp, layer.mp_rank = group, group_size(group), group_rank(group)
    layer.blocks = padded_blocks(emb.num_embeddings, layer.mp)
    local = -(-emb.num_embeddings // layer.mp)
    layer.start, layer.sequence_dim, layer.rng = layer.mp_rank * local, sequence_dim, rng
    layer.__dict__["_template"] = dense_template(emb)
    w = emb.weight
    layer.weight = nn.Parameter(shard_tensor(w.detach(), 0, layer.mp, layer.mp_rank, layer.blocks).clone(),
                                requires_grad=w.requires_grad)
    return layer
