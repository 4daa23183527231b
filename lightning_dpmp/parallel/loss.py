"""Vocab-parallel cross-entropy: the loss of logits split by vocabulary across the MP group, never gathered.

Each rank holds logits for ``V/mp`` classes. The loss needs, per row, the max logit (all-reduce MAX), and the
target logit, the sum of exponentials and (for label smoothing) the sum of logits (one all-reduce SUM of the
three together): two all-reduces forward, none backward, whatever the vocabulary size.

:class:`VocabShardedLogits` is what a vocab-parallel LM head returns in the mode its traced step was proven in:
the local shard, reporting the full shape, which routes ``F.cross_entropy`` here, keeps slicing and reshapes along
other dims local, and refuses (never gathers behind the user's back) anything that needs the whole vocabulary.

Example:
    >>> local_logits, targets = torch.randn(4, 10), torch.tensor([1, 2, 3, -100])   # mp=1: the whole vocabulary
    >>> loss = vocab_parallel_cross_entropy(local_logits, targets, grid.mp_group, ignore_index=-100)
    >>> torch.allclose(loss, torch.nn.functional.cross_entropy(local_logits, targets))
    True
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

import lightning_dpmp.compat as compat
from lightning_dpmp.compat import tree_leaves, tree_map
from lightning_dpmp.parallel.comm import all_reduce_sum, gather_from_group, group_rank, group_size

__all__ = ["VocabShardedLogits", "VocabShardedLogitsError", "vocab_parallel_cross_entropy"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """forward: per-row loss from vocab shards (all-reduce MAX, then SUM); backward: local softmax gradient."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, target: Tensor, group: Any, ignore_index: int, smoothing: float,
                vocab: int) -> Tensor:
        n, rank = group_size(group), group_rank(group)
        local_v = logits.shape[-1]
        start = rank * local_v
        logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        real = min(max(vocab - start, 0), local_v)  # classes past the vocabulary pad it to a multiple of mp
        padded = real < local_v
        if padded:  # they take no part: exp(-inf) = 0 in the sum, never the max, never a target
            logits = logits.masked_fill(torch.arange(local_v, device=logits.device) >= real, float("-inf"))
        row_max = logits.max(dim=-1).values
        if n > 1:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - row_max.unsqueeze(-1)
        ignored = target == ignore_index
        local_t = target - start
        mine = (local_t >= 0) & (local_t < local_v) & ~ignored
        safe_t = torch.where(mine, local_t, torch.zeros_like(local_t))
        picked = torch.where(mine, shifted.gather(-1, safe_t.unsqueeze(-1)).squeeze(-1), 0.0)  # (-inf * 0: nan)
        # The sum of exponentials is accumulated in float64 and rounded back to the logits' dtype: the same bits
        # at every mp (a float32 sum of per-rank float32 partial sums would round differently for each split), and
        # the correctly rounded value, which is what torch's own float32 log_softmax gives on most rows.
        wide = torch.float64 if logits.dtype != torch.float64 else logits.dtype
        real_shifted = shifted[..., :real] if padded else shifted
        stats = torch.stack([picked.to(wide), shifted.exp().sum(-1, dtype=wide), real_shifted.sum(-1, dtype=wide)])
        all_reduce_sum(stats, group)  # one all-reduce for all three
        picked, sum_exp, sum_shifted = stats.to(logits.dtype)
        log_z = sum_exp.log()
        # torch's log_softmax + nll_loss, op for op: log-probabilities (x - max) - log(sum), the loss their negated
        # target entry, the gradient exp(log-probability) scaled, minus the scale at the target; a float32 loss
        # inside a float64 model (transformers' labels=) then rounds as one process does wherever the sums agree.
        log_probs = shifted - log_z.unsqueeze(-1)
        loss = log_z - picked
        if smoothing > 0:
            loss = (1 - smoothing) * loss + smoothing * (log_z - sum_shifted / vocab)
        loss = loss.masked_fill(ignored, 0.0)
        ctx.save_for_backward(log_probs, safe_t, mine, ignored)
        ctx.smoothing, ctx.vocab, ctx.real = smoothing, vocab, real
        return loss

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], None, None, None, None, None]:
        log_probs, safe_t, mine, ignored = ctx.saved_tensors
        scale = (grad * ~ignored).unsqueeze(-1)
        g = log_probs.exp() * scale
        onehot = torch.zeros_like(g).scatter_(-1, safe_t.unsqueeze(-1), 1.0) * mine.unsqueeze(-1)
        g = g - (1 - ctx.smoothing) * onehot * scale
        if ctx.smoothing:
            g[..., :ctx.real] -= (ctx.smoothing / ctx.vocab) * scale  # the padding classes get no gradient at all
        return g, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: Tensor,
    target: Tensor,
    group: Any,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    vocab: Optional[int] = None,
) -> Tensor:
    """``F.cross_entropy(full_logits, target, ...)`` computed from this rank's vocab shard ``logits`` (..., V/mp).

    Rank ``r`` holds classes ``[r*V/mp, (r+1)*V/mp)``. ``reduction`` is ``"mean"`` (over non-ignored targets, as
    torch does), ``"sum"`` or ``"none"``. Class weights are not supported (use the full logits for those).
    ``vocab``: the number of classes when ``mp`` does not divide it; each rank then holds ``ceil(V/mp)`` columns and
    those past ``V`` (the padding) are left out of the max, the sums and the gradient.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    flat = logits.reshape(-1, logits.shape[-1])
    classes = vocab if vocab is not None else flat.shape[-1] * group_size(group)
    losses = _VocabParallelCrossEntropy.apply(flat, target.reshape(-1), group, ignore_index, float(label_smoothing),
                                              classes)
    if reduction == "none":
        return losses.view(target.shape).to(logits.dtype)
    total = losses.sum()
    if reduction == "sum":
        return total.to(logits.dtype)
    return (total / (target != ignore_index).sum()).to(logits.dtype)


# Ops computed on the local shard when the vocab dim provably stays last and whole: element-wise ops (the other
# tensor operands must broadcast over the vocab dim, size 1 there), layout ops and reductions over other dims.
# A meta-tensor probe of the op at the logical and at the local shape decides; these are the names it may try.
# They cover every op the planner's flow lets a vocab-parallel head's logits pass through on their way to the loss
# (lightning_dpmp.planner.flow.OPS, bar the attention-like ones, which a loss in (N, classes) layout never follows).
ELEMENTWISE = frozenset({
    "relu", "relu_", "gelu", "silu", "silu_", "sigmoid", "sigmoid_", "tanh", "tanh_", "elu", "selu", "celu",
    "leaky_relu", "hardtanh", "relu6", "softplus", "mish", "hardswish", "hardsigmoid", "logsigmoid", "softsign",
    "dropout", "dropout_", "alpha_dropout", "exp", "log", "neg", "__neg__", "__pos__", "abs", "square", "sqrt",
    "rsqrt", "sin", "cos", "erf", "clamp", "clamp_", "clip", "nan_to_num",
    "add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_", "true_divide", "pow", "maximum", "minimum",
    "__add__", "__radd__", "__iadd__", "__sub__", "__rsub__", "__isub__", "__mul__", "__rmul__", "__imul__",
    "__truediv__", "__rtruediv__", "__itruediv__", "__pow__", "masked_fill", "masked_fill_", "where",
    "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "eq", "ne", "lt", "le", "gt", "ge",
    "logical_and", "logical_or", "logical_xor", "logical_not", "__and__", "__or__", "__xor__", "__iand__", "__ior__",
    "__invert__", "isnan", "isinf", "isfinite",
})
LAYOUT = frozenset({
    "view", "reshape", "flatten", "unflatten", "view_as", "reshape_as", "transpose", "swapaxes", "swapdims",
    "permute", "t", "chunk", "split", "unbind", "tensor_split", "sum", "mean", "amax", "amin", "var", "std",
    "logsumexp", "prod", "max", "min", "all", "any", "expand", "expand_as", "broadcast_to", "repeat", "cat",
    "concat", "concatenate", "stack", "unsqueeze", "squeeze", "narrow", "repeat_interleave",
})
# Same shape and layout as the input, whatever the arguments: run on the shard, no probe needed.
KEEP = frozenset({"float", "double", "half", "bfloat16", "to", "type_as", "type", "contiguous", "detach", "clone",
                  "requires_grad_", "detach_", "data"})
# Queries answered from the local tensor as it is (autograd plumbing, memory layout).
# (torch.compile's tracer asks the storage and view questions of every input tensor.)
_PASSTHROUGH = frozenset({"is_contiguous", "element_size", "data_ptr", "stride", "storage_offset", "register_hook",
                          "retain_grad", "backward", "get_device", "is_floating_point", "is_complex", "_is_view",
                          "untyped_storage", "_typed_storage", "is_shared", "is_pinned", "is_inference", "dim_order",
                          "is_signed", "_is_zerotensor", "is_neg", "is_conj", "_nested_tensor_size"})
# refused: they move or count the vocab
_LAYOUT_PROPERTIES = frozenset({"T", "mT", "H", "mH", "real", "imag", "nbytes"})
_SIZED = frozenset({"view", "reshape", "expand", "broadcast_to"})  # their last size argument may be the vocab size


class VocabShardedLogitsError(RuntimeError):
    """An op on :class:`VocabShardedLogits` that this rank cannot compute from its shard alone."""


class VocabShardedLogits(torch.Tensor):
    """This rank's vocab shard of LM-head logits, still on the autograd graph, that looks like the full logits.

    It exists only where the traced step proved the logits reach nothing but ``F.cross_entropy``; a
    :class:`~lightning_dpmp.parallel.layers.ColumnParallelLinear` returns full logits in every other mode.

    * It reports the **full logical shape**: ``shape``, ``size()``, ``size(-1)``, ``numel()``, ``len()`` give the
      dense values, so ``view(-1, logits.size(-1))`` and shape checks read as on the dense model (the last size of
      ``view``/``reshape``/``expand`` equal to the vocabulary is read as the local one).
    * ``F.cross_entropy`` on it (``(N, V)``, class-index targets, no class weights) runs
      :func:`vocab_parallel_cross_entropy`.
    * Ops that keep the vocab dim last and whole run on the shard: slicing and reshapes along other dims
      (``logits[:, :-1].reshape(-1, V)``), ``float``/``to``/``contiguous``/``detach``, element-wise ops with
      scalars or operands of size 1 on the vocab dim (``logits / temperature``).
    * Anything else (``argmax``, ``softmax``, ``topk``, ``.tolist()``, a reduction over the vocab) raises
      :class:`VocabShardedLogitsError` naming the layer and the fix. It never gathers lazily: a gather here would
      be a collective reached only by the ranks that run this line (``if self.global_rank == 0: ...`` would hang
      the job until the process-group timeout). :meth:`full` gathers explicitly, for code every MP rank runs.
    """

    _dpmp_group: Any = None
    _dpmp_vocab: int = 0
    _dpmp_name: str = ""

    @staticmethod
    def wrap(local: Tensor, group: Any, vocab: int, name: str = "") -> "VocabShardedLogits":
        """``local`` (last dim ``vocab / mp``) as the vocab shard of logits with ``vocab`` classes, from layer
        ``name``."""
        out = local.as_subclass(VocabShardedLogits)
        out._dpmp_group, out._dpmp_vocab, out._dpmp_name = group, vocab, name
        return out

    def local(self) -> Tensor:
        """This rank's shard as a plain tensor (last dim ``vocab / mp``; classes ``[r*V/mp, (r+1)*V/mp)``)."""
        return self.as_subclass(Tensor)

    def full(self) -> Tensor:
        """The gathered full logits: a collective over the MP group, which every rank of it must call (a padded
        vocabulary's padding stripped)."""
        return gather_from_group(self.as_subclass(Tensor), self._dpmp_group, -1).narrow(-1, 0, self._dpmp_vocab)

    # No gather: printing a shard must not be a collective. (mypy reads Tensor.__repr__'s keyword from torch's
    # stubs differently from its source; the signature is the source's.)
    def __repr__(self, *, tensor_contents: Any = None) -> Any:  # type: ignore[override]
        local = tuple(self.as_subclass(Tensor).shape)
        return (f"VocabShardedLogits(local {local} of {tuple(_logical(local, self._dpmp_vocab))}, layer "
                f"{self._dpmp_name or '?'!r}, mp={group_size(self._dpmp_group)})")

    def __format__(self, spec: str) -> str:
        return self.__repr__()

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        meta = next(a for a in tree_leaves((args, kwargs)) if isinstance(a, VocabShardedLogits))
        name = getattr(func, "__name__", "")
        with compat.disable_torch_function_subclass():
            if name == "__get__":  # a property: func is the getter of the getset_descriptor named here
                prop = getattr(getattr(func, "__self__", None), "__name__", "")
                if prop == "shape":
                    return _logical(tuple(_plain(args[0]).shape), meta._dpmp_vocab)
                if prop in KEEP:  # .data
                    return _wrap_like(func(_plain(args[0])), meta)
                if prop not in _LAYOUT_PROPERTIES:  # dtype, device, requires_grad, grad_fn, ndim, ...
                    return func(*args)  # of this very tensor: an alias (as_subclass) has a grad_fn of its own
                name = prop
            return _dispatch(func, name, args, kwargs, meta)


