"""Convert checkpoints: a sharded folder into one consolidated file that the plain model loads, or either format
into a Hugging Face folder (safetensors + config) that transformers' ``from_pretrained`` loads.

The consolidated output is an ordinary Lightning checkpoint (dense ``state_dict`` under the model's own names,
dense optimizer state, loops, schedulers, hyper-parameters), readable with ``torch.load(..., weights_only=True)``
and ``model.load_state_dict(..., strict=True)`` without this package, and resumable with
``Trainer.fit(ckpt_path=...)`` under any strategy. It runs in one process without a process group and holds the
whole state in memory.

The Hugging Face output (``--hf --config BASE_DIR``) takes the architecture and config from ``BASE_DIR`` (the
folder the fine-tuning started from), finds the transformers model's tensors inside the Lightning
``state_dict`` (under the attribute that holds it, e.g. ``net.``), and streams them into safetensors files one
tensor at a time: a consolidated file is memory-mapped, so it never sits in memory whole (a sharded folder is
read whole first).

Example:
    >>> convert("checkpoints/last.ckpt", "last-consolidated.ckpt")   # doctest: +SKIP
    {'tensors': 18, 'parameters': 2499, 'optimizer_states': 1}
    >>> convert_hf("last.ckpt", "finetuned/", "pretrained/")          # doctest: +SKIP
    {'files': 1, 'tensors': 21, 'bytes': 181504, 'prefix': 'net.'}

Command line::

    python -m lightning_dpmp.checkpoint.convert SHARDED_DIR OUT.ckpt
    python -m lightning_dpmp.checkpoint.convert CKPT OUT_DIR --hf --config BASE_DIR [--prefix net.]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from typing import Any, Optional, Union

from torch import Tensor

import lightning_dpmp.compat as compat
from lightning_dpmp.checkpoint.files import atomic_save, load_file
from lightning_dpmp.checkpoint.hf_export import (
    TensorEntry,
    floating_dtype,
    state_entries,
    write_config,
    write_streamed,
)
from lightning_dpmp.checkpoint.sharded import is_sharded_checkpoint, load_sharded_full
from lightning_dpmp.planner.materialize import empty_parameters

__all__ = ["convert", "convert_hf", "find_prefix", "main"]


def convert(sharded_dir: str, out_path: str) -> dict[str, Any]:
    """Write the consolidated form of ``sharded_dir`` to ``out_path`` (atomically) and return a short summary."""
    checkpoint = load_sharded_full(str(sharded_dir))
    if isinstance(checkpoint.get("dpmp"), dict):
        checkpoint["dpmp"]["format"] = "consolidated"
    atomic_save(checkpoint, str(out_path))
    tensors = [v for v in checkpoint["state_dict"].values() if isinstance(v, Tensor)]
    return {
        "tensors": len(tensors),
        "parameters": sum(t.numel() for t in tensors),
        "optimizer_states": len(checkpoint.get("optimizer_states", [])),
    }


def find_prefix(names: list[str], wanted: list[str]) -> str:
    """The leading name (``"net."``) under which every key of ``wanted`` appears in ``names``.

    Raises ``KeyError`` naming the first wanted key found under no common prefix.

    Example:
        >>> find_prefix(["net.lm_head.weight", "net.model.norm.weight", "step"], ["model.norm.weight"])
        'net.'
    """
    available = set(names)
    first = wanted[0]
    candidates = [n[: len(n) - len(first)] for n in names
                  if n.endswith(first) and (len(n) == len(first) or n[len(n) - len(first) - 1] == ".")]
    for prefix in candidates:
        if all(prefix + k in available for k in wanted):
            return prefix
    found = max(candidates, key=lambda p: sum(p + k in available for k in wanted), default="")
    missing = next(k for k in wanted if found + k not in available)
    raise KeyError(f"the checkpoint has no {found + missing!r} (looked for the model's tensors under"
                   f" {found!r}); pass --prefix.")


def convert_hf(checkpoint: str, out_dir: str, config_dir: str, prefix: Optional[str] = None,
               max_shard_size: Union[int, str] = "5GB") -> dict[str, Any]:
    """Write the transformers model inside a Lightning checkpoint (consolidated file or sharded folder) as a
    Hugging Face folder under ``out_dir``, with the config (and generation config) of ``config_dir``."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(config_dir)
    archs = getattr(config, "architectures", None) or []
    model_class = getattr(transformers, archs[0], None) if archs else None
    if model_class is None:
        raise ValueError(f"{config_dir}/config.json names no transformers architecture ({archs!r}).")
    with empty_parameters():  # the model's names, shapes and ties; no memory
        skeleton = compat.hf_model_from_config(model_class, config)
    ckpt = load_sharded_full(checkpoint) if is_sharded_checkpoint(checkpoint) else load_file(checkpoint)
    state: Mapping[str, Any] = ckpt.get("state_dict", ckpt)
    wanted = skeleton.state_dict(keep_vars=True)
    prefix = find_prefix(list(state), list(wanted)) if prefix is None else prefix
    shapes = {k: tuple(wanted[k].shape) for k in wanted}
    for k, shape in shapes.items():
        if prefix + k not in state:
            raise KeyError(f"{checkpoint} has no {prefix + k!r}.")
        if tuple(state[prefix + k].shape) != shape:
            raise ValueError(f"{prefix + k!r} has shape {tuple(state[prefix + k].shape)} in {checkpoint} but"
                             f" {shape} in the {archs[0]} of {config_dir}.")
    entries = [TensorEntry(e.name, e.shape, state[prefix + e.name].dtype) for e in state_entries(wanted, shapes)]
    summary = write_streamed(out_dir, entries, lambda e: state[prefix + e.name], max_shard_size)
    generation = None
    if os.path.exists(os.path.join(config_dir, "generation_config.json")):
        generation = transformers.GenerationConfig.from_pretrained(config_dir)
    write_config(out_dir, config, floating_dtype(e.dtype for e in entries), [generation])
    return {**summary, "prefix": prefix}


def main(argv: Optional[list[str]] = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_dpmp.convert",
        description="Convert a sharded DPMPStrategy checkpoint folder into one consolidated .ckpt file, or either"
                    " format into a Hugging Face folder (--hf).",
    )
    parser.add_argument("checkpoint", help="a sharded checkpoint folder (or, with --hf, a consolidated .ckpt too)")
    parser.add_argument("out", help="consolidated checkpoint file to write (with --hf: the folder to write)")
    parser.add_argument("--hf", action="store_true", help="write safetensors + config for transformers")
    parser.add_argument("--config", help="with --hf: the Hugging Face folder the model was loaded from")
    parser.add_argument("--prefix", help="with --hf: the name the model has in the LightningModule, e.g. 'net.'")
    parser.add_argument("--max-shard-size", default="5GB", help="with --hf: split the safetensors above this")
    args = parser.parse_args(argv)
    if args.hf and not args.config:
        parser.error("--hf needs --config BASE_DIR (the folder with the model's config.json)")
    try:
        if args.hf:
            summary = convert_hf(args.checkpoint, args.out, args.config, args.prefix, args.max_shard_size)
            print(f"wrote {args.out}: {summary['tensors']} tensors in {summary['files']} safetensors file(s),"
                  f" {summary['bytes']:,} bytes (model found under {summary['prefix']!r})")
            return 0
        summary = convert(args.checkpoint, args.out)
    except (FileNotFoundError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(
        f"wrote {args.out}: {summary['tensors']} tensors, {summary['parameters']:,} model values,"
        f" {summary['optimizer_states']} optimizer state(s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
