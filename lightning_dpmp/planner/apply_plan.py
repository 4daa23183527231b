"""Apply a :class:`~lightning_dpmp.planner.plan.Plan` to a module in place, and consolidate it back.

Parallel layers take the place of the dense ones under the same attribute names, with parameters named
``weight``/``bias`` and registered in the same order, so module names, ``state_dict`` keys and the optimizer's
parameter order are those of the dense model. Tied weights (an LM head sharing the token embedding) stay tied:
both layers hold the same shard ``Parameter``.

Example:
    >>> originals = apply_plan(model, plan, grid.mp_group)   # now 1/mp of each split layer  # doctest: +SKIP
    >>> consolidate(model)                                    # and now the dense layers again  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Optional, Union, cast

from torch import Tensor, nn

from lightning_dpmp.parallel.comm import gather_from_sequence, group_size, scatter_to_group
from lightning_dpmp.parallel.experts_layer import ExpertsShards, consolidate_experts
from lightning_dpmp.parallel.sharding import (
    Blocks,
    DenseGather,
    ParallelLinear,
    gather_tensor,
    shard_blocks,
    shard_dims,
)
from lightning_dpmp.planner.plan import Plan
from lightning_dpmp.planner.structure import set_per_rank, unset_per_rank
from lightning_dpmp.planner.styles import BuildContext

__all__ = ["apply_plan", "consolidate", "consolidated_state_dict", "restore", "set_submodule"]

_ADJUSTED = "_dpmp_dense_attrs"  # on a module whose head counts were set per rank: its attributes as they were
_SP_HOOK = "_dpmp_sequence_hook"  # on an unsplit embedding whose output is split along the sequence


def _modules_with_names(model: nn.Module) -> list[tuple[nn.Module, list[str]]]:
    """Every module object once, with all the names it is registered under (in module order)."""
    out: dict[int, tuple[nn.Module, list[str]]] = {}
    for name, mod in model.named_modules(remove_duplicate=False):
        out.setdefault(id(mod), (mod, []))[1].append(name)
    return list(out.values())


def _names_by_module(model: nn.Module) -> dict[int, list[str]]:
    return {id(m): names for m, names in _modules_with_names(model)}


def set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    """Replace ``root.<name>`` (dotted) by ``module``, keeping its slot in the parent's module order."""
    parent_name, _, attr = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, attr, module)


def apply_plan(
    model: nn.Module, plan: Plan, group: Any, rng: Optional[Any] = None
) -> dict[str, Union[nn.Module, ExpertsShards]]:
    """Swap every planned layer of ``model`` for its parallel form, sliced from the dense weights.

    ``rng`` (a :class:`~lightning_dpmp.parallel.rng.RNGTracker`) gives column -> row regions their own dropout stream.
    Returns the dense layers that were replaced, by name, so that :func:`restore` can put them back.
    """
    originals: dict[str, Union[nn.Module, ExpertsShards]] = {}
    if group_size(group) == 1:
        return originals
    sp = plan.sequence
    ctx = BuildContext(group, rng=rng, sequence=sp, experts=plan.experts)
    shards: dict[int, nn.Parameter] = {}  # id(dense weight) -> shard, to keep ties
    repoint: dict[int, nn.Parameter] = {}  # id(dense parameter) -> its replacement, for aliases elsewhere
    aliases = _names_by_module(model)
    order = sorted(plan.layers.values(), key=lambda lp: lp.kind != "embedding")  # embeddings first: they own ties
    owners = {n for n, lp in plan.layers.items() if lp.parallel_style.builds_children}
    for lp in order:
        style = lp.parallel_style
        if not style.swaps_module or lp.name.rpartition(".")[0] in owners:
            continue  # out_proj of a head-parallel attention: split by the attention layer itself
        dense = model.get_submodule(lp.name)
        if style.in_place:  # split in place: the module keeps its class and code (parallel/experts_layer.py)
            originals[lp.name] = style.build(dense, lp, ctx)
            continue
        layer = style.build(dense, lp, ctx)
        assert isinstance(layer, nn.Module), lp.name  # only in-place styles return an ExpertsShards
        if not style.swaps_weight:  # a whole attention module: no single weight to tie, one name
            originals[lp.name] = dense
            set_submodule(model, lp.name, layer)
            repoint.update(_param_map(dense, layer))
            continue
        if id(dense.weight) in shards:
            layer.weight = shards[id(dense.weight)]
        shards[id(dense.weight)] = cast(nn.Parameter, layer.weight)
        for name in aliases.get(id(dense), [lp.name]):  # the same module object registered under several names
            originals[name] = dense
            set_submodule(model, name, layer)
        repoint.update(_param_map(dense, layer))
    # A parameter can be registered under several names (a decoder bias also held by its parent, as in BERT's
    # MLM head): every other holder must see the shard too, or it would keep training a stale dense copy.
    _repoint_aliases(model, repoint)
    if sp is not None:  # attention/MLP modules gather the sequence at their input (their code sees all of it)
        for name in sp.owner_gather:
            module = model.get_submodule(name)
            module.__dict__[_SP_HOOK] = module.register_forward_pre_hook(_SequenceGather(group))
    if sp is not None:  # unsplit embeddings feeding the stream keep only their slice of the sequence
        for name in sp.scatter:
            if not plan.layers[name].parallel_style.splits:
                module = model.get_submodule(name)
                module.__dict__[_SP_HOOK] = module.register_forward_hook(_SequenceScatter(group, rng))
    for name, attrs in plan.adjust.items():  # head counts: attributes, a config's fields (on a copy), einops' h=
        module = model.get_submodule(name) if name else model
        setattr(module, _ADJUSTED, set_per_rank(module, {a: local for a, (_, local) in attrs.items()}))
    return originals


