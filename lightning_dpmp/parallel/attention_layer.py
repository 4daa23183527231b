"""Head-parallel ``nn.MultiheadAttention``: each MP rank computes ``num_heads / mp`` heads.

torch's ``nn.MultiheadAttention`` keeps q, k and v in one bare parameter ``in_proj_weight`` ``(3E, E)`` (+
``in_proj_bias``), and ``F.multi_head_attention_forward`` reads ``out_proj.weight`` without calling ``out_proj``,
so no Linear-level plan can split it. This layer holds, on rank ``r`` of ``mp``:

* ``in_proj_weight``: rows of its heads in each of the q, k and v blocks, ``(3E/mp, E)`` (a fused column layer
  with 3 blocks; ``in_proj_bias`` likewise);
* ``out_proj``: a :class:`~lightning_dpmp.parallel.layers.RowParallelLinear` holding the matching columns
  ``(E, E/mp)``; its output is all-reduced and its bias added once.

Layout: requires a replicated input (entered with a copy: backward all-reduce), produces a replicated output.
Cost per call: 1 all-reduce forward, 1 backward (per distinct input tensor for cross-attention). With
``need_weights=True`` the per-head weights are all-gathered along the head dim (1 all-gather forward) and averaged
like the dense module. The computation mirrors ``F.multi_head_attention_forward`` op for op with the local head
count, so a float64 run matches the dense module to rounding.

Example:
    >>> attn = HeadParallelMultiheadAttention.from_dense(nn.MultiheadAttention(32, 4), grid.mp_group)
    >>> attn.to_dense()   # the nn.MultiheadAttention again, gathered (collective)
    MultiheadAttention(...)
"""

from __future__ import annotations

import copy
import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import Self

from lightning_dpmp.parallel.comm import copy_to_group, gather_from_group
from lightning_dpmp.parallel.entry import SharedInputCopy
from lightning_dpmp.parallel.layers import RowParallelLinear
from lightning_dpmp.parallel.sharding import DenseGather, ParallelLinear, dense_template, divide

__all__ = ["HeadParallelMultiheadAttention", "unsupported_reason"]


def unsupported_reason(mha: nn.MultiheadAttention, mp: int) -> Optional[str]:
    """Why ``mha`` cannot be made head-parallel at width ``mp`` (``None`` when it can)."""
    if mha.in_proj_weight is None:  # public twin of mha._qkv_same_embed_dim
        return "separate q/k/v projection weights (kdim/vdim differ from embed_dim)"
    if mha.bias_k is not None or mha.add_zero_attn:
        return "add_bias_kv/add_zero_attn append a key/value shared by all heads"
    if mha.num_heads % mp:
        return f"num_heads={mha.num_heads} not divisible by mp={mp}"
    return None


def _float_mask(mask: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    """A boolean mask (True = masked) as an additive float mask; float masks pass through (as the dense module)."""
    if mask is None or torch.is_floating_point(mask):
        return mask
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))


