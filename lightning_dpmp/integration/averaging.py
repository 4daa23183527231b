"""Weight-averaging callbacks on the split model: ``StochasticWeightAveraging`` and ``WeightAveraging`` (EMA).

Both copy the LightningModule in their ``setup`` hook, before :class:`~lightning_dpmp.DPMPStrategy` splits it, then
average parameters by position (``zip(average.parameters(), model.parameters())``) and write the average back the
same way. Averaging is element-wise, so it is exact on MP shards: :func:`split_averaging_callbacks` replaces the
copy's tensors with clones of this rank's shards (same names, same order, checked), after which Lightning's own
code runs unchanged, every rank averaging its own slices.

What remains is the checkpoint, where an averaged copy must look as it would on one process:

* ``StochasticWeightAveraging`` keeps the copy's ``state_dict`` in its callback state: gathered to dense (on the
  ranks that write a consolidated file) when saved, sliced when loaded.
* ``WeightAveraging`` swaps it into the checkpoint's ``state_dict`` (the dense model goes to
  ``current_model_state``): that entry is gathered when saved, and both are sliced before it loads them.

Sharded checkpoints (``save_distributed_checkpoint=True``) and zero=3 are refused with the reason, before launch
(:func:`~lightning_dpmp.integration.validate.check_averaging_callbacks`).

Example:
    >>> adapted = split_averaging_callbacks(trainer.callbacks, lightning_module, grid, gathers=True)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

from torch import Tensor, nn
from torch.distributed.tensor import DTensor

import lightning_dpmp.compat as compat
from lightning_dpmp.checkpoint.consolidated import gather_state_dict, shard_state_dict
from lightning_dpmp.parallel.dtensor_params import local_tensor
from lightning_dpmp.parallel.sharding import shard_blocks, shard_dims

__all__ = ["averaging_callbacks", "split_averaging_callbacks"]


def averaging_callbacks(callbacks: Any) -> list[Any]:
    """The ``StochasticWeightAveraging`` and ``WeightAveraging`` callbacks among ``callbacks``."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging
    from lightning.pytorch.callbacks.weight_averaging import WeightAveraging

    return [cb for cb in callbacks or [] if isinstance(cb, (StochasticWeightAveraging, WeightAveraging))]


def _same_order(copy: nn.Module, module: nn.Module, what: str) -> None:
    mine = [n for n, _ in getattr(copy, f"named_{what}")()]
    theirs = [n for n, _ in getattr(module, f"named_{what}")()]
    if mine != theirs:
        first = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
        raise ValueError(
            f"DPMPStrategy cannot split the averaged copy of the model: its {what} differ from the split model's"
            f" from position {first} ({mine[first:first + 2]} vs {theirs[first:first + 2]}); the callback pairs them"
            " by position. Build every layer in __init__ (not configure_model) when using weight averaging."
        )


def _take_shards(copy: nn.Module, module: nn.Module) -> None:
    """Point the copy's parameters and buffers at clones of ``module``'s (this rank's shards), on the copy's devices
    and in its dtypes: the callbacks copy before the precision plugin converts the model (a float32 copy of a
    ``64-true`` model averages in float32 on one process too). A DTensor parameter's copy is a DTensor with its
    placements, so the callbacks' element-wise averaging runs on the local shards and its averaged model reads as
    the dense one."""
    for what in ("parameters", "buffers"):
        _same_order(copy, module, what)
    replaced: dict[int, nn.Parameter] = {}
    for mine, theirs in zip(copy.parameters(), module.parameters()):
        clone = theirs.detach().to(device=mine.device, dtype=mine.dtype).clone()
        if isinstance(clone, DTensor):  # a plain Parameter cannot take DTensor data: a new one, ties kept
            replaced[id(mine)] = nn.Parameter(clone, requires_grad=mine.requires_grad)
        else:
            mine.data = clone
    for mod in copy.modules():
        for key, p in list(compat.own_parameters(mod).items()):
            if p is not None and id(p) in replaced:
                compat.own_parameters(mod)[key] = replaced[id(p)]
    for mine_b, theirs_b in zip(copy.buffers(), module.buffers()):
        mine_b.data = theirs_b.detach().to(device=mine_b.device, dtype=mine_b.dtype).clone()