class _SequenceGather:
    """Forward pre-hook: all-gather the sequence (dim -2) of a module's first input (backward: reduce-scatter)."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        return (gather_from_sequence(args[0], self.group, -2),) + tuple(args[1:])


class _SequenceScatter:
    """Forward hook: keep this rank's slice of the sequence (dim -2) of a replicated module's output."""

    def __init__(self, group: Any, rng: Optional[Any]) -> None:
        self.group, self.rng = group, rng

    def __call__(self, module: nn.Module, args: Any, output: Tensor) -> Tensor:
        if self.rng is not None:
            self.rng.enter_for(module.training)  # sequence-split regions: different tokens per rank, different masks
        return scatter_to_group(output, self.group, output.dim() - 2)


def _restore_attrs(model: nn.Module) -> None:
    for module in model.modules():
        unset_per_rank(module, module.__dict__.pop(_ADJUSTED, None) or {})
        hook = module.__dict__.pop(_SP_HOOK, None)
        if hook is not None:
            hook.remove()


def restore(model: nn.Module, originals: dict[str, Union[nn.Module, ExpertsShards]]) -> None:
    """Put back the dense layers :func:`apply_plan` returned (no communication)."""
    back: dict[int, nn.Parameter] = {}
    for name, dense in originals.items():
        if isinstance(dense, ExpertsShards):
            dense.restore()
        else:
            back.update(_param_map(model.get_submodule(name), dense))
            set_submodule(model, name, dense)
    _repoint_aliases(model, back)
    _restore_attrs(model)


def consolidate(model: nn.Module, gather: Optional[DenseGather] = None
                ) -> dict[int, tuple[nn.Parameter, Optional[int], Blocks]]:
    """Replace every parallel layer by its dense module holding the gathered weights (collective over MP).

    ``gather`` (default: all-gathered, every rank dense) can gather onto the MP group's first rank only: the others
    get the dense modules' shells on the meta device (the end of a run where rank 0 alone keeps the model).

    Returns ``{id(shard parameter): (dense parameter, split dim or None, fused blocks)}`` so that optimizers can follow
    (:func:`lightning_dpmp.checkpoint.consolidated.consolidate_optimizer`).
    """
    moved: dict[int, tuple[nn.Parameter, Optional[int], Blocks]] = {}
    done: list[str] = []
    for mod, names in _modules_with_names(model):
        name = names[0]
        if not isinstance(mod, ParallelLinear) or any(name.startswith(d + ".") for d in done):
            continue  # a parallel layer inside another (an attention's out_proj) is gathered by its owner
        weight = getattr(mod, "weight", None)  # an attention layer has none (in_proj_weight is never tied)
        tied = moved.get(id(weight)) if weight is not None else None
        dense = mod.to_dense(gather)
        for sub, part in mod.named_modules():
            if not isinstance(part, ParallelLinear):
                continue
            target = dense.get_submodule(sub) if sub else dense
            for pname, dim in part._shard_dims.items():
                if getattr(part, pname, None) is not None:
                    blocks = part.blocks if dim is not None else 1
                    moved.setdefault(id(getattr(part, pname)), (getattr(target, pname), dim, blocks))
        if tied is not None:
            dense.weight = tied[0]
        for alias in names:  # the same module object registered under several names (T5's shared embedding)
            set_submodule(model, alias, dense)
        done.extend(names)
    moved.update(consolidate_experts(model, gather))
    _repoint_aliases(model, {k: v[0] for k, v in moved.items()})
    _restore_attrs(model)
    return moved


def _param_map(old: nn.Module, new: nn.Module) -> dict[int, nn.Parameter]:
    """``{id(old.<p>): new.<p>}`` for the direct parameters the two layers have in common by name."""
    fresh = dict(new.named_parameters(recurse=False))
    return {id(p): fresh[n] for n, p in old.named_parameters(recurse=False) if n in fresh}


def _repoint_aliases(model: nn.Module, mapping: dict[int, nn.Parameter]) -> None:
    """Make every module that registers a replaced parameter under its own name hold the replacement."""
    if not mapping:
        return
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) in mapping and mapping[id(p)] is not p:
                setattr(module, name, mapping[id(p)])


def consolidated_state_dict(model: nn.Module, group: Any) -> dict[str, Tensor]:
    """``model.state_dict()`` with every split parameter gathered to its dense shape (collective over MP).

    Keys are the dense model's, so the result loads with ``strict=True`` into the plain model.
    """
    blocks = shard_blocks(model)  # weight *and* bias of a fused projection are split block by block
    state = model.state_dict()
    for key, dim in shard_dims(model).items():
        state[key] = gather_tensor(state[key].detach(), dim, group, blocks.get(key, 1))
    return state