class HeadParallelMultiheadAttention(ParallelLinear):
    """``nn.MultiheadAttention`` (packed q/k/v, no bias_k/bias_v) split by heads; see the module docstring.

    Args:
        dense: the initialised module to slice (``from_dense`` is the way to build one).
        group: the MP process group.
        shared_input: a :class:`SharedInputCopy` shared with sibling column layers reading the same input.
        rng: an RNG tracker: attention-probability dropout draws per-rank masks inside the split region.
    """

    _shard_dims = {"in_proj_weight": 0, "in_proj_bias": 0}
    blocks = 3  # q | k | v
    # torch's fast paths (TransformerEncoderLayer's fused kernel, TransformerEncoder's nested tensors) read
    # self_attn's weights directly and would compute with the local shards; this is the flag that turns them off
    # (they check it before anything else about the attention).
    _qkv_same_embed_dim = False

    def __init__(self, dense: nn.MultiheadAttention, group: Any, shared_input: Optional[SharedInputCopy] = None,
                 rng: Optional[Any] = None) -> None:
        super().__init__(dense.embed_dim, 3 * dense.embed_dim, group)
        reason = unsupported_reason(dense, self.mp)
        if reason is not None:
            raise ValueError(f"HeadParallelMultiheadAttention cannot split this nn.MultiheadAttention: {reason}.")
        w, b = dense.in_proj_weight, dense.in_proj_bias
        self.embed_dim, self.num_heads, self.batch_first = dense.embed_dim, dense.num_heads, dense.batch_first
        self.head_dim = dense.head_dim
        self.local_heads = divide(dense.num_heads, self.mp, "num_heads")
        self.dropout = dense.dropout
        self.shared_input, self.rng = shared_input, rng
        local = 3 * self.local_heads * self.head_dim
        self.in_proj_weight = nn.Parameter(torch.empty(local, self.embed_dim, device=w.device, dtype=w.dtype),
                                           requires_grad=w.requires_grad)
        self.in_proj_bias = (
            nn.Parameter(torch.empty(local, device=b.device, dtype=b.dtype), requires_grad=b.requires_grad)
            if b is not None else None
        )
        self.out_proj = RowParallelLinear.from_dense(dense.out_proj, group, rng=rng)
        self.__dict__["_template"] = dense_template(dense)  # the dense module's class and settings, no tensors

    @classmethod
    def from_dense(cls, dense: nn.MultiheadAttention, group: Any, **kwargs: Any) -> Self:  # type: ignore[override]
        """Slice an initialised ``nn.MultiheadAttention``: this rank's heads of q, k, v and of ``out_proj``."""
        layer = cls(dense, group, **kwargs)
        layer._init_from(dense)
        layer.train(dense.training)
        return layer

    def reset_parameters(self) -> None:
        """nn.MultiheadAttention's init: xavier-uniform on the dense (3E, E) bound, zero in_proj bias."""
        bound = math.sqrt(6.0 / (self.embed_dim + 3 * self.embed_dim))
        with torch.no_grad():
            self.in_proj_weight.uniform_(-bound, bound)
            if self.in_proj_bias is not None:
                self.in_proj_bias.zero_()

    def _dense_module(self, device: torch.device, gather: DenseGather) -> nn.Module:
        dense = copy.deepcopy(self.__dict__["_template"])
        out = self.out_proj
        dense.out_proj = out.to_dense(gather) if isinstance(out, ParallelLinear) else out
        p = self.in_proj_weight
        dense.in_proj_weight = nn.Parameter(
            torch.empty(3 * self.embed_dim, self.embed_dim, device=device, dtype=p.dtype),
            requires_grad=p.requires_grad,
        )
        if self.in_proj_bias is not None:
            dense.in_proj_bias = nn.Parameter(torch.empty(3 * self.embed_dim, device=device, dtype=p.dtype),
                                              requires_grad=self.in_proj_bias.requires_grad)
        return dense

    def _enter(self, x: Tensor) -> Tensor:
        return self.shared_input(x) if self.shared_input is not None else copy_to_group(x, self.group)

    def forward(  # the signature of nn.MultiheadAttention.forward
        self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor] = None,
        need_weights: bool = True, attn_mask: Optional[Tensor] = None, average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Optional[Tensor]]:
        batched = query.dim() == 3
        if self.batch_first and batched:
            query, key, value = _time_first(query, key, value)
        if not batched:
            query, key, value = (t.unsqueeze(1) for t in (query, key, value))
            key_padding_mask = key_padding_mask.unsqueeze(0) if key_padding_mask is not None else None
        tgt, bsz, _ = query.shape
        src = key.shape[0]
        kpm = _float_mask(key_padding_mask, query.dtype)
        if is_causal and attn_mask is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint (as nn.MultiheadAttention).")
        if is_causal and kpm is None and not need_weights:
            attn_mask = None
        else:
            attn_mask = _float_mask(attn_mask, query.dtype)
            is_causal = is_causal and kpm is None
        q, k, v = self._project(query, key, value)
        h, hd = self.local_heads, self.head_dim
        if attn_mask is not None:
            attn_mask = self._local_mask(attn_mask, bsz, tgt, src)
        q = q.view(tgt, bsz * h, hd).transpose(0, 1)
        k = k.view(src, bsz * h, hd).transpose(0, 1)
        v = v.view(src, bsz * h, hd).transpose(0, 1)
        if kpm is not None:
            kpm = kpm.view(bsz, 1, 1, src).expand(-1, h, -1, -1).reshape(bsz * h, 1, src)
            attn_mask = kpm if attn_mask is None else attn_mask + kpm
        p = self.dropout if self.training else 0.0
        if self.rng is not None:
            self.rng.enter_for(self.training)  # per-head dropout masks differ across MP ranks (different heads)
        weights: Optional[Tensor] = None
        if need_weights:
            if is_causal and attn_mask is None:
                raise AssertionError("is_causal without a mask is not implemented for need_weights (as in torch)")
            qs = q * math.sqrt(1.0 / float(hd))
            kt = k.transpose(-2, -1)
            w = torch.baddbmm(attn_mask, qs, kt) if attn_mask is not None else torch.bmm(qs, kt)
            w = F.softmax(w, dim=-1)
            if p > 0.0:
                w = F.dropout(w, p=p)
            out = torch.bmm(w, v).transpose(0, 1).reshape(tgt * bsz, h * hd)
            weights = gather_from_group(w.view(bsz, h, tgt, src), self.group, 1)  # all heads, in head order
            if average_attn_weights:
                weights = weights.mean(dim=1)
        else:
            if attn_mask is not None:
                one_mask = attn_mask.size(0) == 1 and attn_mask.dim() == 3
                attn_mask = attn_mask.unsqueeze(0) if one_mask else attn_mask.view(bsz, h, -1, src)
            q, k, v = (t.view(bsz, h, -1, hd) for t in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask, p, is_causal)
            out = out.permute(2, 0, 1, 3).reshape(bsz * tgt, h * hd)
        out = self.out_proj(out).view(tgt, bsz, self.embed_dim)  # row-parallel: all-reduce, then + bias
        if not batched:
            out = out.squeeze(1)
            weights = weights.squeeze(0) if weights is not None else None
        elif self.batch_first:
            out = out.transpose(1, 0)
        return out, weights

    def _project(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """This rank's heads of q, k, v, each ``(T, N, h * head_dim)``; one region entry per distinct input."""
        w, b = self.in_proj_weight, self.in_proj_bias
        xq = self._enter(query)
        if key is query and value is query:  # as torch's _in_projection_packed: one matmul, contiguous q, k, v
            proj = F.linear(xq, w, b).unflatten(-1, (3, w.shape[0] // 3)).unsqueeze(0).transpose(0, -2)
            proj = proj.squeeze(-2).contiguous()
            return proj[0], proj[1], proj[2]
        xk = self._enter(key)
        xv = xk if value is key else self._enter(value)
        ws, bs = w.chunk(3), (b.chunk(3) if b is not None else (None, None, None))
        return F.linear(xq, ws[0], bs[0]), F.linear(xk, ws[1], bs[1]), F.linear(xv, ws[2], bs[2])

    def _local_mask(self, mask: Tensor, bsz: int, tgt: int, src: int) -> Tensor:
        """A 2-D ``(L, S)`` mask as ``(1, L, S)``; a per-head ``(N*H, L, S)`` one cut to this rank's heads."""
        if mask.dim() == 2:
            if mask.shape != (tgt, src):
                raise RuntimeError(f"The shape of the 2D attn_mask is {tuple(mask.shape)}, but should be {(tgt, src)}.")
            return mask.unsqueeze(0)
        if mask.dim() != 3 or mask.shape != (bsz * self.num_heads, tgt, src):
            raise RuntimeError(f"attn_mask of shape {tuple(mask.shape)}: expected (L, S) or (N*num_heads, L, S).")
        h0 = self.mp_rank * self.local_heads
        local = mask.view(bsz, self.num_heads, tgt, src)[:, h0:h0 + self.local_heads]
        return local.reshape(bsz * self.local_heads, tgt, src)

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads} ({self.local_heads} here),"
                f" batch_first={self.batch_first}, mp={self.mp}")


def _time_first(query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(N, T, E) -> (T, N, E), keeping "the same tensor" relations (self-attention stays one entry)."""
    if key is value:
        if query is key:
            query = key = value = query.transpose(1, 0)
        else:
            query, key = (x.transpose(1, 0) for x in (query, key))
            value = key
    else:
        query, key, value = (x.transpose(1, 0) for x in (query, key, value))
    return query, key, value

