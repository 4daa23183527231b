"""Flow rules for ops that move dims: where the split dim of a column region lands through indexing, ``cat``/``stack``,
``unsqueeze``/``squeeze``, ``expand``/``repeat``, ``narrow``, reshapes, transposes, ``chunk``/``split`` and
``repeat_interleave``, with the pure dim arithmetic they need (``x[index]``, a reshape's dim groups).

:class:`DimRules` is mixed into the analysis of :mod:`lightning_dpmp.planner.flow`, which owns the regions and
the op table (``flow.OPS``); each rule returns per-output ``(dim, raw)`` or a string saying why the region breaks.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Union

from lightning_dpmp.planner.flow_state import AnalysisState, Shard
from lightning_dpmp.planner.trace import OpCall

__all__ = ["DimRules"]


class DimRules(AnalysisState):
    """Rules for ops that move the split dim of one tensor, and for concatenations."""

    def _getitem(self, ev: OpCall, sh: Shard, shape: tuple) -> Union[str, list]:
        """Indexing and slicing keep the split when the split dim is taken whole (``x[..., :d // 2]`` on the
        head dim of rotary embeddings, ``logits[:, :-1]``); an index into the split dim breaks it."""
        new = _index_target(ev.index, sh.dim, shape)
        if new == "sliced along the split dim":
            return self._slice_blocks(ev, sh, shape)
        if isinstance(new, str):
            return f"{new} by '{ev.name}'"
        out_shape = self._shape(ev.outputs[0])
        if new >= len(out_shape) or out_shape[new] != shape[sh.dim]:
            return f"indexed by '{ev.name}' in a way that moves the split dim"
        return [(new, sh.raw)]

    def _slice_blocks(self, ev: OpCall, sh: Shard, shape: tuple) -> Union[str, list]:
        """Slices of a fused projection's raw output by bounds the code computes (Phi-3's ``qkv[..., :q_pos]``,
        ``qkv[..., q_pos:q_pos + kv]``, ``qkv[..., q_pos + kv:]``): when the slices of that tensor along the split
        dim cut it into consecutive pieces each divisible by mp, the pieces are its fused blocks, each split evenly,
        and the bounds are read per rank at run time (:class:`~lightning_dpmp.parallel.fused.FusedOutput`)."""
        sizes = self._partition(ev.inputs[0], sh.dim, shape)  # type: ignore[arg-type]
        if sizes is None or len(sizes) < 2 or any(s % self.mp for s in sizes) or not self.need_blocks(sh, sizes):
            return f"sliced along the split dim by '{ev.name}' in a way that does not cut it into its fused blocks"
        return [(sh.dim, None)]

    def _partition(self, node: int, dim: int, shape: tuple) -> Optional[tuple[int, ...]]:
        """The sizes of the consecutive pieces the slices of ``node`` along ``dim`` cut it into, or ``None``
        when they overlap, leave gaps or step."""
        spans: set[tuple[int, int]] = set()
        for e in self._consumers.get(node, []):
            if e.name != "__getitem__" or _index_target(e.index, dim, shape) != "sliced along the split dim":
                continue
            item = _dim_item(e.index, dim, len(shape))
            if item is None or item[0] != "slice" or (item[3] or 1) != 1:
                return None
            kept = range(shape[dim])[slice(item[1], item[2])]  # (normalises None and negative bounds)
            if not len(kept):
                return None
            spans.add((kept.start, len(kept)))
        pieces = sorted(spans)
        at = 0
        for start, size in pieces:
            if start != at:
                return None
            at += size
        return tuple(size for _, size in pieces) if at == shape[dim] else None

    def _concat(self, ev: OpCall, ins: list[tuple[int, Shard]]) -> Union[str, list]:
        """``cat``/``stack`` along another dim (rotary halves, a KV cache growing along the sequence): every
        non-empty operand must be split on the same dim; empty ones (a fresh cache) carry nothing."""
        split = dict(ins)
        operands = [(p, n) for p, n in enumerate(ev.inputs) if n is not None]
        ints = [v for v in ev.values if v is not None]
        out_nd = len(self._shape(ev.outputs[0]))
        axis = (ints[-1] if ints else 0) % out_nd
        dims, raws = set(), set()
        for p, n in operands:
            shape = self._shape(n)
            if math.prod(shape) == 0:
                continue
            if p not in split:
                return f"concatenated by '{ev.name}' with a replicated tensor"
            dims.add(split[p].dim)
            raws.add(split[p].raw)
        if len(dims) != 1:
            return f"concatenated by '{ev.name}' with differently split operands"
        dim = dims.pop()
        if ev.name == "stack":
            dim += axis <= dim
        elif axis == dim:
            return f"concatenated by '{ev.name}' along the split dim"
        raw = raws.pop() if len(raws) == 1 else None
        if raw is None and any(not self.need_blocks(s, 1) for s in split.values()):
            return f"concatenated by '{ev.name}' mixing fused layouts"
        return [(dim, raw)]

    def _unsqueeze(self, ev: OpCall, sh: Shard, shape: tuple) -> Union[str, list]:
        ints = [v for v in ev.values[1:] if v is not None]
        axis = (ints[0] if ints else 0) % (len(shape) + 1)
        return [(sh.dim + (axis <= sh.dim), sh.raw)]

    def _squeeze(self, ev: OpCall, sh: Shard, shape: tuple) -> Union[str, list]:
        out_shape = self._shape(ev.outputs[0])
        removed = len(shape) - len(out_shape)
        ints = [v % len(shape) for v in ev.values[1:] if v is not None]
        gone = [d for d in (ints or range(len(shape))) if shape[d] == 1]
        if len(gone) != removed:
            return f"squeezed by '{ev.name}' in a way the trace cannot follow"
        return [(sh.dim - sum(d < sh.dim for d in gone), sh.raw)]

    def _expand(self, ev: OpCall, sh: Shard, shape: tuple) -> Union[str, list]:
        """``expand``/``broadcast_to``/``repeat``: new or size-1 dims grow; the split dim must keep its size
        (the repeat-kv pattern ``k[:, :, None].expand(B, Hkv, n_rep, T, d)``)."""
        out_shape = self._shape(ev.outputs[0])
        new = sh.dim + len(out_shape) - len(shape)
        if out_shape[new] != shape[sh.dim]:
            return f"repeated by '{ev.name}' along the split dim"
        if ev.name in ("expand", "broadcast_to"):  # sizes (repeat's are counts): the split dim's must be per rank
            self._size_literal(ev, sh, new, len(out_shape))
        return [(new, sh.raw)]

    def _narrow(self, ev: OpCall, sh: Shard, shape: tuple) -> Union[str, list]:
        ints = [v for v in ev.values[1:] if v is not None]
        if not ints or ints[0] % len(shape) == sh.dim:
            return f"narrowed by '{ev.name}' along the split dim"
        return [(sh.dim, sh.raw)]

    def _reshape(self, ev: OpCall, sh: Shard, a: tuple) -> Union[str, list]:
        b = self._shape(ev.outputs[0])
        groups = _dim_groups(a, b)
        grp = next((g for g in groups if sh.dim in g[0]), None)
        if grp is None:
            return f"reshaped by '{ev.name}' across the split dim"
        ins, outs = grp
        if any(a[i] != 1 for i in ins if i < sh.dim):
            return f"reshaped by '{ev.name}' merging the split dim into an outer one"
        outs = [j for j in outs if b[j] != 1] or outs
        raw, new = sh.raw, outs[0]
        # (B, T, G, per_group, d) is read either as fused blocks (G = 3 for q|k|v, split on the heads inside each)
        # or as groups laid out one after another (Falcon's kv groups of [q.., k, v]): what the code cuts next says
        grouped = len(outs) >= 3 and self._cut(ev.outputs[0], outs[1]) and not self._cut(ev.outputs[0], outs[0])
        if (len(outs) >= 3 and raw is not None and b[outs[1]] % self.mp == 0 and not grouped
                and self.need_blocks(sh, b[outs[0]])):  # (need_blocks records the blocks: asked last)
            new, raw = outs[1], None  # fused (B, T, 3, H, d): the split is on H inside each of the 3 blocks
        elif not self.need_blocks(sh, 1):
            return f"reshaped by '{ev.name}' in a way that does not match its fused blocks"
        else:
            raw = None if len(outs) > 1 or len(ins) > 1 else raw
        if b[new] % self.mp and not self.regions[self.find(sh.region)].padded:  # (padded: a vocabulary dim)
            return f"reshaped to {b[new]} heads/groups at dim {new}, not divisible by mp={self.mp}"
        if ev.name in ("view", "reshape"):
            self._size_literal(ev, sh, new, len(b))
        return [(new, raw)]

    def _size_literal(self, ev: OpCall, sh: Shard, pos: int, ndim: int) -> None:
        """The size ``view``/``reshape``/``expand`` got at the split dim's position ``pos``: unless it was read off a
        split tensor (then it is per rank at run time by itself) or is ``-1``, it is a fixed size that must become
        per rank, recorded with the module whose code passed it and its position among the sizes passed (see
        :func:`structure.resolve_literals`)."""
        sizes = ev.values[1:]
        size = sizes[pos] if len(sizes) == ndim else None
        region = self.regions[self.find(sh.region)]
        if size is not None and size != -1 and not region.derived(int(size)):
            region.literals.add((int(size), ev.scope, pos))

    @functools.cached_property
    def _consumers(self) -> dict[int, list[OpCall]]:
        """The ops reading each node as their first argument, in call order."""
        out: dict[int, list[OpCall]] = {}
        for e in self.trace.events:
            if isinstance(e, OpCall) and e.inputs and e.inputs[0] is not None:
                out.setdefault(e.inputs[0], []).append(e)
        return out

    def _cut(self, node: int, dim: int) -> bool:
        """Whether an op reading ``node`` indexes, slices, unbinds, splits or chunks it along ``dim``, directly or
        after transposes that move that dim (litgpt permutes its per-group view before splitting it)."""
        shape = self._shape(node)
        for e in self._consumers.get(node, []):
            if e.name == "__getitem__":
                where = _index_target(e.index, dim, shape)
                if isinstance(where, str) and "along the split dim" in where:
                    return True
            elif e.name in _SPLITS and _split_dim(e, len(shape)) == dim:
                return True
            elif e.name in _MOVES and len(e.outputs) == 1 and self._cut(e.outputs[0], _moved(e, dim, len(shape))):
                return True
        return False

    def _transpose(self, ev: OpCall, sh: Shard, shape: tuple) -> Union[str, list]:
        new = _moved(ev, sh.dim, len(shape))
        if ev.name == "permute":
            return [(new, sh.raw if new == sh.dim else None)]
        if new != sh.dim and not self.need_blocks(sh, 1):
            return f"transposed by '{ev.name}' before its fused blocks were separated"
        return [(new, sh.raw if new == sh.dim else None)]

    def _split(self, ev: OpCall, sh: Shard, shape: tuple) -> Union[str, list]:
        ints = [v for v in ev.values[1:] if v is not None]
        dim = _split_dim(ev, len(shape))
        if ev.name == "unbind":
            if dim == sh.dim:
                return "unbound by 'unbind' along the split dim"
            return [(sh.dim - (dim < sh.dim), None)] * len(ev.outputs)
        if dim != sh.dim:
            return [(sh.dim, sh.raw)] * len(ev.outputs)
        pieces = len(ev.outputs)
        sizes = tuple(self.trace.shapes[n][dim] for n in ev.outputs)
        if len(set(sizes)) > 1:  # split([q, kv, kv]): fused blocks of unequal sizes, the sizes read per rank at run
            # time (lightning_dpmp.parallel.fused), so they are no literal to adjust
            if any(s % self.mp for s in sizes) or not self.need_blocks(sh, sizes):
                return f"split by '{ev.name}' into parts {list(sizes)} that are not its fused blocks split by mp"
            return [(sh.dim, None)] * pieces
        if ev.name == "split" and len(ints) == 2:  # split(size, dim): a fixed size becomes per-rank
            self.regions[self.find(sh.region)].literals.add((int(ints[0]), ev.scope, 0))
        if not self.need_blocks(sh, pieces) or sizes[0] % self.mp:
            return f"split by '{ev.name}' into unequal or indivisible parts along the split dim"
        return [(sh.dim, None)] * pieces

    def _repeat_interleave(self, ev: OpCall, sh: Shard, shape: tuple) -> Union[str, list]:
        ints = [v for v in ev.values[1:] if v is not None]
        if len(ints) < 2 and len(shape) > 1:
            return f"flattened by '{ev.name}'"
        return [(sh.dim, None)]


_SPLITS = ("unbind", "split", "chunk", "tensor_split", "split_with_sizes")  # ops cutting one tensor into pieces
_MOVES = ("transpose", "swapaxes", "swapdims", "permute", "t", "T", "mT", "contiguous")  # ops that only move dims


def _moved(ev: OpCall, dim: int, ndim: int) -> int:
    """Where input dim ``dim`` lands through a transpose or permute ``ev`` (``contiguous`` keeps it)."""
    ints = [v for v in ev.values[1:] if v is not None]
    if ev.name == "permute":
        return [d % ndim for d in ints].index(dim)
    if ev.name == "contiguous":
        return dim
    a, b = ([ndim - 2, ndim - 1] if ev.name in ("t", "T", "mT") else [d % ndim for d in ints[:2]])
    return b if dim == a else a if dim == b else dim


def _split_dim(ev: OpCall, ndim: int) -> int:
    """The dim ``unbind(dim)``, ``split(sizes, dim)`` or ``chunk(n, dim)`` cuts along (0 when not given)."""
    ints = [v for v in ev.values[1:] if v is not None]
    if ev.name == "unbind":
        return (ints[0] if ints else 0) % ndim
    return (ints[-1] if len(ints) >= 2 else 0) % ndim


def _dim_item(index: tuple, dim: int, ndim: int) -> Optional[tuple]:
    """The subscript item of ``x[index]`` that applies to input dim ``dim`` (basic indexing only)."""
    if any(it[0] == "tensor" for it in index):
        return None
    consumed = sum(1 for it in index if it[0] not in ("none", "ellipsis"))
    items: list[tuple] = []
    for it in index:
        if it[0] == "ellipsis":
            items.extend([("slice", None, None, None)] * (ndim - consumed))
        elif it[0] != "none":
            items.append(it)
    items.extend([("slice", None, None, None)] * (ndim - len(items)))
    return items[dim] if dim < len(items) else None


def _index_target(index: tuple, dim: int, shape: tuple) -> Union[int, str]:
    """Where input dim ``dim`` lands in ``x[index]``, or why it does not survive (indexed into, or moved by
    advanced indexing in a way that interleaves it)."""
    consumed = sum(it[1] if it[0] == "tensor" and it[2] else 1 for it in index if it[0] not in ("none", "ellipsis"))
    full = ("slice", None, None, None)
    items: list[tuple] = []
    for it in index:
        items.extend([full] * (len(shape) - consumed) if it[0] == "ellipsis" else [it])
    if not any(it[0] == "ellipsis" for it in index):
        items.extend([full] * (len(shape) - consumed))
    adv = [k for k, it in enumerate(items) if it[0] == "tensor"]
    adv_nd = max((it[1] if not it[2] else 1 for it in items if it[0] == "tensor"), default=0)
    adjacent = not adv or adv == list(range(adv[0], adv[-1] + 1))
    in_d = out_d = 0
    target: Optional[int] = None
    placed = False
    if adv and not adjacent:
        out_d, placed = adv_nd, True  # non-adjacent advanced indices put their result first
    for it in items:
        kind = it[0]
        if kind == "none":
            out_d += 1
            continue
        width = it[1] if kind == "tensor" and it[2] else 1
        if in_d <= dim < in_d + width:
            if kind != "slice":
                return "indexed along the split dim"
            start, stop, step = it[1], it[2], it[3]
            if (start or 0) != 0 or (step or 1) != 1 or (stop is not None and stop < shape[dim]):
                return "sliced along the split dim"
            target = out_d
        if kind == "tensor":
            if not placed:
                out_d, placed = out_d + adv_nd, True
        elif kind != "int":
            out_d += 1
        in_d += width
    return target if target is not None else "indexed in a way the trace cannot follow"


def _dim_groups(a: tuple, b: tuple) -> list[tuple[list[int], list[int]]]:
    """Pair up runs of dims of ``a`` and ``b`` whose sizes multiply to the same number (a reshape's structure)."""
    groups, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        gi, gj = [i] if i < len(a) else [], [j] if j < len(b) else []
        pa = a[i] if i < len(a) else 1
        pb = b[j] if j < len(b) else 1
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb and i < len(a):
                pa *= a[i]
                gi.append(i)
                i += 1
            elif j < len(b):
                pb *= b[j]
                gj.append(j)
                j += 1
            else:
                break
        groups.append((gi, gj))
    return groups