def _dispatch(func: Any, name: str, args: tuple, kwargs: dict, meta: VocabShardedLogits) -> Any:
    """What an op on vocab-sharded logits does (called with subclass dispatch disabled)."""
    group, vocab, layer = meta._dpmp_group, meta._dpmp_vocab, meta._dpmp_name
    self = args[0] if args else None
    mine = isinstance(self, VocabShardedLogits)
    local_shape = tuple(_plain(meta).shape)
    if mine and name in ("size", "numel", "nelement", "__len__", "dim", "ndimension"):
        full = _logical(local_shape, vocab)
        if name == "size":
            return full if len(args) < 2 and "dim" not in kwargs else full[args[1] if len(args) > 1 else kwargs["dim"]]
        return {"numel": full.numel(), "nelement": full.numel(), "__len__": full[0] if full else 0}.get(name, len(full))
    if name in _PASSTHROUGH:  # on this very tensor (subclass dispatch is off): a hook on an alias would never run
        return func(*args, **kwargs)
    if func is F.cross_entropy:
        return _cross_entropy(args, kwargs, meta)
    if mine and name in KEEP:
        return _wrap_like(func(*tree_map(_plain, args), **tree_map(_plain, kwargs)), meta)
    if mine and name == "__getitem__" and _keeps_last_dim(args[1], args[0].dim()):
        return _wrap_like(func(_plain(self), tree_map(_plain, args[1])), meta)  # e.g. the shift logits[:, :-1]
    if name in ELEMENTWISE or name in LAYOUT:
        done = _local_op(func, name, args, kwargs, meta)
        if done is not _REFUSED:
            return done
    raise VocabShardedLogitsError(
        f"'{name or func}' on the vocab-sharded logits of {layer or 'a vocab-parallel head'!r} (this rank holds "
        f"{local_shape[-1] if local_shape else 0} of {vocab} classes, mp={group_size(group)}) cannot be computed "
        "from this rank's shard, and gathering here would be a collective that only the ranks running this line "
        "reach. The traced training step used these logits only for F.cross_entropy. Fix: "
        f"plan_overrides={{{layer or '<head>'!r}: 'column_gather'}} (the layer then gathers full logits in its own "
        "forward, on every rank), or compute it in eval mode or under torch.no_grad(), where the layer returns full "
        "logits."
    )


