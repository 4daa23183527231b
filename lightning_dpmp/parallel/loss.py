"""Vocab-parallel cross-entropy: the loss of logits split by vocabulary across the MP group, never gathered.

Each rank holds logits for ``V/mp`` classes. The loss needs, per row, the max logit (all-reduce MAX), and the
target logit, the sum of exponentials and (for label smoothing) the sum of logits (one all-reduce SUM of the
three together): two all-reduces forward, none backward, whatever the vocabulary size.

:class:`VocabShardedLogits` is what a vocab-parallel LM head returns: the local shard, which routes
``F.cross_entropy`` here and gathers the full logits for any other use, so model code needs no change.

Example:
    >>> loss = vocab_parallel_cross_entropy(local_logits, targets, grid.mp_group, ignore_index=-100)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lightning_dpmp.parallel.comm import all_reduce_sum, gather_from_group, group_rank, group_size

__all__ = ["VocabShardedLogits", "vocab_parallel_cross_entropy"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """forward: per-row loss from vocab shards (all-reduce MAX, then SUM); backward: local softmax gradient."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, target: Tensor, group: Any, ignore_index: int, smoothing: float) -> Tensor:
        n, rank = group_size(group), group_rank(group)
        local_v = logits.shape[-1]
        vocab = local_v * n
        start = rank * local_v
        logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        row_max = logits.max(dim=-1).values
        if n > 1:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - row_max.unsqueeze(-1)
        ignored = target == ignore_index
        local_t = target - start
        mine = (local_t >= 0) & (local_t < local_v) & ~ignored
        safe_t = torch.where(mine, local_t, torch.zeros_like(local_t))
        picked = shifted.gather(-1, safe_t.unsqueeze(-1)).squeeze(-1) * mine
        exp = shifted.exp()
        stats = torch.stack([picked, exp.sum(-1), shifted.sum(-1)])  # one all-reduce for all three
        all_reduce_sum(stats, group)
        picked, sum_exp, sum_shifted = stats
        log_z = sum_exp.log()
        loss = log_z - picked
        if smoothing > 0:
            loss = (1 - smoothing) * loss + smoothing * (log_z - sum_shifted / vocab)
        loss = loss.masked_fill(ignored, 0.0)
        ctx.save_for_backward(exp, sum_exp, safe_t, mine, ignored)
        ctx.smoothing, ctx.vocab, ctx.in_dtype = smoothing, vocab, logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], None, None, None, None]:
        exp, sum_exp, safe_t, mine, ignored = ctx.saved_tensors
        g = exp / sum_exp.unsqueeze(-1)
        onehot = torch.zeros_like(g).scatter_(-1, safe_t.unsqueeze(-1), 1.0) * mine.unsqueeze(-1)
        g = g - (1 - ctx.smoothing) * onehot - ctx.smoothing / ctx.vocab
        g = g * (grad * ~ignored).unsqueeze(-1)
        return g, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: Tensor,
    target: Tensor,
    group: Any,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> Tensor:
    """``F.cross_entropy(full_logits, target, ...)`` computed from this rank's vocab shard ``logits`` (..., V/mp).

    Rank ``r`` holds classes ``[r*V/mp, (r+1)*V/mp)``. ``reduction`` is ``"mean"`` (over non-ignored targets, as
    torch does), ``"sum"`` or ``"none"``. Class weights are not supported (use the full logits for those).
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    flat = logits.reshape(-1, logits.shape[-1])
    losses = _VocabParallelCrossEntropy.apply(flat, target.reshape(-1), group, ignore_index, float(label_smoothing))
    if reduction == "none":
        return losses.view(target.shape).to(logits.dtype)
    total = losses.sum()
    if reduction == "sum":
        return total.to(logits.dtype)
    return (total / (target != ignore_index).sum()).to(logits.dtype)


_PASSTHROUGH = {"size", "dim", "numel", "__get__", "__len__", "is_contiguous", "element_size", "data_ptr", "stride"}
_KEEP_SHARDED = {"view", "reshape", "flatten", "contiguous", "float", "to", "detach", "type_as", "double", "half", "bfloat16"}


class VocabShardedLogits(torch.Tensor):
    """This rank's vocab shard of LM-head logits (last dim ``V/mp``), still on the autograd graph.

    ``F.cross_entropy`` on it runs :func:`vocab_parallel_cross_entropy`; reshapes that keep the last dim keep it
    sharded (a literal full vocabulary size in ``view`` is read as the local one); anything else all-gathers the
    full logits first, so code that inspects logits (``argmax``, sampling) stays correct.
    """

    _dpmp_group: Any = None
    _dpmp_vocab: int = 0

    @staticmethod
    def wrap(local: Tensor, group: Any, vocab: int) -> "VocabShardedLogits":
        out = local.as_subclass(VocabShardedLogits)
        out._dpmp_group, out._dpmp_vocab = group, vocab
        return out

    def full(self) -> Tensor:
        """The gathered full logits (collective over the MP group)."""
        return gather_from_group(self.as_subclass(Tensor), self._dpmp_group, -1)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        meta = next(a for a in list(args) + list(kwargs.values()) if isinstance(a, VocabShardedLogits))
        group, vocab = meta._dpmp_group, meta._dpmp_vocab

        def plain(x: Any) -> Any:
            return x.as_subclass(Tensor) if isinstance(x, VocabShardedLogits) else x

        with torch._C.DisableTorchFunctionSubclass():
            if name in _PASSTHROUGH:
                return func(*[plain(a) for a in args], **kwargs)
            if func is F.cross_entropy and isinstance(args[0], VocabShardedLogits) and kwargs.get("weight") is None:
                if len(args) > 2 or args[0].dim() != 2:
                    pass  # positional legacy arguments or (N, C, d...) layouts: take the general path below
                else:
                    return vocab_parallel_cross_entropy(
                        plain(args[0]), args[1], group, kwargs.get("ignore_index", -100),
                        kwargs.get("reduction", "mean"), kwargs.get("label_smoothing", 0.0),
                    )
            if name == "__getitem__" and isinstance(args[0], VocabShardedLogits) and _keeps_last_dim(args[1], args[0].dim()):
                out = func(plain(args[0]), args[1])  # e.g. the shift logits[:, :-1]: the vocab dim is untouched
                return VocabShardedLogits.wrap(out, group, vocab)
            if name in _KEEP_SHARDED and isinstance(args[0], VocabShardedLogits):
                local_v = args[0].shape[-1]
                def local(d: Any) -> Any:
                    is_int = isinstance(d, int) and not isinstance(d, bool)
                    return local_v if is_int and d == vocab and name in ("view", "reshape") else d

                rest = [local(a) for a in args[1:]]
                if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)):
                    rest = [tuple(local(d) for d in rest[0])]
                out = func(plain(args[0]), *rest, **kwargs)
                if isinstance(out, Tensor) and out.shape[-1] == local_v:
                    return VocabShardedLogits.wrap(out, group, vocab)
                return out
            full_args = [a.full() if isinstance(a, VocabShardedLogits) else a for a in args]
            full_kwargs = {k: (v.full() if isinstance(v, VocabShardedLogits) else v) for k, v in kwargs.items()}
            return func(*full_args, **full_kwargs)


def _keeps_last_dim(index: Any, ndim: int) -> bool:
    """Whether ``x[index]`` leaves the last (vocab) dim of an ``ndim``-dim tensor whole and last."""
    items = index if isinstance(index, tuple) else (index,)
    if not items or items[-1] is None:
        return not items  # a trailing None would push the vocab dim off the end

    def width(it: Any) -> int:
        if it is None or it is Ellipsis:
            return 0
        if isinstance(it, Tensor) and it.dtype == torch.bool:
            return it.dim()
        return 1

    consuming = [it for it in items if width(it)]
    if Ellipsis not in items and sum(width(it) for it in items) < ndim:
        return True  # the trailing dims, the vocab one included, are taken whole
    if Ellipsis in items and items[-1] is Ellipsis:
        return True
    last = consuming[-1] if consuming else slice(None)
    return isinstance(last, slice) and last == slice(None)
