"""ZeRO-2/3 over the DP group, the flat-shard layer: buffers, their DP slices, and the optimizer over the slices.

The trainable MP-local parameters are laid out in flat buffers (:class:`FlatLayout`), one per bucket: the
parameters of one unit (a repeated block, or the root rest), one optimizer param group, one *kind* and one dtype.
Kinds keep apart what the global-norm clip and the sequence-parallel sum treat differently: ``"split"`` (MP shards:
their squares are summed over MP), ``"replicated"``, ``"partial"`` (sequence-parallel partial gradients, summed
over MP once per step) and ``"frozen"`` (never reduced, only gathered, ZeRO-3). Each buffer is padded to a multiple
of ``dp``; DP rank ``r`` owns the contiguous slice ``[r·n/dp, (r+1)·n/dp)``, held as a flat ``nn.Parameter``, the
*shard*. The module's parameters become views into the gathered buffer (``Bucket.full``), so gathering the buffer
updates them without a copy, and freeing its storage (ZeRO-3) frees them; autograd's saved tensors are those views,
so they see the data gathered again before the backward.

The user's optimizer is rebuilt as the same class over the shards, with the same hyper-parameters per group
(:func:`rebuild_optimizer`). That is exact for element-wise optimizers (SGD, Adam, AdamW, RMSprop, ...); an
optimizer whose update depends on a parameter's shape (Adafactor, Shampoo, LAMB's per-tensor trust ratio, LBFGS)
would see flat slices instead and is not supported; torch's own such classes are refused.

Example:
    >>> layout = FlatLayout.of([3, 4], dp=2)          # two parameters of 3 and 4 elements
    >>> layout.total, layout.shard, layout.owned(1)
    (8, 4, (4, 8))
    >>> layout.pieces(1)                                # (param index, param lo, param hi, shard lo)
    [(1, 1, 4, 0)]
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

import lightning_dpmp.compat as compat
from lightning_dpmp.parallel import comm
from lightning_dpmp.parallel.comm import tensor_collectives_supported
from lightning_dpmp.parallel.freed_reads import storage_freed

__all__ = [
    "Bucket", "FlatLayout", "all_gather_flat", "gather_buckets", "optimizer_defaults", "rebuild_optimizer",
    "reduce_scatter_buckets", "reduce_scatter_flat", "storage_bytes",
]

KINDS = ("split", "replicated", "partial", "frozen")


@dataclass(frozen=True)
class FlatLayout:
    """Where each parameter lies in a flat buffer padded to a multiple of ``dp``, and which slice each rank owns."""

    numels: tuple[int, ...]
    offsets: tuple[int, ...]
    total: int  # padded length
    shard: int  # total // dp
    dp: int

    @classmethod
    def of(cls, numels: list[int], dp: int) -> FlatLayout:
        offsets, at = [], 0
        for n in numels:
            offsets.append(at)
            at += n
        total = -(-at // dp) * dp if at else dp
        return cls(tuple(numels), tuple(offsets), total, total // dp, dp)

    def owned(self, rank: int) -> tuple[int, int]:
        """``[lo, hi)`` of the flat buffer that DP rank ``rank`` owns."""
        return rank * self.shard, (rank + 1) * self.shard

    def pieces(self, rank: int) -> list[tuple[int, int, int, int]]:
        """The parts of each parameter inside ``rank``'s slice: ``(index, param lo, param hi, shard lo)``."""
        lo, hi = self.owned(rank)
        out = []
        for i, (off, n) in enumerate(zip(self.offsets, self.numels)):
            a, b = max(lo, off), min(hi, off + n)
            if a < b:
                out.append((i, a - off, b - off, a - lo))
        return out


# ------------------------------------------------------------------------------------------ collectives
# The tensor forms (torch 2.13's ``*_single`` names) where the backend has them, decided in one place
# (:func:`~lightning_dpmp.parallel.comm.tensor_collectives_supported`); the list forms otherwise.
def reduce_scatter_flat(out: Tensor, flat: Tensor, group: Any, async_op: bool) -> Any:
    """SUM-reduce ``flat`` over ``group``, this rank's ``1/n`` slice into ``out``."""
    if tensor_collectives_supported(group, flat.device):
        return comm.reduce_scatter_single(out, flat, group=group, async_op=async_op)
    return dist.reduce_scatter(out, list(flat.chunk(dist.get_world_size(group))), group=group, async_op=async_op)


def all_gather_flat(full: Tensor, shard: Tensor, group: Any, async_op: bool) -> Any:
    """Every rank's ``shard`` concatenated into ``full`` (in rank order)."""
    if tensor_collectives_supported(group, shard.device):
        return comm.all_gather_single(full, shard, group=group, async_op=async_op)
    return dist.all_gather(list(full.chunk(dist.get_world_size(group))), shard, group=group, async_op=async_op)