_REFUSED = object()


def _plain(x: Any) -> Any:
    return x.as_subclass(Tensor) if isinstance(x, VocabShardedLogits) else x


def _logical(local: tuple, vocab: int) -> torch.Size:
    return torch.Size(tuple(local[:-1]) + (vocab,)) if local else torch.Size(())


def _wrap_like(out: Any, meta: VocabShardedLogits) -> Any:
    return tree_map(lambda t: VocabShardedLogits.wrap(t, meta._dpmp_group, meta._dpmp_vocab, meta._dpmp_name)
                    if isinstance(t, Tensor) else t, out)


def _local_sizes(name: str, args: tuple, vocab: int, local_v: int) -> tuple:
    """``args`` of ``view``/``reshape``/``expand`` with a last size equal to the vocabulary read as the local one."""
    if name not in _SIZED or len(args) < 2:
        return args
    if len(args) == 2 and isinstance(args[1], (tuple, list, torch.Size)):
        sizes = list(args[1])
        if sizes and sizes[-1] == vocab:
            sizes[-1] = local_v
        return (args[0], type(args[1])(sizes) if not isinstance(args[1], torch.Size) else torch.Size(sizes))
    rest = list(args[1:])
    if isinstance(rest[-1], int) and not isinstance(rest[-1], bool) and rest[-1] == vocab:
        rest[-1] = local_v
    return (args[0], *rest)


