"""A column layer's matmul with its input-gradient all-reduce overlapped with the weight gradient (Megatron's
``LinearWithGradAccumulationAndAsyncCommunication``).

Unfused, a column layer's backward computes ``dX = dY @ W`` (its matmul node), then the entry's copy node
all-reduces ``dX`` while nothing else runs; ``dW = dY^T X`` and ``db`` are computed before or after, never during.
Fused into one autograd node, the backward starts the all-reduce of ``dX`` asynchronously (``async_op=True``;
under ``torch.compile`` a functional all-reduce whose wait comes after ``dW``), computes ``dW`` and ``db``
meanwhile, and waits. Same collective, same count (one all-reduce per layer), same gradients.

Only layers with their own entry use it: siblings sharing one (q/k/v, gate/up,
:class:`~lightning_dpmp.parallel.entry.SharedInputCopy`) have a complete ``dX`` only after all their matmuls, so
they keep the shared copy (one all-reduce of the summed gradient, not overlapped). Gradient accumulation needs
nothing special: ``dW`` goes to autograd (and DDP's hooks) as a plain gradient.

Example:
    >>> y = linear_with_async_input_grad(x, layer.weight, layer.bias, grid.mp_group)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lightning_dpmp.compat import functional_collectives as funcol  # private torch module: see compat

__all__ = ["linear_with_async_input_grad"]


class _LinearAsyncInputGrad(torch.autograd.Function):
    """forward: ``x @ W.T + b`` (``x`` replicated); backward: all-reduce ``dX`` while ``dW``, ``db`` are computed."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Optional[Tensor], group: Any, transposed: bool) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.transposed, ctx.has_bias = group, transposed, bias is not None
        return F.linear(x, weight.t() if transposed else weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        # Under autocast the forward matmul ran in the autocast dtype: compute in the gradient's dtype (autograd
        # casts each returned gradient back to its input's dtype).
        w = (weight.t() if ctx.transposed else weight).to(grad.dtype)
        compiling = torch.compiler.is_compiling()
        grad_x: Optional[Tensor] = None
        work = None
        if need_x:
            grad_x = grad.matmul(w)
            if compiling:
                grad_x = funcol.all_reduce(grad_x, "sum", ctx.group)  # waited on below, after dW
            else:
                work = dist.all_reduce(grad_x, op=dist.ReduceOp.SUM, group=ctx.group, async_op=True)
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_w = grad_b = None
        if need_w:
            x2 = x.reshape(-1, x.shape[-1]).to(grad.dtype)
            grad_w = x2.t().mm(g2) if ctx.transposed else g2.t().mm(x2)
        if need_b and ctx.has_bias:
            grad_b = g2.sum(0)
        if work is not None:
            work.wait()
        elif grad_x is not None and compiling:
            grad_x = funcol.wait_tensor(grad_x)
        return grad_x, grad_w, grad_b, None, None


def linear_with_async_input_grad(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], group: Any, transposed: bool = False
) -> Tensor:
    """``F.linear(copy_to_group(x), W, b)`` in one node whose backward overlaps the ``dX`` all-reduce with ``dW``.

    ``transposed``: ``weight`` is stored ``(in, out)`` (GPT-2's ``Conv1D``).
    """
    return _LinearAsyncInputGrad.apply(x, weight, bias, group, transposed)
