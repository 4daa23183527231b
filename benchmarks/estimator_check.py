"""The layout estimator (``python -m lightning_dpmp.plan``) against what ``benchmarks/gpt_bench.py`` measured on
this machine: transformers' Llama of the benchmark (hidden 256, 8 heads / 4 kv heads, SwiGLU 1024, vocab 256,
sequence 128, float32, AdamW) at world 4 and 8 on CPU (gloo, 2 shared cores).

* memory: the predicted peak tensor bytes per rank of the worst stage against ``peak_mb`` of the runs
  (what was held when the step began + the highest running total of torch.profiler's allocation events in it);
* step time: the ``cpu`` preset's compute efficiency and per-ring-step latency are fitted (grid search, squared log
  error) on the calibration layouts only, the link bandwidth held at gloo's measured :data:`LINK_BW`; every other
  layout is held out. The ranking check, within each run: is the measured fastest layout (per sequence) predicted
  first, or within 5% of the predicted first?

Measured rows come from ``benchmarks/results/<run>/results.json`` for each run of :data:`RUNS`: ``pipeline``,
``pipeline_zero`` (8 layers, world 4, global batch 8: (dp, pp, mp) = (1,2,2) (1,1,4) (2,1,2) (4,1,1) (1,4,1), (2,2,1)
at zero 0/1/3, (4,1,1) at zero 3), ``hf_llama_zero`` (4 layers, (2,1,2) zero 0..3), ``recompute`` (4 layers,
(2,1,2) and (1,2,2) with and without every block recomputed), ``estimator_w8`` (8 layers, world 8, 8 sequences
per DP rank: every (dp, pp, mp) the heads allow, zero levels, recomputation) and ``estimator_w8_quiet`` (the same
layouts again on a quiet machine, 2026-12-07, on this stop's code: 6 steps, the median of the last 4; its peaks are
its own), ``pipeline_zero_quiet`` and ``recompute_quiet`` (those two runs' layouts again, quiet, 2 rounds of 8
steps); one process with and without recomputation is measured by this script itself::

    python benchmarks/estimator_check.py            # writes benchmarks/results/estimator/results.md
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.gpt_bench import AllocationPeak  # noqa: E402
from lightning_dpmp.tools.estimate import DEVICES, LayoutSpec, predict  # noqa: E402
from lightning_dpmp.tools.profile import ModelProfile, profile_config  # noqa: E402

CALIBRATION = {("pipeline", "dpmp_4x1"), ("pipeline", "dpmp_1x4"), ("pipeline", "dpmp_2x2")}


def bench_profile(layers: int) -> ModelProfile:
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=1024, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128,
                      tie_word_embeddings=False)
    return profile_config(cfg, seq=128)


def parse(config: str, microbatches: int) -> LayoutSpec:
    """gpt_bench's names: ``dpmp_<dp>x<mp>[_pp<k>][_zero<z>][_ac]`` (``_ac``: every block recomputed)."""
    m = re.fullmatch(r"dpmp_(\d+)x(\d+)(?:_pp(\d+))?(?:_zero(\d))?(_ac)?", config)
    if m is None:
        raise ValueError(config)
    dp, mp, pp, zero = int(m[1]), int(m[2]), int(m[3] or 1), int(m[4] or 0)
    return LayoutSpec(dp, pp, mp, zero, False, microbatches if pp > 1 else 1, "1f1b" if pp > 1 else "none",
                      bool(m[5]))


#: gpt_bench runs whose peaks are compared (their step times are compared within each run only)
RUNS = ("pipeline", "pipeline_zero", "hf_llama_zero", "recompute", "estimator_w8", "estimator_w8_quiet",
        "pipeline_zero_quiet", "recompute_quiet")


#: where the peaks come from: every run's layouts again, memory only (one warm-up step, then the profiler's two;
#: gpt_bench's corrected window, see its ``AllocationPeak``); the step times stay those of the runs themselves
PEAKS = ROOT / "benchmarks" / "results" / "estimator_memory"