def _local_op(func: Any, name: str, args: tuple, kwargs: dict, meta: VocabShardedLogits) -> Any:
    """Run ``func`` on the shard if a meta probe shows it maps logical ``(..., V)`` inputs to ``(..., V)`` outputs
    and local ``(..., V/mp)`` ones to ``(..., V/mp)``, every other size alike; ``_REFUSED`` otherwise."""
    vocab = meta._dpmp_vocab
    shards = [a for a in tree_leaves((args, kwargs)) if isinstance(a, VocabShardedLogits)]
    if any(s._dpmp_vocab != vocab or s._dpmp_group is not meta._dpmp_group for s in shards):
        return _REFUSED
    local_v = _plain(shards[0]).shape[-1]
    local_args = _local_sizes(name, args, vocab, local_v)

    def probe(full: bool) -> Any:
        def to_meta(t: Any) -> Any:
            if not isinstance(t, Tensor):
                return t
            shape = tuple(_plain(t).shape)
            if isinstance(t, VocabShardedLogits) and full:
                shape = tuple(_logical(shape, vocab))
            return torch.empty(shape, dtype=t.dtype, device="meta")
        return func(*tree_map(to_meta, args if full else local_args), **tree_map(to_meta, kwargs))

    try:
        logical, local = tree_leaves(probe(True)), tree_leaves(probe(False))
    except Exception:  # the op cannot take these shapes (e.g. a full-vocabulary operand against the shard)
        return _REFUSED
    tensors = [(a, b) for a, b in zip(logical, local) if isinstance(a, Tensor)]
    if not tensors or len(logical) != len(local):
        return _REFUSED
    for full_t, local_t in tensors:
        sharded_shape = tuple(full_t.shape[:-1]) + (local_v,)
        if full_t.dim() == 0 or full_t.shape[-1] != vocab or tuple(local_t.shape) != sharded_shape:
            return _REFUSED  # the vocab dim was reduced, moved or merged
    return _wrap_like(func(*tree_map(_plain, local_args), **tree_map(_plain, kwargs)), meta)


