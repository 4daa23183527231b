"""How parameters are split across the MP group: slicing dense tensors into shards and back (plain and
fused-block layouts), the shared base of the split layers (sizes, ``from_dense``/``to_dense``, init), and which
parameters of a module are split (:func:`shard_dims`, :func:`shard_blocks`), as checkpoints and the guard read it.

Example:
    >>> import torch
    >>> w = torch.arange(8.0).reshape(4, 2)
    >>> shard_tensor(w, 0, mp=2, rank=1).tolist()
    [[4.0, 5.0], [6.0, 7.0]]
    >>> interleave_blocks([shard_tensor(w, 0, 2, r, blocks=2) for r in range(2)], 0, blocks=2).equal(w)
    True
"""

from __future__ import annotations

import copy
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import Self

import lightning_dpmp.compat as compat
from lightning_dpmp.parallel.comm import gather_from_group, group_rank, group_size

__all__ = [
    "SHARDS_ATTR",
    "Blocks",
    "DenseGather",
    "ParallelLinear",
    "dense_meta",
    "dense_template",
    "block_piece",
    "dense_block_sizes",
    "dense_size",
    "divide",
    "gather_tensor",
    "gather_to_first",
    "interleave_blocks",
    "local_block_sizes",
    "padded_blocks",
    "params_to_meta",
    "shard_blocks",
    "shard_dims",
    "shard_tensor",
]


# How a split dim is laid out. An int ``k``: ``k`` equal fused blocks (q|k|v is 3), each cut into ``mp`` equal parts.
# A tuple: the dense sizes of its blocks, in order (``(V,)``: one block, a vocabulary that ``mp`` does not divide;
# ``(q, kv, kv)``: fused blocks of unequal sizes). Each block is padded with zeros to a multiple of ``mp`` and cut
# into ``mp`` equal parts, so every rank holds ``ceil(size / mp)`` of each (Megatron pads its vocabulary the same
# way); the padding never leaves the rank: gathers strip it, and checkpoints and exports hold the dense sizes.
Blocks = Union[int, tuple[int, ...]]


def padded_blocks(size: int, mp: int) -> Blocks:
    """The layout of one block of ``size`` split ``mp`` ways: ``1`` when ``mp`` divides it, else ``(size,)``.

    Example:
        >>> padded_blocks(50304, 2), padded_blocks(50257, 2)
        (1, (50257,))
    """
    return 1 if size % mp == 0 else (size,)


