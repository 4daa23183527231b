"""Models bigger than one process: build with parameters on the meta device, split, then allocate only this rank's
shards.

With ``Trainer.init_module(empty_init=True)`` (or :func:`lightning_dpmp.from_pretrained`) the dense model is built
under :func:`empty_parameters`: every *parameter* goes to the ``meta`` device (shapes, no memory) the moment it is
registered, while *buffers* are computed for real on the current device. Computed buffers (rotary embeddings'
``inv_freq``, causal masks, position ids) therefore hold their values, which no re-initialisation could recover.
The plan is traced on meta tensors, the layers are split (still meta), and only then does each rank allocate and
initialise what it holds.

Initialisation, per module, under a generator seeded from the global seed and the module's name (and, for split
layers, the MP rank), so replicated parameters are equal on every rank, shards differ across MP ranks, and DP
replicas agree:

- a transformers model's own ``_init_weights(module)`` where the module lies inside a ``PreTrainedModel`` (RMSNorm
  to ones, Linear to ``normal(0, initializer_range)``, rotary buffers rebuilt); split layers are handed to it as an
  ``nn.Linear`` over their shards, so they get the distribution the dense layer would;
- else the module's ``reset_parameters()`` (torch's defaults; the split layers use the *dense* fan-in);
- else a clear error naming the module.

The values are not those of a single-process run (those would need the dense tensors this path exists to avoid):
load weights to get those (:func:`lightning_dpmp.from_pretrained`, ``ckpt_path``). Tied parameters (an embedding
shared with the output layer) stay one parameter.

Example:
    >>> with empty_parameters():
    ...     layer = nn.Linear(4, 4)
    >>> layer.weight.is_meta
    True
    >>> materialize(layer, torch.device("cpu"), seed=0, mp_rank=0)
    20
"""

from __future__ import annotations

import sys
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, Optional

import torch
from torch import nn

import lightning_dpmp.compat as compat
from lightning_dpmp.parallel.sharding import MATERIALIZED_ATTR, ParallelLinear

__all__ = ["empty_parameters", "is_meta", "materialize"]


def is_meta(module: nn.Module) -> bool:
    """Whether any parameter of ``module`` is on the meta device."""
    return any(p.is_meta for p in module.parameters())


@contextmanager
def empty_parameters() -> Iterator[None]:
    """Build modules with every parameter on the meta device and every buffer computed for real.

    Parameters are moved to meta as they are registered (``nn.Module.register_parameter``, which attribute
    assignment goes through), so code in ``__init__`` that initialises them runs on meta tensors for free. Buffers
    are created on the current default device; under an enclosing ``torch.device("meta")`` context they go to the
    CPU instead, so that their values are computed.
    """
    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        if param is not None and not param.is_meta:
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        original(self, name, param)

    default = torch.get_default_device()
    device = torch.device("cpu") if default.type == "meta" else default
    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        with torch.device(device):
            yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _model_init(module: nn.Module) -> dict[str, Callable[[nn.Module], Any]]:
    """For each submodule name, the per-module init of its nearest enclosing transformers model, if any.

    transformers' ``PreTrainedModel._init_weights(module)`` is that library's documented contract (what its own
    meta-device loading calls for every module); a method of the same name elsewhere may mean anything (the GPT
    example's ``_init_weights(n_layer)`` re-initialises the whole model), so only a ``PreTrainedModel``'s counts.
    """
    transformers = sys.modules.get("transformers")  # no transformers model exists unless it was imported
    base = getattr(transformers, "PreTrainedModel", None) if transformers is not None else None
    found: dict[str, Callable[[nn.Module], Any]] = {}
    if base is None:
        return found
    for name, mod in module.named_modules():
        parent = name.rsplit(".", 1)[0] if "." in name else ("" if name else None)
        if isinstance(mod, base):
            found[name] = mod._init_weights
        elif parent is not None and parent in found:
            found[name] = found[parent]
    return found


def _as_linear(layer: ParallelLinear) -> nn.Linear:
    """An ``nn.Linear`` whose parameters *are* ``layer``'s shards: a model's init written for ``nn.Linear``
    initialises them in place with the dense layer's distribution."""
    proxy = nn.Linear(1, 1, bias=False, device="meta")
    proxy.weight = layer.weight
    proxy.register_parameter("bias", layer.bias)
    return proxy


@contextmanager
def _freed_after(params: list[nn.Parameter]) -> Iterator[None]:
    try:
        yield
    finally:
        for p in params:
            p.untyped_storage().resize_(0)


def materialize(module: nn.Module, device: torch.device, seed: int, mp_rank: int,
                free: frozenset = frozenset()) -> int:
    """Allocate every meta parameter/buffer of ``module`` on ``device``, move real ones there (buffers computed at
    build, adapters added to a lazily loaded model), and initialise what was allocated; returns the number of
    elements allocated. Parameters named in ``free`` (another pipeline stage's) get their storage freed right after
    their module's initialisation: shape, dtype and identity stay, and at most one module's are held at a time."""
    made = 0
    devices = [device.index or 0] if device.type == "cuda" else []
    made_params: dict[int, nn.Parameter] = {}  # one new parameter per meta parameter: ties stay tied
    model_init = _model_init(module)
    for name, mod in module.named_modules():
        fresh = False
        params, buffers = compat.own_parameters(mod), compat.own_buffers(mod)
        for key, p in list(params.items()):
            if p is not None and not p.is_meta and p.device != device:
                p.data = p.data.to(device)  # the same Parameter: ties and references stay
            if p is None or not p.is_meta:
                continue
            if id(p) not in made_params:
                made_params[id(p)] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                setattr(made_params[id(p)], MATERIALIZED_ATTR, True)
                made += p.numel()
                fresh = True
            params[key] = made_params[id(p)]
        for key, b in list(buffers.items()):
            if b is None:
                continue
            if b.is_meta:
                buffers[key] = torch.empty_like(b, device=device)
                setattr(buffers[key], MATERIALIZED_ATTR, True)
                made += b.numel()
                fresh = True
            elif b.device != device:
                buffers[key] = b.to(device)
        if not fresh:
            continue
        # a parallel layer holding only whole parameters (EnteredLinear) initialises alike on every rank
        split = isinstance(mod, ParallelLinear) and any(d is not None for d in mod._shard_dims.values())
        stream = f"{seed}:{name}:{mp_rank if split else 'replicated'}".encode()
        init = model_init.get(name)
        release = [p for k, p in params.items() if p is not None and (f"{name}.{k}" if name else k) in free]
        with _freed_after(release), torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(zlib.crc32(stream))
            if init is not None:
                init(_as_linear(mod) if isinstance(mod, ParallelLinear) else mod)
            elif hasattr(mod, "reset_parameters"):
                mod.reset_parameters()
            else:
                raise RuntimeError(
                    f"{name or type(module).__name__} ({type(mod).__name__}) was built on the meta device but has no"
                    " reset_parameters() (nor an enclosing transformers model's _init_weights) to initialise it; give"
                    " it one, or build it outside init_module(empty_init=True)."
                )
    return made
