"""Validate ``lightning_dpmp.tools.costmodel`` against a measured sweep of ``gpt_bench.py``, and print its
recommendation tables for a 1.3B and a 7B GPT on 8 and 64 GPUs.

    python benchmarks/gpt_bench.py                     # writes benchmarks/results/gpt/results.json
    python benchmarks/costmodel_check.py               # calibrates this machine, predicts, compares

Calibration (micro-benchmarks only; nothing is fitted to the sweep): the FLOP rate of one process with one thread
running the benchmark's GPT forward + backward (scaled by cores / processes, since the 4 ranks share the cores),
the memory bandwidth of an AdamW step, and the gloo all-reduce bandwidth and per-hop latency among ``--world``
processes (two sizes, solved for ``t = 2 (n-1)/n * bytes / bw + 2 (n-1) * latency``). The model then predicts
every layout of the sweep, and the error is ``predicted / measured - 1`` of the median step time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _median_time(fn: Any, repeat: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def calibrate_compute(bench: dict[str, Any]) -> tuple[float, float]:
    """(FLOP/s of one process, memory bytes/s) with one thread, on the benchmark's model and local batch."""
    import torch
    import torch.nn.functional as F

    from examples.models.gpt import GPT
    from lightning_dpmp.tools.costmodel import GPTShape

    torch.set_num_threads(1)
    a = bench["args"]
    net = GPT(vocab_size=a["vocab"], block_size=a["seq"], n_layer=a["layers"], n_head=a["heads"], n_embd=a["hidden"])
    b = 2
    x = torch.randint(0, a["vocab"], (b, a["seq"]))

    def step() -> None:
        logits = net(x)
        F.cross_entropy(logits.view(-1, logits.size(-1)), x.view(-1)).backward()

    t = _median_time(step, 5)
    shape = GPTShape(layers=a["layers"], hidden=a["hidden"], heads=a["heads"], vocab=a["vocab"], seq=a["seq"], batch=b)
    dense_flops = 6 * (a["layers"] * shape.block_params + a["vocab"] * a["hidden"])
    flops = b * a["seq"] * (dense_flops + 12 * a["layers"] * a["seq"] * a["hidden"])
    opt = torch.optim.AdamW(net.parameters())
    n = sum(p.numel() for p in net.parameters())
    t_opt = _median_time(opt.step, 5)
    return flops / t, 28 * n / t_opt


