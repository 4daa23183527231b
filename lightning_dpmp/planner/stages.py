"""Pipeline stages from one traced step: where the repeated block stack can be cut, and where it should be.

:func:`probe_stack` runs the user's step once (no backward) and watches the repeated blocks
(:func:`~lightning_dpmp.parallel.compiled.repeated_blocks`) and every torch function call. It records what a
pipeline split needs and refuses, naming the layer, a step that cannot be cut between blocks:

* the blocks must run once each, in their list order, each taking the previous block's output as its *stream*
  argument (the first tensor argument of block 0, the same position or keyword for the others);
* nothing but the next block may read a block's output, and nothing outside a block may read a tensor made inside it
  (a loss reading a block's internals, attention maps returned and used, a skip connection across blocks);
* the other tensors a block reads (masks, rotary tables, positions) must not carry gradients: every stage
  recomputes them from the batch, so they must not depend on parameters, which live on one stage only.

The cost of each part (matmul FLOPs and parameters, per block, before the stack and after it) feeds
:func:`balance`, which cuts the blocks into contiguous stages minimising the most expensive stage; the part before
the stack joins the first stage, the part after it the last.

Example:
    >>> balance([4, 4, 4, 4], pre=0, post=0, n_stages=2)
    [(0, 2), (2, 4)]
    >>> balance([1, 1, 1, 1, 1, 1], pre=0, post=3, n_stages=2)   # the head weighs on the last stage
    [(0, 4), (4, 6)]
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

import lightning_dpmp.compat as compat
from lightning_dpmp.parallel.compiled import repeated_blocks

__all__ = ["BETWEEN", "POST", "PRE", "StackProfile", "StageCutError", "balance", "probe_stack", "stand_in_shape"]

PRE, POST, BETWEEN = -1, -2, -3  # outside the blocks: before the stack, after it, between two blocks
_MATMULS = {torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm, torch.nn.functional.linear,
            Tensor.matmul, Tensor.mm, Tensor.bmm, Tensor.__matmul__}
_NOT_READS = {"size", "dim", "numel", "__len__", "is_floating_point", "requires_grad_", "register_hook",
              "__get__", "__set__", "_is_view", "data_ptr", "element_size", "get_device"}


class StageCutError(ValueError):
    """The step cannot be cut into pipeline stages between its repeated blocks; the message names why and where."""


@dataclass
class StackProfile:
    """What :func:`probe_stack` saw of one step.

    Attributes:
        names: the blocks' qualified names, in call order.
        stream: where each block takes the stream, a position (``int``) or a keyword (``str``).
        stream_shape: the stream's shape at the probed batch (dim 0 is the batch), the same between every block.
        stream_dtype: its dtype.
        output_arity: 0 when a block returns the stream tensor itself, else the length of the tuple it returns (the
            stream first, ``None`` after it).
        batch_size: the probed batch's size (dim 0 of its tensors).
        flops: matmul FLOPs of each block (list) and of the parts before and after the stack.
        params: parameter elements read by each block, and before and after the stack.
        param_regions: parameter name (every name of a tied one) -> the regions that read it (block indices,
            :data:`PRE`, :data:`POST`); by name, so that it holds for the split model the probed dense one becomes.
        pre_modules: the outermost modules with parameters called before the stack (embeddings), by name:
            ``(first input's shape, output shape, output dtype)``. The later stages need only their outputs' shapes
            (the stream they start is received): :func:`stand_in_shape`.
        pre_direct: names of the parameters the code before the stack reads outside those modules (it runs on
            every stage, so every stage keeps them).
    """

    names: list[str]
    stream: Union[int, str]
    stream_shape: tuple[int, ...]
    stream_dtype: torch.dtype
    output_arity: int
    batch_size: int
    flops: list[float]
    pre_flops: float
    post_flops: float
    params: list[int]
    pre_params: int
    post_params: int
    param_regions: dict[str, set[int]] = field(default_factory=dict)
    pre_modules: dict[str, tuple[tuple[int, ...], tuple[int, ...], torch.dtype]] = field(default_factory=dict)
    pre_direct: set[str] = field(default_factory=set)

    def costs(self) -> tuple[list[float], float, float]:
        """``(per block, before, after)``: matmul FLOPs, or parameter elements when no matmul was seen."""
        if sum(self.flops) + self.pre_flops + self.post_flops > 0:
            return list(self.flops), self.pre_flops, self.post_flops
        return [float(p) for p in self.params], float(self.pre_params), float(self.post_params)


def stand_in_shape(recorded: tuple[tuple[int, ...], tuple[int, ...], Any], first_input: Any
                   ) -> Optional[tuple[int, ...]]:
    """The output shape a :attr:`StackProfile.pre_modules` entry gives for ``first_input``: its shape followed by
    the output's trailing dims, when the probed output had the probed input's shape as its prefix (an embedding:
    ids ``(B, T)`` -> ``(B, T, H)``); ``None`` otherwise (run the module itself).

    Example:
        >>> stand_in_shape(((8, 16), (8, 16, 32), torch.float64), torch.zeros(2, 16, dtype=torch.long))
        (2, 16, 32)
    """
    in_shape, out_shape, _ = recorded
    if not isinstance(first_input, Tensor) or tuple(out_shape[: len(in_shape)]) != tuple(in_shape):
        return None
    return tuple(first_input.shape) + tuple(out_shape[len(in_shape):])


def balance(costs: list[float], pre: float, post: float, n_stages: int) -> list[tuple[int, int]]:
    """Cut ``costs`` (one per block) into ``n_stages`` contiguous, non-empty ``[start, end)`` ranges minimising the
    largest stage cost, with ``pre`` added to the first stage and ``post`` to the last; ties go to the earliest cut
    (fewer blocks on earlier stages: under 1F1B the first stage keeps the most micro-batches' activations)."""
    n = len(costs)
    if n_stages > n:
        raise StageCutError(f"{n_stages} pipeline stages need at least {n_stages} repeated blocks; the model has {n}.")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def stage_cost(s: int, a: int, b: int) -> float:
        return prefix[b] - prefix[a] + (pre if s == 0 else 0.0) + (post if s == n_stages - 1 else 0.0)

    # best[s][e]: the smallest achievable max over stages 0..s covering blocks [0, e)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_stages)]
    cut = [[0] * (n + 1) for _ in range(n_stages)]
    for e in range(1, n + 1):
        best[0][e] = stage_cost(0, 0, e)
    for s in range(1, n_stages):
        for e in range(s + 1, n + 1):
            for a in range(s, e):  # last stage [a, e); the earliest cut wins ties
                value = max(best[s - 1][a], stage_cost(s, a, e))
                if value < best[s][e]:
                    best[s][e], cut[s][e] = value, a
    ranges, e = [], n
    for s in range(n_stages - 1, -1, -1):
        a = cut[s][e] if s else 0
        ranges.append((a, e))
        e = a
    return ranges[::-1]


def _matmul_flops(func: Any, args: tuple, out: Any) -> float:
    """2·m·n·k of a matmul-like call, from its output's size and its first operand's last dim."""
    if not isinstance(out, Tensor):
        return 0.0
    first = args[0] if args else None
    if func is torch.addmm or func is torch.baddbmm:
        first = args[1] if len(args) > 1 else None
    if not isinstance(first, Tensor) or first.dim() == 0:
        return 0.0
    return 2.0 * out.numel() * first.shape[-1]


class _Watch(TorchFunctionMode):
    """Records, per region, which parameters are read, matmul FLOPs, and the tensors made there; flags reads of
    another region's tensors that a pipeline cut would not carry."""

    def __init__(self, params: dict[int, nn.Parameter], names: list[str]) -> None:
        super().__init__()
        self.params = params
        self.names = names
        self.region = PRE
        self.made: dict[int, tuple[int, Any]] = {}  # id(tensor) -> (region, weakref): tensors compare by value
        self.outputs: dict[int, int] = {}  # id(block output) -> block index
        self.allowed: set[int] = set()  # id of the stream tensor the running block may read
        self.flops: dict[int, float] = {}
        self.used: dict[int, set[int]] = {}
        self.open_pre: list[str] = []  # the stood-in module running now (the probe's hooks keep it)
        self.pre_direct: set[int] = set()
        self.problem: Optional[str] = None

    def _where(self, region: int) -> str:
        outside = {PRE: "the code before the block stack", POST: "the code after the block stack",
                   BETWEEN: "code between two blocks"}
        return outside.get(region) or f"block {self.names[region]}"

    def source(self, t: Tensor) -> Optional[int]:
        entry = self.made.get(id(t))
        return entry[0] if entry is not None and entry[1]() is t else None

    def mark(self, t: Tensor, region: int) -> None:
        self.made[id(t)] = (region, weakref.ref(t))

    def _check_read(self, t: Tensor, fname: str) -> None:
        src = self.source(t)
        if src is None or src == self.region or self.problem is not None:
            return
        if id(t) in self.allowed:  # the running block's stream input
            return
        if src in (PRE, BETWEEN):  # every stage recomputes these: fine unless they depend on parameters
            if t.requires_grad:
                self.problem = (f"{self._where(self.region)} reads a tensor that {self._where(src)} computed and "
                                f"that carries gradients ({fname}, shape {tuple(t.shape)}), besides the stream: a "
                                f"side output that would cross pipeline stages")
            return
        block = self.outputs.get(id(t))
        if block is not None and (self.region == block + 1 or (self.region == POST and block == len(self.names) - 1)):
            return
        what = "the output" if block is not None else "a tensor computed inside"
        self.problem = (f"{self._where(self.region)} reads {what} of {self._where(src)} ({fname}, shape "
                        f"{tuple(t.shape)}): only the next block may read a block's output, so the step cannot be "
                        f"cut between these blocks")

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        with compat.unwatched():  # (a trace watching the same step records the step's ops, not these)
            self._record(func, args, kwargs, out)
        return out

    def _record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        fname = getattr(func, "__name__", str(func))
        if fname in _NOT_READS:
            return
        leaves, _ = compat.tree_flatten((args, kwargs))
        for leaf in leaves:
            if isinstance(leaf, Tensor):
                if id(leaf) in self.params:
                    self.used.setdefault(id(leaf), set()).add(self.region)
                    if self.region == PRE and not self.open_pre:
                        self.pre_direct.add(id(leaf))
                    if self.region == BETWEEN and self.problem is None:
                        self.problem = (f"code between two blocks reads a parameter ({fname}, shape "
                                        f"{tuple(leaf.shape)}): it would run on both sides of a pipeline cut")
                self._check_read(leaf, fname)
        if func in _MATMULS:
            self.flops[self.region] = self.flops.get(self.region, 0.0) + _matmul_flops(func, args, out)
        for leaf in compat.tree_flatten(out)[0]:
            if isinstance(leaf, Tensor) and self.source(leaf) is None:
                self.mark(leaf, self.region)


def _unwatched(hook: Callable[..., None]) -> Callable[..., None]:
    """``hook`` run with torch functions unseen by any mode: the probe's bookkeeping, not the step's ops."""
    def run(*args: Any, **kwargs: Any) -> None:
        with compat.unwatched():
            hook(*args, **kwargs)

    return run


def _stream_of(args: tuple, kwargs: dict, where: Union[int, str, None]) -> tuple[Union[int, str], Any]:
    if where is None:  # block 0: its first tensor argument
        for i, a in enumerate(args):
            if isinstance(a, Tensor):
                return i, a
        for k, v in kwargs.items():
            if isinstance(v, Tensor):
                return k, v
        raise StageCutError("the first repeated block takes no tensor argument to carry between pipeline stages")
    value = args[where] if isinstance(where, int) and where < len(args) else kwargs.get(str(where))
    return where, value


def probe_stack(module: nn.Module, run_step: Callable[[], Any], batch_size: int) -> StackProfile:
    """Run ``run_step`` once (gradients on, no backward) watching ``module``'s repeated blocks; raise
    :class:`StageCutError` with the reason and the layer when the step cannot be cut between them."""
    blocks = repeated_blocks(module)
    if len(blocks) < 2:
        raise StageCutError(
            f"pipeline parallelism cuts the model between its repeated blocks (children of an nn.ModuleList that "
            f"own parameters); {type(module).__name__} has {len(blocks)}."
        )
    names = [n for n, _ in blocks]
    index = {id(m): i for i, (_, m) in enumerate(blocks)}
    params = {id(p): p for p in module.parameters()}
    watch = _Watch(params, names)
    calls: list[int] = []
    info: dict[str, Any] = {"stream": None, "arity": None, "shape": None, "dtype": None}
    problems: list[str] = []

    @_unwatched
    def pre_hook(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        i = index[id(mod)]
        calls.append(i)
        where, value = _stream_of(args, kwargs, info["stream"])
        if info["stream"] is None:
            info.update(stream=where, shape=tuple(value.shape), dtype=value.dtype)
        elif not isinstance(value, Tensor) or watch.outputs.get(id(value)) != i - 1:
            problems.append(f"block {names[i]} does not take block {names[i - 1] if i else '?'}'s output as its "
                            f"stream argument ({where!r})")
        elif tuple(value.shape) != info["shape"] or value.dtype != info["dtype"]:
            problems.append(f"block {names[i]}'s stream has shape {tuple(value.shape)} {value.dtype}, block "
                            f"{names[0]}'s {info['shape']} {info['dtype']}: the stages must pass one shape")
        watch.allowed = {id(value)} if isinstance(value, Tensor) else set()
        watch.region = i

    @_unwatched
    def post_hook(mod: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        i = index[id(mod)]
        arity = 0 if isinstance(out, Tensor) else len(out) if isinstance(out, (tuple, list)) else -1
        first = out if arity == 0 else out[0] if arity > 0 else None
        if not isinstance(first, Tensor) or (arity > 0 and any(o is not None for o in out[1:])):
            problems.append(f"block {names[i]} returns {type(out).__name__}: a pipeline stage passes one tensor (or a "
                            f"tuple of it and Nones)")
        elif info["arity"] is None:
            info["arity"] = arity
        if isinstance(first, Tensor):
            watch.outputs[id(first)] = i
            watch.mark(first, i)
        watch.allowed = set()
        # code between two blocks would run on both sides of a cut: it may not read the stream (a check above)
        watch.region = POST if i == len(names) - 1 else BETWEEN

    # the outermost modules with parameters called before the stack (not the model around the blocks)
    module_names = {id(m): n for n, m in module.named_modules()}
    around = {n for n in module_names.values() if any(b == n or b.startswith(f"{n}.") or not n for b in names)}
    pre_modules: dict[str, tuple[tuple[int, ...], tuple[int, ...], torch.dtype]] = {}
    open_pre = watch.open_pre

    @_unwatched
    def any_pre(mod: nn.Module, args: tuple) -> None:
        name = module_names.get(id(mod))
        if (watch.region == PRE and name is not None and name not in around and not open_pre
                and next(mod.parameters(), None) is not None):
            first = next((a for a in args if isinstance(a, Tensor)), None)
            open_pre.append(name)
            pre_modules[name] = (tuple(first.shape) if first is not None else (), (), torch.float32)

    @_unwatched
    def any_post(mod: nn.Module, args: tuple, out: Any) -> None:
        name = module_names.get(id(mod))
        if open_pre and name == open_pre[-1]:
            open_pre.pop()
            recorded = (pre_modules[name][0], tuple(out.shape), out.dtype) if isinstance(out, Tensor) else None
            first = next((a for a in args if isinstance(a, Tensor)), None)
            if recorded is not None and watch.region == PRE and stand_in_shape(recorded, first) is not None:
                pre_modules[name] = recorded
            else:  # not stood in: it runs on every stage, so every stage keeps its parameters
                del pre_modules[name]
                watch.pre_direct.update(id(p) for p in mod.parameters())

    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    handles = [register_module_forward_pre_hook(any_pre), register_module_forward_hook(any_post)]
    for _, m in blocks:
        handles.append(m.register_forward_pre_hook(pre_hook, with_kwargs=True))
        handles.append(m.register_forward_hook(post_hook, with_kwargs=True))
    try:
        with watch:
            run_step()
    finally:
        for h in handles:
            h.remove()
    if calls != list(range(len(names))):
        raise StageCutError(
            f"the repeated blocks ran in the order {[names[i] for i in calls][:8]}, not once each in their list order "
            f"({names[:3]}...): pipeline stages are contiguous runs of blocks called one after another"
        )
    if watch.problem:  # the first read that crosses a cut, with the op that read it
        raise StageCutError(watch.problem)
    if problems:
        raise StageCutError(problems[0])
    shape = info["shape"]
    if not shape or shape[0] != batch_size:
        raise StageCutError(f"the stream between blocks has shape {shape}, whose first dim is not the batch size "
                            f"{batch_size}: micro-batches split the batch along dim 0")
    per_block_params = [sum(p.numel() for p in m.parameters()) for _, m in blocks]
    outside = {PRE: 0, POST: 0}
    for pid, regions in watch.used.items():
        for r in regions & {PRE, POST}:
            outside[r] += params[pid].numel()
    names_of: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    by_name = {n: set(regions) for pid, regions in watch.used.items() for n in names_of.get(pid, [])}
    direct = {n for pid in watch.pre_direct for n in names_of.get(pid, [])}
    return StackProfile(
        names=names, stream=info["stream"], stream_shape=shape, stream_dtype=info["dtype"],
        output_arity=int(info["arity"] or 0), batch_size=batch_size,
        flops=[watch.flops.get(i, 0.0) for i in range(len(names))], pre_flops=watch.flops.get(PRE, 0.0),
        post_flops=watch.flops.get(POST, 0.0), params=per_block_params, pre_params=outside[PRE],
        post_params=outside[POST], param_regions=by_name, pre_modules=pre_modules, pre_direct=direct,
    )