def storage_bytes(tensors: list[Tensor], seen: Optional[set[int]] = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` as allocated now (a freed view counts 0; a ``DTensor``,
    such as a parameter torch's FSDP2 sharded, counts its local shard)."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        local = getattr(t, "to_local", None)
        st = (local() if callable(local) else t).untyped_storage()
        key = st.data_ptr()
        if st.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += st.nbytes()
    return total


# ------------------------------------------------------------------------------------------ a bucket
class Bucket:
    """One flat buffer over ``params`` (same dtype and device), its DP shard, and its pending collectives.

    Args:
        params: the MP-local parameters, in module order.
        kind: one of ``KINDS``.
        unit: index of the unit (``-1`` the root) whose forward uses them.
        opt_key: ``(optimizer index, param group index)``; ``None`` for parameters no optimizer steps.
        group: the DP process group; ``dp``/``rank`` its size and this rank's index in it.
    """

    def __init__(self, params: list[nn.Parameter], kind: str, unit: int, opt_key: Optional[tuple[int, int]],
                 group: Any, dp: int, rank: int, param_dtype: Optional[torch.dtype] = None,
                 reduce_dtype: Optional[torch.dtype] = None) -> None:
        self.params, self.kind, self.unit, self.opt_key = params, kind, unit, opt_key
        self.group, self.dp, self.rank = group, dp, rank
        self.layout = FlatLayout.of([p.numel() for p in params], dp)
        p0 = params[0]
        master = torch.zeros(self.layout.total, dtype=p0.dtype, device=p0.device)
        with torch.no_grad():
            for p, off in zip(params, self.layout.offsets):
                if not storage_freed(p):  # (a pipeline's other stage: zeros until a stage sync)
                    master[off : off + p.numel()].copy_(p.detach().reshape(-1))
        unallocated = all(storage_freed(p) for p in params)
        # Mixed precision (MixedPrecisionPolicy): the shard the optimizer steps keeps the parameters' own dtype (the
        # master copy); the gathered buffer the module computes with is in param_dtype; gradients are reduced in
        # reduce_dtype. Without a policy all three are the parameters' dtype and the buffer is the master itself.
        self.full = master if param_dtype in (None, p0.dtype) else master.to(param_dtype)
        self.mixed = self.full.dtype != p0.dtype
        self.reduce_dtype = reduce_dtype or self.full.dtype
        with torch.no_grad():
            for p, off in zip(params, self.layout.offsets):
                # The parameter keeps its object (and attributes) but now lives in the flat buffer.
                p.data = self.full[off : off + p.numel()].view(p.shape)
        # (kept: a view cannot be made again while zero=3 has the buffer's storage freed)
        self._views = [p.data for p in params]
        lo, hi = self.layout.owned(rank)
        self.shard = nn.Parameter(master[lo:hi].clone(), requires_grad=self.trainable)
        self.gathered = True
        self._gather_work: Any = None
        self._gather_src: Optional[Tensor] = None  # the cast shard an asynchronous gather reads (kept alive)
        self._master: Optional[Tensor] = None  # mixed precision: the master-dtype buffer of use_master
        self._master_depth = 0  # use_master calls not undone yet (they nest)
        self._rs: Optional[tuple[Any, Tensor, Tensor]] = None  # (work, out, flat input kept alive)
        # zero=3 with reshard_after_forward=False while accumulating: the whole gradients, flat, in the reduce dtype
        self._stash: Optional[Tensor] = None
        self._offset_of = {id(p): off for p, off in zip(params, self.layout.offsets)}
        self.fired: set[int] = set()
        self.used_here = False  # whether this rank had any of the parameters' gradients at the last reduce-scatter
        if unallocated and not self.mixed:  # another pipeline stage's, on a meta-device model: its buffer is not kept
            self.free()  # (so building the engine holds one such buffer at a time, never the whole model)

    @property
    def trainable(self) -> bool:
        return self.kind != "frozen" and self.opt_key is not None

    # ---------------------------------------------------------------- parameters
    def gather(self, async_op: bool = False) -> None:
        """Make the full buffer (and so the module's parameters) hold the current values of every rank's shard."""
        gather_buckets([self], self.group, async_op)

    def gathered_copy(self, source: Tensor) -> Tensor:
        """A new flat buffer of this bucket's length holding every rank's ``source`` (its shard, or an optimizer
        state of the shard's shape) in rank order: the MP-local values of all its parameters (collective over DP)."""
        full = torch.empty(self.layout.total, dtype=source.dtype, device=source.device)
        with torch.no_grad():
            all_gather_flat(full, source.detach().contiguous(), self.group, async_op=False)
        return full

    def gather_source(self) -> Tensor:
        """What this rank contributes to a gather: its shard, in the compute dtype under mixed precision."""
        src = self.shard.detach()
        if self.mixed:
            src = src.to(self.full.dtype)
            self._gather_src = src
        return src

    def begin_gather(self) -> bool:
        """Allocate the full buffer for a gather the caller issues (:func:`gather_buckets`); False if it holds
        the values already."""
        if self.gathered:
            return False
        storage, size = self.full.untyped_storage(), self.layout.total * self.full.element_size()
        if storage.nbytes() != size:  # (a stale buffer held whole keeps its storage, which user code may have pinned:
            storage.resize_(size)     # a histogram's .numpy() of a parameter makes it not resizable)
        self.gathered = True
        return True

    def wait_gather(self) -> None:
        if self._gather_work is not None:
            self._gather_work.wait()
            self._gather_work = None
        self._gather_src = None

    def use_master(self) -> None:
        """Mixed precision: point the parameters at a master-dtype buffer gathered from the shards (collective over
        DP), so that checkpoints and teardown see the master values, not their compute-dtype copies."""
        self._master_depth += 1
        if self._master_depth > 1:
            return  # (nested: a read of a DTensor parameter's compute view inside parameters_whole) in use already
        self._master = self.gathered_copy(self.shard)
        for p, off in zip(self.params, self.layout.offsets):
            p.data = self._master[off : off + p.numel()].view(p.shape)

    def use_compute(self) -> None:
        """Undo :meth:`use_master`."""
        assert self._master is not None and self._master_depth > 0
        self._master_depth -= 1
        if self._master_depth:
            return
        for p, view in zip(self.params, self._views):
            p.data = view
        self._master = None

    def free(self) -> None:
        """Release the full buffer's storage (ZeRO-3): the module's parameters become empty views until gathered."""
        if not self.gathered:
            return
        self.wait_gather()
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    # ---------------------------------------------------------------- gradients
    def launch_reduce_scatter(self) -> None:
        """Flatten the parameters' gradients (absent ones are zero), free them, and start the DP reduce-scatter."""
        ready = self.prepare_reduce_scatter()
        if ready is not None:
            self._rs = (reduce_scatter_flat(ready[0], ready[1], self.group, async_op=True), *ready)

    def stash_grad(self, p: Tensor) -> None:
        """Move ``p``'s gradient (one of :attr:`params`) into the bucket's flat accumulator, in the reduce dtype
        (so micro-batches accumulate there, not in the compute dtype), and free it; the next reduce-scatter sends
        the accumulator."""
        if p.grad is None:
            return
        self.add_grad(p, p.grad)
        p.grad = None

    def add_grad(self, p: Tensor, grad: Tensor) -> None:
        """Add ``grad`` (of ``p``, one of :attr:`params`) into the flat accumulator the next reduce-scatter sends."""
        if self._stash is None:
            self._stash = torch.zeros(self.layout.total, dtype=self.reduce_dtype, device=self.full.device)
        off = self._offset_of[id(p)]
        self._stash[off : off + p.numel()].add_(grad.detach().reshape(-1))
        self.used_here = True

    @property
    def stashed(self) -> bool:
        """Whether the accumulator holds gradients not sent yet."""
        return self._stash is not None

    def prepare_reduce_scatter(self) -> Optional[tuple[Tensor, Tensor]]:
        """``(out, flat)`` for a reduce-scatter the caller issues (:func:`reduce_scatter_buckets`): the gradients
        (and what :meth:`stash_grad` accumulated) flattened into ``flat`` (absent ones are zero) and freed; ``None``
        if one is already under way."""
        if self._rs is not None:
            return None
        stash, self._stash = self._stash, None
        self.used_here = stash is not None
        flat = stash if stash is not None else torch.zeros(self.layout.total, dtype=self.reduce_dtype,
                                                           device=self.full.device)
        for p, off in zip(self.params, self.layout.offsets):
            if p.grad is not None:
                self.used_here = True
                part = flat[off : off + p.numel()]
                (part.add_ if stash is not None else part.copy_)(p.grad.detach().reshape(-1))
                p.grad = None
        return torch.empty(self.layout.shard, dtype=flat.dtype, device=flat.device), flat

    def finish_reduce_scatter(self, used: bool = True) -> None:
        """Wait for the reduce-scatter and add the DP average into the shard's gradient; unless ``used`` (no DP
        rank had these parameters' gradients), leave the shard's gradient as it is (``None``: the step skips it)."""
        if self._rs is None:
            return
        work, out, _ = self._rs
        work.wait()
        self._rs = None
        if not used:
            return
        out.div_(self.dp)  # SUM / dp: DDP's average
        out = out.to(self.shard.dtype)  # (mixed precision: reduced in reduce_dtype, stepped in the master dtype)
        if self.shard.grad is None:
            self.shard.grad = out
        else:
            self.shard.grad.add_(out)

    def has_grads(self) -> bool:
        return self._stash is not None or any(p.grad is not None for p in self.params)

    # ---------------------------------------------------------------- optimizer state
    def export_state(self, shard_state: dict[str, Any]) -> list[dict[str, Any]]:
        """Per-parameter optimizer state from the shard's (collective over DP): element-wise tensors gathered and
        cut per parameter, everything else (``step``) copied."""
        per: list[dict[str, Any]] = [{} for _ in self.params]
        for key, value in shard_state.items():
            if isinstance(value, Tensor) and value.shape == self.shard.shape:
                full = self.gathered_copy(value)
                for i, (p, off) in enumerate(zip(self.params, self.layout.offsets)):
                    per[i][key] = full[off : off + p.numel()].view(p.shape).clone()
            else:
                for d in per:
                    d[key] = value.clone() if isinstance(value, Tensor) else value
        return per


# ------------------------------------------------------------------------------------------ several buckets at once
# One coalesced collective per call, not one per bucket: a block's MP-split and MP-replicated buckets (and a frozen
# one) are gathered, and reduce-scattered, together, so each costs one DP round trip, as one FSDP unit does.
def gather_buckets(buckets: list[Bucket], group: Any, async_op: bool) -> None:
    """Gather every bucket of ``buckets`` that is not gathered, in one coalesced all-gather over ``group``; unless
    ``async_op``, wait for all of them (also for gathers already under way)."""
    todo = [b for b in buckets if b.begin_gather()]
    if len(todo) == 1:
        with torch.no_grad():
            work = all_gather_flat(todo[0].full, todo[0].gather_source(), group, async_op)
        todo[0]._gather_work = work if async_op else None
    elif todo:
        with torch.no_grad(), compat.coalesced_collectives(group, todo[0].full.device, async_op) as cm:
            for b in todo:
                all_gather_flat(b.full, b.gather_source(), group, async_op=False)
        work = _WaitOnce(cm)
        for b in todo:
            b._gather_work = work if async_op else None
    if not async_op:
        for b in buckets:
            b.wait_gather()


def reduce_scatter_buckets(buckets: list[Bucket], group: Any) -> None:
    """Start the DP reduce-scatter of every bucket's gradients (absent ones as zeros) in one coalesced collective
    (asynchronous; each bucket's :meth:`Bucket.finish_reduce_scatter` waits)."""
    todo = [(b, ready) for b in buckets if (ready := b.prepare_reduce_scatter()) is not None]
    if len(todo) == 1:
        b, (out, flat) = todo[0]
        b._rs = (reduce_scatter_flat(out, flat, group, async_op=True), out, flat)
    elif todo:
        with compat.coalesced_collectives(group, todo[0][1][1].device, async_ops=True) as cm:
            for _, (out, flat) in todo:
                reduce_scatter_flat(out, flat, group, async_op=False)
        work = _WaitOnce(cm)
        for b, (out, flat) in todo:
            b._rs = (work, out, flat)


class _WaitOnce:
    """The coalesced work of several buckets, waited for once: gloo copies a coalesced op's results into the
    outputs when it is waited for, so a second wait would overwrite a bucket that was already used (divided by dp,
    or freed) with the raw results again."""

    def __init__(self, work: Any) -> None:
        self.work: Any = work

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None


# ------------------------------------------------------------------------------------------ the optimizer
def _refused() -> tuple[type, ...]:
    names = ("Adafactor", "LBFGS", "SparseAdam", "Muon")  # torch's own classes whose update is not element-wise
    return tuple(getattr(torch.optim, n) for n in names if hasattr(torch.optim, n))


def optimizer_defaults(cls: Any, defaults: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's ``defaults`` minus keys its constructor does not take (AdamW's ``decoupled_weight_decay``)."""
    accepted = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in defaults.items() if k in accepted}


def rebuild_optimizer(opt: Optimizer, groups: list[list[nn.Parameter]]) -> Optimizer:
    """The same optimizer class over ``groups`` (one list of shard parameters per original param group), with each
    group's hyper-parameters; raises for torch's optimizers whose update depends on a parameter's shape."""
    if isinstance(opt, _refused()):
        raise ValueError(
            f"zero=2/3 steps flat slices of the parameters, so {type(opt).__name__} (its update depends on each"
            " parameter's shape) would compute a different update; use an element-wise optimizer (SGD, Adam,"
            " AdamW, ...) or zero<=1."
        )
    if opt.state:
        raise RuntimeError("zero=2/3 must rebuild the optimizer before its first step (it already holds state).")
    new_groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": params}
                  for g, params in zip(opt.param_groups, groups)]
    return type(opt)(new_groups, **optimizer_defaults(type(opt), opt.defaults))