def _cross_entropy(args: tuple, kwargs: dict, meta: VocabShardedLogits) -> Tensor:
    """``F.cross_entropy`` on vocab-sharded ``(N, V)`` logits with class-index targets: the vocab-parallel loss."""
    bound = inspect.signature(F.cross_entropy).bind(*args, **kwargs).arguments
    logits, target = bound.get("input"), bound.get("target")
    problem = None
    if not isinstance(logits, VocabShardedLogits):
        problem = "the sharded logits are not its input"
    elif logits.dim() != 2:
        problem = f"input of {logits.dim()} dims (only (N, classes) is computed vocab-parallel)"
    elif any(bound.get(k) is not None for k in ("weight", "size_average", "reduce")):
        problem = "class weights / legacy size_average, reduce arguments"
    elif not isinstance(target, Tensor) or target.is_floating_point():
        problem = "class-probability targets (only class indices are computed vocab-parallel)"
    if problem is not None:
        raise VocabShardedLogitsError(
            f"F.cross_entropy on the vocab-sharded logits of {meta._dpmp_name or 'a vocab-parallel head'!r} with "
            f"{problem} cannot be computed vocab-parallel. Fix: plan_overrides={{{meta._dpmp_name or '<head>'!r}: "
            "'column_gather'}} (the layer then returns full logits)."
        )
    return vocab_parallel_cross_entropy(
        _plain(logits), _plain(target), meta._dpmp_group, bound.get("ignore_index", -100),
        bound.get("reduction", "mean"), bound.get("label_smoothing", 0.0), meta._dpmp_vocab,
    )


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
