"""Find layers that compute a Linear without being ``nn.Linear``, from what their forward did in the traced step.

A *linear-like* module is a leaf (no children, no buffers) holding one 2-D weight and at most one 1-D bias, whose
forward, as recorded, is exactly: reshapes of its input, **one** matmul-like op of that input with the weight
(``linear`` / ``addmm`` / ``matmul`` / ``mm``), an optional bias add, and reshapes back to ``input.shape[:-1] +
(out,)``. The op says how the weight is stored:

* ``F.linear(x, W, b)`` reads ``W`` as ``(out, in)``: ``out_dim = 0`` (``nn.Linear``'s layout);
* ``torch.addmm(b, x, W)``, ``x @ W``, ``torch.mm(x, W)`` read ``W`` as ``(in, out)``: ``out_dim = 1``
  (transformers' GPT-2 ``Conv1D``);
* the same ops on the weight's transpose (``x @ W.T``, ``W.t()``, ``W.transpose(0, 1)``) read it as ``(out, in)``:
  ``out_dim = 0`` (transformers' ``FalconLinear``).

Nothing is keyed on class or parameter names: a module whose forward does anything else (a scale of the weight or
of the product, a second matmul) is not linear-like and stays whatever the rest of the planner makes of its ops.

Example:
    >>> LinearForm(in_features=32, out_features=96, out_dim=1).weight_shape
    (32, 96)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from torch import nn

from lightning_dpmp.planner.ops import ADDS, VIEWS

__all__ = ["LinearForm", "MATMULS", "SHAPE_OPS", "candidate_params", "detect", "form_of_linear"]

# activation x weight (ops.MATMULS: activation x activation)
MATMULS = {"linear", "addmm", "mm", "matmul", "__matmul__"}
SHAPE_OPS = VIEWS | {"contiguous"}
_BIAS_ADDS = ADDS


@dataclass(frozen=True)
class LinearForm:
    """What a linear-like layer computes: ``y = x @ W_(in,out) + b``, with ``W`` stored ``out_dim``-major.

    Attributes:
        in_features, out_features: the dense sizes.
        out_dim: which dim of the stored weight holds the output features (0: ``(out, in)``; 1: ``(in, out)``).
        weight, bias: attribute names of the module's parameters (``bias`` is ``None`` when there is none).
    """

    in_features: int
    out_features: int
    out_dim: int = 0
    weight: str = "weight"
    bias: Optional[str] = "bias"

    @property
    def weight_shape(self) -> tuple[int, int]:
        """The stored (dense) weight shape."""
        return (self.out_features, self.in_features) if self.out_dim == 0 else (self.in_features, self.out_features)


def form_of_linear(m: nn.Linear) -> LinearForm:
    """The form of a plain ``nn.Linear``."""
    return LinearForm(m.in_features, m.out_features, 0, "weight", "bias" if m.bias is not None else None)


def candidate_params(module: nn.Module) -> Optional[tuple[str, Optional[str]]]:
    """``(weight name, bias name)`` if ``module`` is shaped like a linear-like leaf (one 2-D and at most one 1-D
    parameter, no children, no buffers), else ``None``. Names come from the module; they are not interpreted."""
    if next(module.children(), None) is not None or next(module.buffers(recurse=False), None) is not None:
        return None
    params = list(module.named_parameters(recurse=False))
    two = [n for n, p in params if p.dim() == 2]
    one = [n for n, p in params if p.dim() == 1]
    if len(two) != 1 or len(one) > 1 or len(params) != len(two) + len(one):
        return None
    return two[0], (one[0] if one else None)


def detect(
    ops: Sequence, x: int, y: int, weight: int, bias: Optional[int], shapes: dict[int, tuple[int, ...]],
    names: tuple[str, Optional[str]],
) -> Optional[LinearForm]:
    """The :class:`LinearForm` of one recorded module call, or ``None`` if it computed anything else.

    Args:
        ops: the ``OpCall`` records made during the call (its own forward's torch calls, in order).
        x, y: trace nodes of the module's input and output.
        weight, bias: trace nodes of its weight and bias (``bias`` ``None`` if it has none or it was not read).
        shapes: node -> shape, from the trace.
        names: the parameters' attribute names (carried into the form).
    """
    from_x: set[int] = {x}
    weight_t: set[int] = set()  # nodes holding the weight's transpose
    mm_out: Optional[set[int]] = None
    out_dim, bias_used = None, False
    for op in ops:
        if op.name == "size":  # a shape query (x.size()[:-1] in Conv1D) reads no data
            continue
        ins = [n for n in op.inputs if n is not None]
        if ins == [weight] and len(op.outputs) == 1 and mm_out is None and _swaps_2d(op):
            weight_t.add(op.outputs[0])
            continue
        if op.name in SHAPE_OPS and len(ins) == 1 and len(op.outputs) == 1:
            src = ins[0]
            if src in from_x and mm_out is None:
                from_x.add(op.outputs[0])
            elif mm_out is not None and src in mm_out:
                mm_out.add(op.outputs[0])
            else:
                return None
            continue
        if op.name in MATMULS and mm_out is None:
            form = _orientation(op, from_x, weight, bias, weight_t)
            if form is None:
                return None
            out_dim, bias_used = form
            mm_out = {op.outputs[0]}
            continue
        if op.name in _BIAS_ADDS and mm_out is not None and bias is not None and not bias_used:
            if len(ins) == 2 and bias in ins and (set(ins) - {bias}) <= mm_out and _only_tensors(op):
                bias_used = True
                mm_out.add(op.outputs[0])
                continue
        return None  # any other op, or a second matmul: not a Linear
    if out_dim is None or mm_out is None or y not in mm_out or (bias is not None and not bias_used):
        return None
    w_shape = shapes[weight]
    in_f, out_f = (w_shape[1], w_shape[0]) if out_dim == 0 else (w_shape[0], w_shape[1])
    if shapes[x][-1:] != (in_f,) or shapes[y] != shapes[x][:-1] + (out_f,):
        return None
    if bias is not None and shapes[bias] != (out_f,):
        return None
    return LinearForm(in_f, out_f, out_dim, names[0], names[1] if bias is not None else None)


def _only_tensors(op) -> bool:
    """No scalar argument besides the tensors (``add(y, b, alpha=2)`` is not a bias add)."""
    return all(v is None or v == 1 for v in op.values)


def _swaps_2d(op) -> bool:
    """Whether ``op`` transposes a 2-D tensor: ``W.T``, ``W.t()``, ``W.mT``, ``W.transpose(0, 1)``."""
    if op.name in ("T", "t", "mT"):
        return True
    dims = {v % 2 for v in op.values if v is not None}
    return op.name in ("transpose", "swapaxes", "swapdims") and dims == {0, 1}


def _orientation(op, from_x: set[int], weight: int, bias: Optional[int], weight_t: set[int]
                 ) -> Optional[tuple[int, bool]]:
    """(out_dim, bias folded in) for one matmul-like op reading the input and the weight (or its transpose,
    ``weight_t``), else ``None``."""
    args = list(op.inputs)
    if any(v not in (None, 1) for v in op.values):
        return None  # addmm(..., beta=2, alpha=3) or matmul with extra ints: not a plain Linear
    if op.name == "linear":  # F.linear(x, W[, b]): W is (out, in)
        if len(args) >= 2 and args[0] in from_x and args[1] == weight:
            b = args[2] if len(args) > 2 else None
            if b is not None and b != bias:
                return None
            return 0, b is not None
        return None
    if op.name == "addmm":  # addmm(b, x, W): W is (in, out); addmm(b, x, W.T): (out, in)
        if len(args) >= 3 and args[0] == bias and bias is not None and args[1] in from_x:
            return (1, True) if args[2] == weight else (0, True) if args[2] in weight_t else None
        return None
    if len(args) >= 2 and args[0] in from_x and len([a for a in args if a is not None]) == 2:
        if args[1] == weight:
            return 1, False  # x @ W, matmul(x, W), mm(x, W)
        if args[1] in weight_t:
            return 0, False  # x @ W.T
    return None


def left_whole(model: nn.Module, planned: set[str], called: set[str]) -> list[str]:
    """Printout notes for modules holding matrix-shaped (2-D or more) parameters that no plan entry covers.

    ``planned``: names with a plan entry (their children count as covered); ``called``: modules seen called in
    the traced step. Norms and other 1-D parameters are not listed: they are replicated by design.
    """
    notes = []
    for name, mod in model.named_modules():
        if not name or name in planned or any(name.startswith(p + ".") for p in planned if p):
            continue
        big = [(n, tuple(p.shape)) for n, p in mod.named_parameters(recurse=False) if p.dim() >= 2]
        if not big:
            continue
        what = ", ".join(f"{n} {s}" for n, s in big)
        if candidate_params(mod) is not None and name in called:
            why = "its traced forward is not one matmul of its input with its weight (not linear-like)"
        elif name not in called:
            why = "not called in the traced step, or its parameters are read by other code"
        else:
            why = "not a Linear, linear-like layer, Embedding or MultiheadAttention"
        notes.append(f"left whole: {name} ({type(mod).__name__}: {what}): {why}")
    return notes