def local_block_sizes(blocks: Blocks, local: int, mp: int) -> list[int]:
    """Sizes of a rank's pieces of each block, given its ``local`` total along the split dim."""
    if isinstance(blocks, int):
        return [local // blocks] * blocks
    return [-(-s // mp) for s in blocks]


def block_piece(size: int, mp: int, rank: int) -> tuple[int, int, int]:
    """Where ``rank``'s piece of a block of ``size`` split ``mp`` ways lies: its first dense row, how many real rows
    it holds, and its length (``ceil(size / mp)``, the rest padding).

    Example:
        >>> block_piece(5, 4, 2), block_piece(5, 4, 3)   # 2 rows per rank: rank 2 holds 1 real row, rank 3 none
        ((4, 1, 2), (5, 0, 2))
    """
    each = -(-size // mp)
    first = min(rank * each, size)
    return first, min(each, size - first), each


def dense_size(blocks: Blocks, local: int, mp: int) -> int:
    """The dense size along the split dim of a tensor whose rank pieces total ``local``.

    Example:
        >>> dense_size(3, 12, 2), dense_size((50257,), 25129, 2)
        (24, 50257)
    """
    return local * mp if isinstance(blocks, int) else sum(blocks)


def dense_block_sizes(blocks: Blocks, dense: int) -> list[int]:
    """The dense sizes of the blocks of a tensor of ``dense`` rows along its split dim.

    Example:
        >>> dense_block_sizes(3, 12), dense_block_sizes((8, 4, 4), 16)
        ([4, 4, 4], [8, 4, 4])
    """
    return [dense // blocks] * blocks if isinstance(blocks, int) else list(blocks)


def divide(total: int, parts: int, what: str = "dimension") -> int:
    """``total // parts``, or a ``ValueError`` naming both numbers when it does not divide evenly."""
    if total % parts:
        raise ValueError(f"{what} of size {total} cannot be split evenly across mp={parts} ranks.")
    return total // parts


class ParallelLinear(nn.Module):
    """Base of the split layers (column, row, vocab, embeddings, attention): sizes, the group and this rank's place
    in it, and the dims each parameter is split along, which checkpoints and consolidation read."""

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
    # of every block: weight rows viewed as (blocks, rows/blocks) are chunked along the second axis. A tuple gives
    # the blocks' dense sizes (a padded vocabulary, unequal fused blocks): see ``Blocks``.
    blocks: Blocks = 1

    out_dim: int = 0  # dim of the stored weight holding the output features: 0 (out, in) or 1 (in, out)

    # Declared for the type checker (nn.Module's __getattr__ would type them Tensor | Module); set by subclasses.
    weight: nn.Parameter
    bias: Optional[nn.Parameter]
    in_features: int
    out_features: int

    @classmethod
    def from_dense(cls, linear: nn.Module, group: Any, out_dim: int = 0, **kwargs: Any) -> Self:
        """Slice an initialised ``nn.Linear`` (or a linear-like module with ``weight``/``bias`` stored
        ``out_dim``-major, e.g. ``Conv1D`` with ``out_dim=1``) so that training starts from exactly its weights."""
        w = linear.weight
        assert isinstance(w, Tensor), type(linear).__name__
        out_f, in_f = (w.shape[0], w.shape[1]) if out_dim == 0 else (w.shape[1], w.shape[0])
        # The subclasses' constructors take (in, out, bias, group=, out_dim=, device=, dtype=); the base does not.
        layer = cls(  # type: ignore[call-arg, misc]
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

    def _create_parameters(self, out_local: int, in_local: int, bias_size: Optional[int],
                           device: Optional[torch.device], dtype: Optional[torch.dtype]) -> None:
        """This rank's weight, ``(out_local, in_local)`` in the stored layout (``out_dim``), and bias of
        ``bias_size`` (``None``: no bias); initialised unless on the meta device."""
        shape = (out_local, in_local) if self.out_dim == 0 else (in_local, out_local)
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(bias_size, device=device, dtype=dtype)) if bias_size else None
        if self.weight.device.type != "meta":
            self.reset_parameters()

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

    def _dense_module(self, device: torch.device, gather: "DenseGather") -> nn.Module:
        """The dense module's shell on ``device`` (``gather``: for the split layers it contains)."""
        p = self.weight
        template = self.__dict__.get("_template")
        if template is None:
            return nn.Linear(
                self.in_features, self.out_features, bias=self.bias is not None, device=device, dtype=p.dtype
            )
        dense = copy.deepcopy(template)
        shape = (self.out_features, self.in_features) if self.out_dim == 0 else (self.in_features, self.out_features)
        dense.weight = nn.Parameter(torch.empty(shape, device=device, dtype=p.dtype), requires_grad=p.requires_grad)
        if self.bias is not None:
            dense.bias = nn.Parameter(torch.empty(self.out_features, device=device, dtype=p.dtype),
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
        self.zero_padding()

    def zero_padding(self) -> None:
        """Zero the rows padding a block to a multiple of ``mp`` (see ``Blocks``): as ``from_dense`` leaves them."""
        if isinstance(self.blocks, int):
            return
        with torch.no_grad():
            for name, dim in self._shard_dims.items():
                t = getattr(self, name, None)
                if t is None or dim is None:
                    continue
                offset = 0
                for size in self.blocks:
                    _, real, each = block_piece(size, self.mp, self.mp_rank)
                    t.narrow(dim, offset + real, each - real).zero_()
                    offset += each

    def to_dense(self, gather: Optional["DenseGather"] = None) -> nn.Module:
        """Gather the shards into the dense module (collective: every rank of the group must call it).

        ``gather`` (default: every rank gets the dense module) can instead gather onto the group's first rank: the
        others get the dense module's shell on the meta device (shapes, no memory).
        """
        gather = gather if gather is not None else DenseGather()
        here = next(self.parameters()).device  # an attention layer has in_proj_weight, no weight
        dense = self._dense_module(here if gather.keep else torch.device("meta"), gather)
        with torch.no_grad():
            for name, dim in self._shard_dims.items():
                local = getattr(self, name, None)
                if local is not None:
                    full = local if dim is None else gather(local.detach(), dim, self.group, self.blocks)
                    if gather.keep and full is not None:
                        getattr(dense, name).copy_(full)
                    getattr(dense, name).requires_grad_(local.requires_grad)
        dense.train(self.training)
        return dense

    def extra_repr(self) -> str:
        layout = ", weight=(in, out)" if self.out_dim == 1 else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"mp={self.mp}{layout}"
        )


def dense_template(dense: nn.Module) -> nn.Module:
    """A deep copy of ``dense`` whose parameters are meta tensors: its class and attributes, no memory.

    ``to_dense`` copies it and sets full-size parameters, so a consolidated model holds the original classes.
    """
    memo = {id(p): nn.Parameter(torch.empty(p.shape, device="meta", dtype=p.dtype), requires_grad=p.requires_grad)
            for p in dense.parameters()}
    return copy.deepcopy(dense, memo)


def shard_tensor(full: Tensor, dim: int, mp: int, rank: int, blocks: Blocks = 1) -> Tensor:
    """This rank's slice of ``full`` along ``dim``; with ``blocks``, the same slice of each of the blocks, each
    padded with zeros to a multiple of ``mp`` first (see ``Blocks``)."""
    if blocks == 1:
        return full.chunk(mp, dim=dim)[rank]
    pieces = []
    for block in full.split(dense_block_sizes(blocks, full.shape[dim]), dim=dim):
        first, real, each = block_piece(block.shape[dim], mp, rank)
        piece = block.narrow(dim, first, real)
        if real < each:  # the padding: rows no token id or class index ever reaches
            pad = list(piece.shape)
            pad[dim] = each - real
            piece = torch.cat([piece, piece.new_zeros(pad)], dim=dim)
        pieces.append(piece)
    return torch.cat(pieces, dim=dim) if len(pieces) > 1 else pieces[0]


def gather_tensor(local: Tensor, dim: int, group: Any, blocks: Blocks = 1) -> Tensor:
    """Inverse of :func:`shard_tensor` (collective over ``group``): the dense tensor, padding stripped."""
    n = group_size(group)
    if n == 1:
        return local
    if blocks == 1:
        return gather_from_group(local, group, dim)
    mine = local.split(local_block_sizes(blocks, local.shape[dim], n), dim=dim)
    sizes = dense_block_sizes(blocks, local.shape[dim] * n)
    return torch.cat([gather_from_group(b.contiguous(), group, dim).narrow(dim, 0, s) for b, s in zip(mine, sizes)],
                     dim=dim)


# A module that keeps its own class but holds some parameters split in place (experts, :mod:`.experts`) carries
# ``{parameter name: (dim, blocks)}`` under this attribute.
SHARDS_ATTR = "_dpmp_param_shards"

# Set (True) on a tensor allocated from the meta device by lightning_dpmp.planner.materialize.materialize: its values
# are an initialisation, not the code's own (a pretrained load must fill it; a real adapter's values need not).
MATERIALIZED_ATTR = "_dpmp_materialized"


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
        if isinstance(mod, ParallelLinear) and mod.mp > 1:
            for name, dim in mod._shard_dims.items():
                if dim is not None and getattr(mod, name, None) is not None:
                    out[f"{prefix}.{name}" if prefix else name] = dim
        for name, (dim, _) in mod.__dict__.get(SHARDS_ATTR, {}).items():
            out[f"{prefix}.{name}" if prefix else name] = dim
    return _with_aliases(module, out)


def _with_aliases(module: nn.Module, by_name: dict[str, Any]) -> dict[str, Any]:
    """``by_name`` extended to every other name a listed parameter is registered under (a bias held by both a
    layer and its parent), so that state_dict keys and deduplicated parameter names all find their entry."""
    params = dict(module.named_parameters(remove_duplicate=False))
    by_id = {id(params[n]): v for n, v in by_name.items() if n in params}
    return {**by_name, **{n: by_id[id(p)] for n, p in params.items() if id(p) in by_id}}


def shard_blocks(module: nn.Module) -> dict[str, Blocks]:
    """Split parameters of fused layers (q|k|v in one weight) and their block count; others have one block.

    A fused parameter's shards do not concatenate to the dense tensor: use :func:`shard_tensor` and
    :func:`gather_tensor` (or :func:`interleave_blocks`) with this count.
    """
    out: dict[str, Blocks] = {}
    for prefix, mod in module.named_modules(remove_duplicate=False):
        if isinstance(mod, ParallelLinear) and mod.mp > 1 and mod.blocks != 1:
            for name, dim in mod._shard_dims.items():  # only column-style layers are fused: every split is by blocks
                if dim is not None and getattr(mod, name, None) is not None:
                    out[f"{prefix}.{name}" if prefix else name] = mod.blocks
        for name, (_, blocks) in mod.__dict__.get(SHARDS_ATTR, {}).items():
            if blocks > 1:
                out[f"{prefix}.{name}" if prefix else name] = blocks
    return _with_aliases(module, out)


def gather_to_first(t: Tensor, group: Any, dim: int, blocks: Blocks = 1) -> Optional[Tensor]:
    """Concatenate the group's shards of ``t`` along ``dim`` on the group's first rank, on CPU; ``None`` elsewhere.

    A ``gather`` rather than an ``all_gather``: the other ranks never hold the dense tensor.
    """
    n = group_size(group)
    t = t.detach().contiguous()
    if n == 1:
        return t.cpu()
    dst = dist.get_global_rank(group, 0)
    if group_rank(group) == 0:
        parts = [torch.empty_like(t) for _ in range(n)]
        dist.gather(t, parts, dst=dst, group=group)
        return interleave_blocks(parts, dim, blocks).cpu()
    dist.gather(t, None, dst=dst, group=group)
    return None


class DenseGather:
    """How split tensors become dense again: on every rank of the group (``all_gather``, the default), or onto
    the group's first rank only (``to_first``), or not at all (``communicate=False``: a DP replica whose own MP
    group is not the one rank 0 gathers from). ``keep``: whether this rank keeps the result (else shapes only).

    Example:
        >>> DenseGather()(torch.ones(2, 3), 0, None).shape   # one rank: the tensor itself
        torch.Size([2, 3])
    """

    def __init__(self, to_first: bool = False, keep: bool = True, communicate: bool = True) -> None:
        self.to_first, self.keep, self.communicate = to_first, keep, communicate

    def __call__(self, local: Tensor, dim: int, group: Any, blocks: Blocks = 1) -> Optional[Tensor]:
        if not self.communicate:
            return None
        if self.to_first:
            full = gather_to_first(local, group, dim, blocks)
            return full if self.keep else None
        return gather_tensor(local, dim, group, blocks)


def dense_meta(local: Tensor, dim: int, group: Any, blocks: Blocks = 1) -> Tensor:
    """An empty meta tensor with the dense shape of ``local``, a shard along ``dim`` over ``group``."""
    shape = list(local.shape)
    shape[dim] = dense_size(blocks, shape[dim], group_size(group))
    return torch.empty(shape, dtype=local.dtype, device="meta")


def params_to_meta(module: nn.Module) -> dict[int, nn.Parameter]:
    """Replace every real parameter of ``module`` by a meta one of the same shape (ties kept, ``requires_grad``
    kept), freeing its memory; buffers stay. Returns ``{id(old parameter): meta parameter}``."""
    memo: dict[int, nn.Parameter] = {}
    for mod in module.modules():
        for key, p in list(compat.own_parameters(mod).items()):
            if p is None or p.is_meta:
                continue
            if id(p) not in memo:
                memo[id(p)] = nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
            compat.own_parameters(mod)[key] = memo[id(p)]
    return memo


def interleave_blocks(parts: list[Tensor], dim: int, blocks: Blocks) -> Tensor:
    """The dense tensor from per-rank shards ``parts`` (rank order) of a ``blocks``-fused parameter."""
    if blocks == 1:
        return torch.cat(parts, dim=dim)
    n = len(parts)
    chunks = [p.split(local_block_sizes(blocks, p.shape[dim], n), dim=dim) for p in parts]
    sizes = dense_block_sizes(blocks, parts[0].shape[dim] * n)
    return torch.cat([torch.cat([c[b] for c in chunks], dim=dim).narrow(dim, 0, s) for b, s in enumerate(sizes)],
                     dim=dim)
