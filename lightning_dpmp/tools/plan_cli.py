"""``python -m lightning_dpmp.plan``: rank every layout of a model on a cluster before launch, by predicted throughput.

The model is a transformers ``config.json`` (or its folder), or ``module:function`` returning a LightningModule
(or ``(module, batch)``); it is built on the meta device and one forward of its training step is profiled
(:mod:`lightning_dpmp.tools.profile`), then every layout is predicted (:mod:`lightning_dpmp.tools.estimate`)::

    python -m lightning_dpmp.plan --model path/to/config.json --devices 64 --gpus-per-node 8 --hardware h100 \\
        --seq 2048 --global-batch 512 --precision bf16-mixed
    python -m lightning_dpmp.plan --model my_pkg.models:build --devices 4 --hardware cpu --format json

A ``module:function`` LightningModule is run as ``training_step(batch, 0)`` on its ``example_input_array`` (or on
the batch the function returns beside it); its sequence length and batch come from that batch's token tensor.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from lightning_dpmp.compat import tree_map
from lightning_dpmp.tools.estimate import DEVICES, PRECISIONS, Estimate, estimate
from lightning_dpmp.tools.profile import ModelProfile, config_sizes, profile_config, profile_step, token_tensor

__all__ = ["explain", "format_table", "load_profile", "main"]

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}


def _import(target: str) -> Any:
    """``pkg.mod:fn`` or ``path/to/file.py:fn``."""
    mod_name, _, fn = target.rpartition(":")
    if mod_name.endswith(".py"):
        spec = importlib.util.spec_from_file_location(Path(mod_name).stem, mod_name)
        if spec is None or spec.loader is None:
            raise ValueError(f"--model {target!r}: cannot load {mod_name}")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    else:
        mod = importlib.import_module(mod_name)
    if not hasattr(mod, fn):
        raise ValueError(f"--model {target!r}: {mod_name} has no {fn!r}")
    return getattr(mod, fn)


def _profile_module(target: str, dtype: torch.dtype) -> ModelProfile:
    from torch import nn

    from lightning_dpmp.tools.costmodel import GPTShape

    with torch.device("meta"):
        made = _import(target)()
        module, batch = made if isinstance(made, tuple) else (made, getattr(made, "example_input_array", None))
        if hasattr(module, "configure_model"):
            module.configure_model()
    if batch is None:
        raise ValueError(f"--model {target!r}: the LightningModule has no example_input_array; return "
                         "(module, batch) from the function instead")
    module.to(device="meta", dtype=dtype)
    # every tensor of the batch on meta, same shape and dtype: nothing is allocated, token ids read as zeros
    batch = tree_map(lambda t: torch.zeros(t.shape, dtype=t.dtype, device="meta") if isinstance(t, torch.Tensor)
                     else t, batch)
    ids = token_tensor(batch)
    cfg = next((m.config for m in module.modules() if hasattr(getattr(m, "config", None), "to_dict")), None)
    if cfg is not None:
        vocab, hidden, heads, kv, ffn = config_sizes(cfg)
    else:
        shape = GPTShape.from_module(module, seq=ids.shape[1], batch=ids.shape[0])
        vocab, hidden, heads, kv, ffn = shape.vocab, shape.hidden, shape.heads, shape.heads, shape.ffn_width
    step = (lambda: module.training_step(batch, 0)) if hasattr(module, "training_step") else (lambda: module(batch))
    if not isinstance(module, nn.Module):
        raise ValueError(f"--model {target!r} returned {type(module).__name__}, not a LightningModule")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log without a Trainer
        return profile_step(module, step, vocab, hidden, ids.shape[1], ids.shape[0], heads=heads, kv_heads=kv,
                            ffn=ffn)


def load_profile(model: str, seq: Optional[int], precision: str) -> ModelProfile:
    """The profile of ``--model``: a config path (at ``seq``) or ``module:function`` (at its batch's length)."""
    dtype = _DTYPES[PRECISIONS[precision][0]]
    path = Path(model)
    if path.is_dir() or path.suffix == ".json" or path.exists():
        if seq is None:
            raise ValueError("--seq is required with a transformers config")
        return profile_config(path, seq, dtype=dtype)
    if ":" not in model:
        raise ValueError(f"--model {model!r}: neither a config.json / folder that exists nor module:function")
    prof = _profile_module(model, dtype)
    return prof if seq is None or seq == prof.seq else prof.at_seq(seq)


def format_table(rows: Sequence[Estimate], top: int) -> str:
    """A markdown table of the ``top`` fastest layouts that fit, then the fastest ones that do not."""
    head = ("| dp | pp | mp | zero | SP | micro | schedule | recompute | fits | peak GiB | step s | tokens/s | MFU "
            "| |\n"
            "|---:|---:|---:|---:|---|---:|---|---|---|---:|---:|---:|---:|---|")
    fit = [r for r in rows if r.fits][:top]
    nofit = [r for r in rows if not r.fits][:max(3, top // 5)]
    lines = [head]
    for r in fit + nofit:
        lines.append(f"| {r.dp} | {r.pp} | {r.mp} | {r.zero} | {'yes' if r.sequence_parallel else ''} | "
                     f"{r.microbatches} | {r.schedule} | {'yes' if r.recompute else ''} | "
                     f"{'yes' if r.fits else '**no**'} | {r.peak_mem_gib:.2f} | {r.step_s:.4g} | "
                     f"{r.tokens_per_s:,.0f} | {r.mfu:.1%} | {'**chosen**' if r.chosen else ''} |")
    return "\n".join(lines)


def explain(rows: Sequence[Estimate], memory_gib: float) -> str:
    """One line: why the chosen layout wins."""
    best = next((r for r in rows if r.chosen), None)
    if best is None:
        low = min(rows, key=lambda r: r.peak_mem_gib) if rows else None
        return ("no layout fits" + (f": the smallest peak is {low.peak_mem_gib:.2f} GiB at (dp, pp, mp) = "
                                    f"({low.dp}, {low.pp}, {low.mp}), zero={low.zero}, recompute={low.recompute}, "
                                    f"against {memory_gib:.2f} GiB per device" if low else ""))
    nxt = next((r for r in rows if r.fits and not r.chosen and (r.dp, r.pp, r.mp) != (best.dp, best.pp, best.mp)),
               None)
    t = best.time or {}
    parts = ", ".join(f"{k} {v / best.step_s:.0%}" for k, v in t.items() if v > 0.005 * best.step_s)
    vs = (f"{nxt.step_s / best.step_s:.2f}x faster than the best other (dp, pp, mp) = ({nxt.dp}, {nxt.pp}, "
          f"{nxt.mp}); " if nxt else "")
    return (f"chosen (dp, pp, mp) = ({best.dp}, {best.pp}, {best.mp}), zero={best.zero}, "
            f"{best.microbatches} micro-batches{', ' + best.schedule if best.pp > 1 else ''}"
            f"{', recompute' if best.recompute else ''}{', sequence parallel' if best.sequence_parallel else ''}: "
            f"the fastest that fits, {vs}peak {best.peak_mem_gib:.2f} of {memory_gib:.2f} GiB; step = {parts}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lightning_dpmp.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="config.json, its folder, or module:function")
    p.add_argument("--devices", type=int, required=True, help="devices in all (the world size)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="devices per node (default: the preset's)")
    p.add_argument("--hardware", default="h100", choices=sorted(DEVICES))
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the batch's, module only)")
    p.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step, all DP ranks")
    p.add_argument("--precision", default="bf16-mixed", choices=sorted(PRECISIONS))
    p.add_argument("--format", default="table", choices=("table", "json"))
    p.add_argument("--top", type=int, default=15, help="table: rows of fitting layouts shown")
    a = p.parse_args(argv)
    if a.devices < 1 or a.global_batch < 1:
        p.error(f"--devices {a.devices} and --global-batch {a.global_batch} must be positive")
    dev = DEVICES[a.hardware]
    if a.gpus_per_node is not None:
        dev = replace(dev, devices_per_node=a.gpus_per_node)
    try:
        prof = load_profile(a.model, a.seq, a.precision)
    except (ValueError, OSError, ImportError) as e:
        p.error(str(e))
    rows = estimate(prof, dev, a.devices, a.global_batch, a.precision)
    if not rows:
        p.error(f"no layout of {a.devices} devices divides this model (heads {prof.heads}, kv heads "
                f"{prof.kv_heads}, ffn {prof.ffn}, {prof.layers} blocks) and global batch {a.global_batch}")
    if a.format == "json":
        json.dump([r.row() for r in rows], sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    print(f"{prof.params:,} parameters, {prof.layers} blocks, seq {prof.seq}, global batch {a.global_batch}, "
          f"{a.devices} x {dev.name} ({dev.devices_per_node} per node), {a.precision}: {len(rows)} layouts, "
          f"{sum(r.fits for r in rows)} fit")
    print(format_table(rows, a.top))
    print(explain(rows, dev.memory_gib))
    return 0