def _allreduce_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    res = {}
    groups = {world: None}
    if world >= 4:
        pairs = [dist.new_group([i, i + 1]) for i in range(0, world, 2)]
        groups[2] = pairs[rank // 2]
    for n, g in groups.items():
        for size in (2**14, 2**20):  # floats: 64 KiB and 4 MiB
            t = torch.ones(size)
            ts = []
            for _i in range(12):
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(t, group=g)
                ts.append(time.perf_counter() - t0)
            res[f"{n}_{size * 4}"] = statistics.median(ts[3:])
    if rank == 0:
        Path(out).write_text(json.dumps(res))
    dist.destroy_process_group()


def calibrate_allreduce(world: int) -> tuple[float, float]:
    """(bytes/s, seconds per ring hop) of gloo all-reduce among ``world`` processes on this machine."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = "/tmp/costmodel_allreduce.json"
    mp.spawn(_allreduce_worker, args=(world, port, out), nprocs=world, join=True)
    res = {k: v for k, v in json.loads(Path(out).read_text()).items()}
    n = world
    small, large = 2**16, 2**22
    t_s, t_l = res[f"{n}_{small}"], res[f"{n}_{large}"]
    f = 2 * (n - 1) / n
    bw = f * (large - small) / max(t_l - t_s, 1e-9)
    lat = max(0.0, (t_s - f * small / bw) / (2 * (n - 1)))
    return bw, lat


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default="benchmarks/results/gpt/results.json")
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="cores the ranks share")
    p.add_argument("--out", default="benchmarks/results/costmodel.md")
    args = p.parse_args()
    from lightning_dpmp.tools.costmodel import GPTShape, Hardware, predict, recommend
    from lightning_dpmp.tools.costmodel_cli import MODELS, format_table

    bench = json.loads(Path(args.results).read_text())
    a, rows = bench["args"], bench["rows"]
    world = a["world"]
    flops1, mem_bw = calibrate_compute(bench)
    bw, lat = calibrate_allreduce(world)
    share = min(1.0, args.cores / world)
    hw = Hardware(devices=world, devices_per_node=world, memory_gb=24, flops=flops1 * share, mem_bw=mem_bw * share,
                  intra_bw=bw, inter_bw=bw, intra_latency=lat, inter_latency=lat)
    shape = GPTShape(layers=a["layers"], hidden=a["hidden"], heads=a["heads"], vocab=a["vocab"], seq=a["seq"],
                     batch=a["global_batch"], act_bytes=4, grad_bytes=4, bytes_per_param=16)
    lines = [
        f"Calibration: {flops1 / 1e9:.2f} GFLOP/s per process alone (x {share:g} shared: {hw.flops / 1e9:.2f}), "
        f"AdamW {mem_bw / 1e9:.2f} GB/s, gloo all-reduce {bw / 1e9:.2f} GB/s + {lat * 1e6:.0f} us per hop"
        f" ({world} processes)",
        "",
        "| layout | measured step s | predicted step s | error | error after one common scale"
        " | predicted compute / MP / DP / optim s | measured MP MB | predicted MP MB | measured DP MB"
        " | predicted DP MB |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    import re

    preds = {}
    for name in rows:
        m = re.fullmatch(r"dpmp_(\d+)x(\d+)", name) or re.fullmatch(r"ddp_(\d+)()", name)
        if m:
            # On 2 shared cores nothing runs beside the backward pass: DP communication is not overlapped.
            preds[name] = predict(shape, hw, int(m.group(1)), int(m.group(2) or 1), overlap_dp=False)
    # The share of the cores the ranks actually got (other jobs run too) is unknown: one common factor, the
    # median measured/predicted ratio, separates "how fast is this machine now" from "how do layouts compare".
    scale = statistics.median(rows[n]["step_s"] / p.step_s for n, p in preds.items()) if preds else 1.0
    errors = []
    for name, r in rows.items():
        if name not in preds:
            continue
        pr = preds[name]
        err = pr.step_s / r["step_s"] - 1
        rel = pr.step_s * scale / r["step_s"] - 1
        errors.append((abs(err), abs(rel)))
        lines.append(
            f"| {name} | {r['step_s']:.3f} | {pr.step_s:.3f} | {100 * err:+.0f}% | {100 * rel:+.0f}% | "
            f"{pr.compute_s:.3f} / {pr.mp_comm_s:.3f} / {pr.dp_exposed_s:.3f} / {pr.optimizer_s:.3f} | "
            f"{r['mp_mb_per_step']:.2f} | {pr.mp_bytes / 2**20:.2f} | "
            f"{r['dp_mb_per_step']:.2f} | {pr.dp_bytes / 2**20:.2f} |"
        )
    if errors:
        lines.append(f"\nmean |error| {100 * statistics.mean(e for e, _ in errors):.0f}%; after the common scale "
                     f"({scale:.2f}) {100 * statistics.mean(r for _, r in errors):.0f}%")
    lines.append("")
    for model in ("gpt-1.3b", "gpt-7b"):
        for devices in (8, 64):
            s = GPTShape(**MODELS[model])
            h = Hardware.preset("dgx-a100", devices)
            best, table = recommend(s, h)
            lines += [f"**{model}** ({s.params / 1e9:.2f}B, seq {s.seq}, {s.batch} x {s.seq} tokens per step, "
                      f"micro-batch {s.micro_batch}, bf16) on **{devices} A100-80GB** (8 per node, NVLink 230 GB/s, "
                      f"IB 22 GB/s per GPU): recommended dp={best.dp if best else '-'} x mp={best.mp if best else '-'}",
                      "",
                      format_table(table, best), ""]
    text = "\n".join(lines)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
