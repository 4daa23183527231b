"""An analytic cost model for (dp, mp) layouts of a GPT-like transformer, and a recommended layout.

The command line (``python -m lightning_dpmp.costmodel``): preset model shapes (``MODELS``), the markdown table of
predictions (:func:`format_table`) and :func:`main`. The model itself is :mod:`lightning_dpmp.tools.costmodel`.
"""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

from lightning_dpmp.tools.costmodel import GPTShape, Hardware, Layout, recommend

__all__ = ["MODELS", "format_table", "main"]


def _si(x: float, unit: str) -> str:
    for div, p in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.1f} {p}{unit}"
    return f"{x:.0f} {unit}"


def format_table(table: Sequence[Layout], best: Optional[Layout]) -> str:
    """A markdown table of the predictions, the recommended row marked."""
    rows = ["| dp x mp | step s | compute s | MP comm s | DP comm s (exposed) | optim s | MP bytes/step | "
            "DP bytes/step | memory/rank GiB | tokens/s | |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for t in table:
        mark = "**recommended**" if best is not None and (t.dp, t.mp) == (best.dp, best.mp) else "; ".join(t.notes)
        rows.append(
            f"| {t.dp} x {t.mp} | {t.step_s:.3g} | {t.compute_s:.3g} | {t.mp_comm_s:.3g} | {t.dp_comm_s:.3g} "
            f"({t.dp_exposed_s:.3g}) | {t.optimizer_s:.3g} | {_si(t.mp_bytes, 'B')} | {_si(t.dp_bytes, 'B')} | "
            f"{t.memory_bytes / 2**30:.1f} | {_si(t.tokens_per_s, '')} | {mark} |"
        )
    return "\n".join(rows)


MODELS: dict[str, dict[str, int]] = {
    # GPT-3 XL-like 1.3B (24 x 2048, 16 heads) and 6.7B (32 x 4096, 32 heads); vocab padded to 50304 (GPT-2 BPE
    # 50257 rounded up to a multiple of 128) so that it splits evenly; 2048 tokens; 1M / 2M tokens per batch.
    "gpt-1.3b": dict(layers=24, hidden=2048, heads=16, vocab=50304, seq=2048, batch=512, micro_batch=1),
    "gpt-7b": dict(layers=32, hidden=4096, heads=32, vocab=50304, seq=2048, batch=1024, micro_batch=1),
}


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Command line: print every layout's prediction and the recommended one."""
    p = argparse.ArgumentParser(prog="python -m lightning_dpmp.costmodel", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), help="a preset shape (fields below override it)")
    for name in ("layers", "hidden", "heads", "vocab", "seq", "batch", "ffn", "micro-batch"):
        p.add_argument(f"--{name}", type=int, help=f"model {name.replace('-', '_')}")
    p.add_argument("--act-bytes", type=int, default=2, help="bytes per activation (2 bf16, 4 fp32)")
    p.add_argument("--grad-bytes", type=int, default=2, help="bytes per gradient element sent over DP")
    p.add_argument("--recompute", action="store_true", help="full activation recomputation")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--hardware", default="dgx-a100", help="preset: dgx-a100 or dgx-h100 (fields below override it)")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--devices-per-node", type=int)
    p.add_argument("--memory-gb", type=float, help="memory per device, GiB")
    p.add_argument("--tflops", type=float, help="effective TFLOP/s per device")
    p.add_argument("--intra-gbps", type=float, help="intra-node bandwidth per device, GB/s")
    p.add_argument("--inter-gbps", type=float, help="inter-node bandwidth per device, GB/s")
    a = p.parse_args(argv)
    fields = dict(MODELS.get(a.model, {})) if a.model else {}
    for name in ("layers", "hidden", "heads", "vocab", "seq", "batch", "ffn", "micro_batch"):
        if getattr(a, name) is not None:
            fields[name] = getattr(a, name)
    missing = [k for k in ("layers", "hidden", "heads", "vocab", "seq", "batch") if k not in fields]
    if missing:
        p.error(f"give --model or all of: {', '.join('--' + m for m in missing)}")
    shape = GPTShape(**fields, act_bytes=a.act_bytes, grad_bytes=a.grad_bytes, recompute=a.recompute)  # type: ignore[arg-type]
    over: dict[str, float] = {}
    if a.devices_per_node:
        over["devices_per_node"] = a.devices_per_node
    if a.memory_gb:
        over["memory_gb"] = a.memory_gb
    if a.tflops:
        over["flops"] = a.tflops * 1e12
    if a.intra_gbps:
        over["intra_bw"] = a.intra_gbps * 1e9
    if a.inter_gbps:
        over["inter_bw"] = a.inter_gbps * 1e9
    hw = Hardware.preset(a.hardware, a.devices, **over)
    best, table = recommend(shape, hw, a.sequence_parallel)
    print(f"{shape.params / 1e9:.2f}B parameters ({shape.layers} x {shape.hidden}, {shape.heads} heads, "
          f"vocab {shape.vocab}), seq {shape.seq}, batch {shape.batch} x micro-batch {shape.micro_batch or 'all'}; "
          f"{hw.devices} devices, {hw.devices_per_node}/node, {hw.memory_gb:g} GiB, {hw.flops / 1e12:g} TFLOP/s, "
          f"intra {hw.intra_bw / 1e9:g} GB/s, inter {hw.inter_bw / 1e9:g} GB/s")
    print(format_table(table, best))
    print(f"recommended: DPMPStrategy(dp={best.dp}, mp={best.mp})" if best else "no layout fits in memory")


if __name__ == "__main__":
    main()