def measured(peaks: Path = PEAKS) -> list[dict[str, Any]]:
    out = []
    for folder in RUNS:
        path = ROOT / "benchmarks" / "results" / folder / "results.json"
        if not path.exists():
            continue
        res = json.loads(path.read_text())
        args = res["args"]
        rerun = peaks / folder / "results.json"
        peak_rows = json.loads(rerun.read_text())["rows"] if rerun.exists() else res["rows"]
        for name, row in res["rows"].items():
            if not name.startswith("dpmp"):
                continue
            if name not in peak_rows:
                raise SystemExit(f"{rerun}: no {name}; rerun every layout of {folder}")
            spec = parse(name, args.get("pp_microbatches", 4))
            per_rank = args.get("per_rank_batch") or 0
            world = spec.dp * spec.pp * spec.mp
            out.append(dict(folder=folder, config=name, layers=args["layers"], spec=spec, world=world,
                            global_batch=per_rank * spec.dp if per_rank else args["global_batch"],
                            peak_mib=peak_rows[name]["peak_mb"], step_s=row["step_s"],
                            calibration=(folder, name) in CALIBRATION))
    return out


def measure_one_process(recompute: bool, layers: int = 8, seqs: int = 2) -> float:
    """Peak tensor MiB of one training step of the benchmark Llama in this process (float32, AdamW), measured as
    gpt_bench does: parameters + gradients + AdamW state held at the step's start + the highest running total of
    torch.profiler's allocation events during it (forward, ``zero_grad`` where Lightning calls it, backward, step;
    the profiler runs from a step earlier, as in gpt_bench, so that it sees the last step's gradients freed);
    ``recompute``: transformers' ``gradient_checkpointing_enable`` (non-reentrant) on every block."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=1024, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128,
                      tie_word_embeddings=False)
    net = LlamaForCausalLM(cfg).train()
    if recompute:
        net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    ids = torch.randint(0, 256, (seqs, 128))

    def step() -> None:
        logits = net(input_ids=ids, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)  # Lightning's order: after training_step, before backward
        loss.backward()
        opt.step()

    step()
    held = 2 * sum(p.numel() * p.element_size() for p in net.parameters()) + sum(
        v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if v.dim() > 0)
    # the profiler runs from one step earlier, so that it sees the last step's gradients freed by zero_grad
    window = AllocationPeak()
    window.start()
    step()
    window.begin()
    step()
    window.end()
    peak = window.peak
    return (held + peak) / 2**20


#: gloo's all-reduce bandwidth among 4 processes on this machine's 2 cores, measured by benchmarks/gloo_links.py
#: (2026-12-07, two runs: 1.1 and 0.96 GB/s from 32 MiB in 50.6 and 59.2 ms beside 1 KiB in 5.2 and 6.8 ms, medians
#: of 10; the latter also gave 1.1 ms per ring step).
#: Held, not fitted: three calibration layouts cannot tell a bandwidth above ~3 GB/s from any other (the squared log
#: error changes by 20% between 3 and 20 GB/s), while the per-step latency they do fix.
LINK_BW = 1.0e9


def fit_cpu(rows: list[dict[str, Any]], profiles: dict[int, ModelProfile]) -> Any:
    """The cpu preset's efficiency and per-ring-step latency that fit the calibration rows (bandwidth measured)."""
    base = DEVICES["cpu"]
    best, best_err = base, math.inf
    # two free figures for three calibration layouts: the compute rate, and the latency of a ring step, which the
    # many small MP all-reduces of (1,1,4) and (2,1,2) fix against the few large DP buckets of (4,1,1)
    grid = itertools.product([x / 100 for x in range(10, 151, 2)], [x * 1e-4 for x in range(1, 41)])
    cal = [r for r in rows if r["calibration"]]
    for eff, lat in grid:
        dev = replace(base, efficiency=eff, intra_bw=LINK_BW, inter_bw=LINK_BW, intra_latency=lat,
                      inter_latency=lat, overhead_s=0.0)
        err = sum(math.log(predict(profiles[r["layers"]], dev, r["world"], r["global_batch"], r["spec"],
                                   "32-true").step_s / r["step_s"]) ** 2 for r in cal)
        if err < best_err:
            best, best_err = dev, err
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/estimator")
    p.add_argument("--peaks", default=str(PEAKS), help="the memory reruns (a folder per run of RUNS)")
    a = p.parse_args()
    rows = measured(Path(a.peaks))
    profiles = {n: bench_profile(n) for n in sorted({r["layers"] for r in rows})}
    dev = fit_cpu(rows, profiles)
    lines = [f"cpu preset fitted on {sorted(c for _, c in CALIBRATION)} (8 layers): efficiency {dev.efficiency}, "
             f"link {dev.intra_bw / 1e9:g} GB/s, latency {dev.intra_latency * 1e6:g} us, overhead "
             f"{dev.overhead_s * 1e3:g} ms per block per micro-batch", "",
             "| run | layers | world | (dp, pp, mp) | zero | micro | recompute | measured peak MiB | predicted MiB |"
             " error | measured step s | predicted s | error | |",
             "|---|---:|---:|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    out = []
    for r in rows:
        e = predict(profiles[r["layers"]], dev, r["world"], r["global_batch"], r["spec"], "32-true")
        s = r["spec"]
        pm = e.peak_mem_gib * 1024
        rec = dict(folder=r["folder"], layers=r["layers"], world=r["world"], dp=s.dp, pp=s.pp, mp=s.mp, zero=s.zero,
                   microbatches=s.microbatches, recompute=s.recompute, global_batch=r["global_batch"],
                   measured_peak_mib=r["peak_mib"], predicted_peak_mib=pm, measured_step_s=r["step_s"],
                   predicted_step_s=e.step_s, calibration=r["calibration"],
                   memory_mib={k: v / 2**20 for k, v in (e.memory or {}).items()})
        out.append(rec)
        lines.append(f"| {r['folder']} | {r['layers']} | {r['world']} | ({s.dp}, {s.pp}, {s.mp}) | {s.zero} | "
                     f"{s.microbatches} | {'yes' if s.recompute else 'no'} | "
                     f"{r['peak_mib']:.1f} | {pm:.1f} | {pm / r['peak_mib'] - 1:+.1%} | {r['step_s']:.3f} | "
                     f"{e.step_s:.3f} | "
                     f"{e.step_s / r['step_s'] - 1:+.1%} | {'calibration' if r['calibration'] else 'held out'} |")
    mem_err = [abs(o["predicted_peak_mib"] / o["measured_peak_mib"] - 1) for o in out]
    lines.append("")
    lines.append(f"- peak memory: {sum(x <= 0.10 for x in mem_err)} of {len(mem_err)} layouts within 10% "
                 f"(largest error {max(mem_err):.1%}, median {sorted(mem_err)[len(mem_err) // 2]:.1%})")
    for folder in RUNS:  # step times compare within one run only
        group = [o for o, r in zip(out, rows) if r["folder"] == folder]
        if not group:
            continue
        layers = group[0]["layers"]
        # per sequence: a run with a per-rank batch gives each layout the global batch its dp implies
        fastest = min(group, key=lambda o: o["measured_step_s"] / o["global_batch"])
        first = min(group, key=lambda o: o["predicted_step_s"] / o["global_batch"])
        ratio = (first["measured_step_s"] / first["global_batch"]) / (fastest["measured_step_s"]
                                                                      / fastest["global_batch"])
        lines.append(f"- {folder} ({layers} layers, one run), step time per sequence, ranking: measured fastest "
                     f"({fastest['dp']}, {fastest['pp']}, {fastest['mp']}) zero={fastest['zero']}"
                     f"{' recompute' if fastest['recompute'] else ''}; predicted first ({first['dp']}, {first['pp']},"
                     f" {first['mp']}) zero={first['zero']}{' recompute' if first['recompute'] else ''}, measured "
                     f"{ratio:.3f}x the fastest's time per sequence "
                     f"({'within 5%' if ratio <= 1.05 else 'NOT within 5%'})")
    lines += ["", "One process, 2 sequences, measured here by this script (with and without recomputation):", "",
              "| layers | (dp, pp, mp) | recompute | measured peak MiB | predicted MiB | error |",
              "|---:|---|---|---:|---:|---:|"]
    for rc in (False, True):
        meas = measure_one_process(rc)
        e = predict(profiles[8], dev, 1, 2, LayoutSpec(1, 1, 1, recompute=rc), "32-true")
        pm = e.peak_mem_gib * 1024
        out.append(dict(folder="one_process", layers=8, dp=1, pp=1, mp=1, zero=0, microbatches=1, recompute=rc,
                        measured_peak_mib=meas, predicted_peak_mib=pm))
        lines.append(f"| 8 | (1, 1, 1) | {'yes' if rc else 'no'} | {meas:.1f} | {pm:.1f} | {pm / meas - 1:+.1%} |")
    text = "\n".join(lines)
    print(text)
    d = ROOT / a.out
    d.mkdir(parents=True, exist_ok=True)
    (d / "results.md").write_text(text + "\n")
    (d / "results.json").write_text(json.dumps(dict(device=dict(efficiency=dev.efficiency, link_bw=dev.intra_bw,
                                                                latency=dev.intra_latency,
                                                                overhead_s=dev.overhead_s), rows=out), indent=1))


if __name__ == "__main__":
    main()