class _Split:
    """What :func:`split_averaging_callbacks` needs to turn one callback's states dense and back."""

    def __init__(self, module: nn.Module, grid: Any, gathers: bool) -> None:
        self.dims, self.blocks = shard_dims(module), shard_blocks(module)
        self.group, self.gathers = grid.mp_group, gathers
        state = module.state_dict()
        self.local = {k: tuple(local_tensor(v).shape) for k, v in state.items() if isinstance(v, Tensor)}
        # DTensor parameters: what a sliced entry is wrapped into, so that it loads into them
        self.specs = {k: v for k, v in state.items() if isinstance(v, DTensor)}

    def dense(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """Collective over the MP group: dense on the ranks that write the file, unchanged elsewhere (this rank's
        local shards there, DTensors or not)."""
        state = {k: local_tensor(v) if isinstance(v, Tensor) else v for k, v in state.items()}
        if not self.gathers:
            return state
        return gather_state_dict(state, {k: d for k, d in self.dims.items() if k in state}, self.group, self.blocks)

    def sliced(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """This rank's slices of a dense state (entries already local are left alone), as DTensors where the module
        holds DTensor parameters."""
        state = {k: local_tensor(v) if isinstance(v, Tensor) else v for k, v in state.items()}
        dense_keys = {k: d for k, d in self.dims.items()
                      if isinstance(state.get(k), Tensor) and tuple(state[k].shape) != self.local.get(k)}
        out = shard_state_dict(state, dense_keys, self.group, self.blocks)
        for k, spec in self.specs.items():
            if isinstance(out.get(k), Tensor):
                out[k] = DTensor.from_local(out[k], spec.device_mesh, spec.placements, run_check=False,
                                            shape=spec.shape, stride=spec.stride())
        return out


def split_averaging_callbacks(callbacks: Any, module: nn.Module, grid: Any, gathers: bool) -> list[Any]:
    """Make every averaging callback among ``callbacks`` average this rank's shards of ``module`` (after the split,
    on every rank alike); returns the callbacks adapted. The cases it cannot make exact (zero=3, sharded
    checkpoints) were refused before, by :func:`lightning_dpmp.integration.validate.check_averaging_callbacks`.

    Args:
        gathers: whether this rank writes consolidated checkpoints (it gathers the averaged copy when saving).
    """
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    found = averaging_callbacks(callbacks)
    if not found or not shard_dims(module):
        return []
    split = _Split(module, grid, gathers)
    for cb in found:
        copy = compat.averaged_copy(cb)
        if copy is None:
            continue
        _take_shards(copy, module)
        if isinstance(cb, StochasticWeightAveraging):
            _wrap_swa(cb, split)
        else:
            _wrap_weight_averaging(cb, split)
    return found


def _wrap_swa(cb: Any, split: _Split) -> None:
    state_dict: Callable[[], dict[str, Any]] = cb.state_dict
    load_state_dict: Callable[[dict[str, Any]], None] = cb.load_state_dict

    def dense_state() -> dict[str, Any]:
        state = state_dict()
        if state.get("average_model_state") is not None:
            state["average_model_state"] = split.dense(state["average_model_state"])
        return state

    def load_sliced(state: dict[str, Any]) -> None:
        if state.get("average_model_state") is not None:
            state = {**state, "average_model_state": split.sliced(state["average_model_state"])}
        load_state_dict(state)

    cb.state_dict, cb.load_state_dict = dense_state, load_sliced


def _wrap_weight_averaging(cb: Any, split: _Split) -> None:
    on_save: Callable[..., None] = cb.on_save_checkpoint
    on_load: Callable[..., None] = cb.on_load_checkpoint

    def save_dense(trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        replaced = compat.averaged_copy(cb) is not None  # it swaps its copy into "state_dict" only while it has one
        on_save(trainer, pl_module, checkpoint)
        if replaced:
            checkpoint["state_dict"] = split.dense(checkpoint["state_dict"])

    def load_sliced(trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        sliced = dict(checkpoint)
        for key in ("state_dict", "current_model_state"):
            if isinstance(checkpoint.get(key), Mapping):
                sliced[key] = split.sliced(checkpoint[key])
        on_load(trainer, pl_module, sliced)

    cb.on_save_checkpoint, cb.on_load_checkpoint = save_dense, load_sliced
