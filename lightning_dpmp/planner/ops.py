"""The op-name vocabulary of the planner's analyses: one place for the names of recorded calls, by family.

Each analysis keeps its own *semantics* (what an op does to a split tensor) but draws its op names from here, so a
newly recognised op is added once: :mod:`lightning_dpmp.planner.flow` (column -> row regions, its ``OPS`` rule
table), :mod:`lightning_dpmp.planner.sequence` (token-wise regions), :mod:`lightning_dpmp.planner.experts_detect` (split
and partial-sum expert regions), :mod:`lightning_dpmp.planner.linear_like` (what a linear-like forward may do) and
:mod:`lightning_dpmp.planner.trace` (recording). Names are those :func:`lightning_dpmp.planner.trace.op_name`
records: ``torch.add``, ``Tensor.add`` and ``F.add`` are all ``"add"``; ``x.T`` is the getter ``"T"``.

Where an analysis accepts only part of a family (the experts' partial sums survive ``neg`` but not ``pow``), it
defines its set from the finer families below rather than listing names again.

Example:
    >>> "silu" in ACTIVATIONS and "silu" in UNARY
    True
    >>> ADDS <= BINARY and "swapdims" in TRANSPOSES
    True
"""

from __future__ import annotations

__all__ = [
    "ACTIVATIONS", "ADDS", "ATTENTION", "BATCHED", "BINARY", "CASTS", "COMPARISONS", "CONCATS", "DIVS", "DROPOUTS",
    "EXPANDS", "FACTORIES", "FIRST_ONLY", "LOSSES", "MATH", "MATMULS", "MULS", "NORMS", "REDUCTIONS", "RESHAPES",
    "SIGNS", "SPLITS", "SQUEEZES", "TRANSPOSES", "UNARY", "VIEWS",
]

# --- one-input element-wise ops -------------------------------------------------------------------------------
ACTIVATIONS = {
    "relu", "relu_", "gelu", "silu", "silu_", "sigmoid", "sigmoid_", "tanh", "tanh_", "elu", "selu", "celu",
    "leaky_relu", "hardtanh", "relu6", "softplus", "mish", "hardswish", "hardsigmoid", "logsigmoid", "softsign",
}
MATH = {"exp", "log", "square", "sqrt", "rsqrt", "sin", "cos", "erf", "clamp", "clamp_", "clip"}
SIGNS = {"neg", "__neg__", "__pos__"}  # linear: a partial sum stays one
CASTS = {"to", "type_as", "float", "double", "half", "bfloat16", "contiguous", "clone", "__get__"}  # values kept
DROPOUTS = {"dropout", "dropout_", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d"}
UNARY = (
    ACTIVATIONS | MATH | SIGNS | CASTS
    | {"dropout", "dropout_", "alpha_dropout", "abs", "type", "detach", "logical_not", "__invert__", "isnan", "isinf",
       "isfinite"}
)  # element-wise on one tensor: a split stays where it is

# --- two-input element-wise ops ---------------------------------------------------------------------------------
ADDS = {"add", "add_", "__add__", "__radd__", "__iadd__"}
SUBS = {"sub", "sub_", "__sub__", "__isub__"}
MULS = {"mul", "mul_", "__mul__", "__rmul__", "__imul__"}
DIVS = {"div", "div_", "true_divide", "__truediv__", "__itruediv__"}
COMPARISONS = {
    "eq", "ne", "lt", "le", "gt", "ge", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
    "logical_and", "logical_or", "logical_xor", "__and__", "__or__", "__xor__", "__iand__", "__ior__",
}  # element-wise, bool out: a mask of a split tensor (a hook recording dropout masks) is split the same way
BINARY = ADDS | SUBS | MULS | DIVS | COMPARISONS | {
    "__rsub__", "__rtruediv__", "pow", "__pow__", "maximum", "minimum", "masked_fill", "masked_fill_", "where",
}

# --- layout ops ---------------------------------------------------------------------------------------------------
VIEWS = {"view", "reshape", "flatten"}
SQUEEZES = {"squeeze", "unsqueeze", "squeeze_", "unsqueeze_"}
RESHAPES = VIEWS | {"unflatten", "view_as", "reshape_as"}
TRANSPOSES = {"transpose", "swapaxes", "swapdims", "permute", "t", "T", "mT"}  # T/mT: the attribute getters
SPLITS = {"chunk", "split", "unbind", "tensor_split"}
EXPANDS = {"expand", "expand_as", "broadcast_to", "repeat"}
CONCATS = {"cat", "concat", "concatenate", "stack"}
FIRST_ONLY = {"to", "type_as"}  # the second tensor only lends its dtype/device

# --- reductions, attention, losses, matmuls, factories --------------------------------------------------------------
REDUCTIONS = {"sum", "mean", "amax", "amin", "var", "std", "logsumexp", "prod", "max", "min", "all", "any"}
NORMS = {"layer_norm", "rms_norm"}
ATTENTION = {"scaled_dot_product_attention", "softmax", "log_softmax"}
MATMULS = {"matmul", "__matmul__", "bmm"}  # batched matmuls of two activations (attention scores, weighted values)
BATCHED = ATTENTION | MATMULS  # computed per leading (batch, head) index
LOSSES = {"cross_entropy"}
FACTORIES = {"zeros", "ones", "empty"}  # size-only factories; their outputs are the same along every dim
