"""Pretrained Hugging Face models in: built with their parameters on the meta device, then each rank reads only its
own slices of the safetensors files once the strategy has split the model.

:func:`from_pretrained` is the entry point, usable in a LightningModule's ``__init__`` or ``configure_model``. When
the model will be split by :class:`~lightning_dpmp.DPMPStrategy` (inside its ``configure_model`` /
``init_module`` contexts, or once a DPMPStrategy exists in the process), it returns the model with its weights
pending: shapes on meta, buffers computed, config and generation config loaded, in eval mode as transformers
returns it. After the split each rank reads its shards and the replicated tensors
(:mod:`lightning_dpmp.checkpoint.weights`); the dense model never exists on any rank. Otherwise (one device, another
strategy) it is transformers' own ``model_class.from_pretrained``.

Example:
    >>> from transformers import LlamaForCausalLM                            # doctest: +SKIP
    >>> class FineTune(L.LightningModule):                                   # doctest: +SKIP
    ...     def __init__(self, path):
    ...         super().__init__()
    ...         self.net = lightning_dpmp.from_pretrained(LlamaForCausalLM, path)
"""

from __future__ import annotations

import os
import re
from typing import Any, Optional

import torch
from torch import nn

import lightning_dpmp.compat as compat
from lightning_dpmp.checkpoint.weights import (
    ConvertedWeights,
    WeightFiles,
    defer_weights,
    loading_deferred,
    match_keys,
)
from lightning_dpmp.planner.materialize import empty_parameters

__all__ = ["converted_view", "from_pretrained", "load_weights"]

_BUILD_KWARGS = ("attn_implementation", "experts_implementation")  # to the construction, as from_pretrained does


def from_pretrained(model_class: Any, path: str, *, lazy: Optional[bool] = None, **kwargs: Any) -> nn.Module:
    """``model_class.from_pretrained(path, **kwargs)``, read slice by slice when the model is going to be split.

    Args:
        model_class: a transformers model class (``LlamaForCausalLM``) or an ``Auto*`` class.
        path: a local folder written by ``save_pretrained`` (one ``model.safetensors`` or a sharded index).
        lazy: ``True``: always return the model with pending weights (meta parameters); ``False``: always load now
            with transformers; ``None`` (default): lazy exactly when a DPMPStrategy will split it (inside its
            ``configure_model`` / ``init_module`` contexts, or when one has been created in this process: create
            the Trainer before the model, or call this in ``configure_model``).
        kwargs: ``config``, ``dtype`` (or ``torch_dtype``; ``"auto"`` by default: the config's dtype) and
            ``attn_implementation``, ``experts_implementation``; on the non-lazy path anything ``from_pretrained``
            takes. Checkpoints in a layout transformers converts on load (Mixtral's per-expert files) are read as
            it reads them.

    Raises:
        TypeError: a keyword the lazy path does not implement (named), rather than ignoring it.
        FileNotFoundError: no safetensors weights under ``path``.
    """
    if not (loading_deferred() if lazy is None else lazy):
        return model_class.from_pretrained(path, **kwargs)
    from transformers import AutoConfig, GenerationConfig

    config = kwargs.pop("config", None) or AutoConfig.from_pretrained(path)
    dtype = kwargs.pop("dtype", None) or kwargs.pop("torch_dtype", None) or "auto"
    if dtype == "auto":
        dtype = getattr(config, "dtype", None) or torch.float32
    build = {k: kwargs.pop(k) for k in _BUILD_KWARGS if k in kwargs}
    if kwargs:
        raise TypeError(
            f"lightning_dpmp.from_pretrained (reading slices after the split) does not take {sorted(kwargs)}; pass"
            " lazy=False to load the whole model with transformers instead.")
    with empty_parameters():
        model = compat.hf_model_from_config(model_class, config, dtype=dtype, **build)
    _keep_in_dtype_plan(model, dtype)
    if os.path.exists(os.path.join(path, "generation_config.json")) and getattr(model, "can_generate", lambda: 0)():
        model.generation_config = GenerationConfig.from_pretrained(path)
    model.eval()  # as transformers returns it (Lightning keeps submodules in the mode it finds them)
    compat.keep_adapters_off_meta()  # adapters added next (peft) keep their initial values
    return defer_weights(model, path, strict=True, prefix=getattr(model, "base_model_prefix", None) or None,
                         convert=lambda files: converted_view(model, files))


def converted_view(model: nn.Module, files: WeightFiles) -> Optional[ConvertedWeights]:
    """``files`` under ``model``'s names where transformers would convert them on load (per-expert tensors stacked,
    renamed prefixes): the conversions are transformers' own for the model (``compat.hf_checkpoint_conversion``),
    so every architecture it converts is read as ``from_pretrained`` reads it. ``None`` when nothing converts."""
    conversion = compat.hf_checkpoint_conversion(model, files.keys())
    if conversion is None:
        return None
    renamed, groups = conversion
    return ConvertedWeights(files, renamed, groups)


def _keep_in_dtype_plan(model: nn.Module, dtype: Any) -> None:
    """The parameters transformers' loading keeps in float32 under a float16/bfloat16 ``dtype`` (T5's ``wo``), cast
    on meta as ``from_pretrained`` casts them (the same glob search); the same parameter objects, so ties hold."""
    dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype  # a config may say "float16"
    plan = compat.hf_dtype_plan(model, dtype) if isinstance(dtype, torch.dtype) else {}
    if not plan:
        return
    globs = [(re.compile(g.replace("*", ".*")), d) for g, d in plan.items()]
    for name, p in model.named_parameters():
        hit = next((d for pattern, d in globs if pattern.search(name)), None)
        if hit is not None and p.dtype != hit:
            p.data = p.data.to(hit)


def load_weights(module: nn.Module, path: str, strict: bool = True, prefix: Optional[str] = None) -> nn.Module:
    """Initial weights for ``module`` from ``path`` (a ``save_pretrained`` folder, a ``.safetensors`` file, or a
    Lightning checkpoint of the plain model): read slice by slice after the split when ``module``'s parameters are
    on the meta device (built under ``trainer.init_module(empty_init=True)``), loaded whole now otherwise.

    ``prefix``: a leading name the checkpoint's keys carry or lack (``"net"`` for a LightningModule's checkpoint
    loaded into its ``self.net``). Returns ``module``.

    Example:
        >>> with trainer.init_module(empty_init=True):                         # doctest: +SKIP
        ...     model = lightning_dpmp.load_weights(MyModel(), "plain-model.ckpt")
    """
    if any(p.is_meta for p in module.parameters()):
        compat.keep_adapters_off_meta()  # adapters added next (peft) keep their initial values
        return defer_weights(module, path, strict, prefix)
    files = WeightFiles(path)
    names = match_keys(module, files.keys(), prefix)
    module.load_state_dict({k: files.read(n) for k, n in names.items()}, strict=strict)
    return module
