"""Issue 44 item 3's acceptance: ``DPMPStrategy(dp="auto", mp="auto", pp="auto", zero="auto")`` on 4 CPU processes
picks the measured-fastest layout of the benchmark within 5%.

One ``gpt_bench.py`` run (interleaved rounds) measures every candidate layout of the benchmark model (transformers'
Llama, 8 layers, hidden 256, 8 heads / 4 kv heads, sequence 128, float32, AdamW) at world 4, and ``dpmp_auto``
beside them. The loader's batch is per rank (``--per-rank-batch``, 4 sequences), so the global batch is dp times it
and layouts are compared by **tokens/s**, as the strategy ranks them. Candidates: (dp, pp, mp) = (4,1,1), (2,2,1),
(2,1,2) at zero 0, 1 and 3 (zero 2 runs zero 1's schedule), (1,4,1), (1,2,2), (1,1,4); pipelines with 4
micro-batches, 1F1B. The report names the layout ``dpmp_auto`` chose (read from its ranks) and compares

* the chosen layout's own measured tokens/s (its dedicated run) with the fastest candidate's, and
* ``dpmp_auto``'s measured tokens/s (the setup-time measurement excluded: steps only) with the fastest's::

    python benchmarks/auto_layout_check.py     # ~20 min on 2 CPU cores; writes benchmarks/results/auto_layout
    python benchmarks/auto_layout_check.py --rounds 1 --out /tmp/auto_layout
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CANDIDATES = ["dpmp_4x1", "dpmp_4x1_zero1", "dpmp_4x1_zero3", "dpmp_2x1_pp2", "dpmp_2x1_pp2_zero1",
              "dpmp_2x1_pp2_zero3", "dpmp_2x2", "dpmp_2x2_zero1", "dpmp_2x2_zero3", "dpmp_1x1_pp4", "dpmp_1x2_pp2",
              "dpmp_1x4"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--per-rank-batch", type=int, default=4)
    p.add_argument("--out", default="benchmarks/results/auto_layout")
    a = p.parse_args()
    out = Path(a.out)
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpt_bench.py"), "--model", "hf_llama", "--layers", "8",
           "--rounds", str(a.rounds), "--steps", str(a.steps), "--warmup", str(a.warmup), "--per-rank-batch",
           str(a.per_rank_batch), "--pp-microbatches", "4", "--world", "4", "--out", str(out),
           "--configs", ",".join(CANDIDATES + ["dpmp_auto"])]
    subprocess.run(cmd, cwd=ROOT, check=True)
    res = json.loads((out / "results.json").read_text())
    rows = res["rows"]
    runs = json.loads((out / "runs.json").read_text())
    auto_ranks = [x for r in runs["dpmp_auto"] for x in r["ranks"]]
    chosen = {tuple(x["layout"]) for x in auto_ranks}
    report = next(x["layout_report"] for x in auto_ranks if x["rank"] == 0)
    (dp, pp, mp, zero), = chosen  # every rank of every round: one layout
    name = f"dpmp_{dp}x{mp}" + (f"_pp{pp}" if pp > 1 else "") + (f"_zero{zero}" if zero else "")
    name = name.replace("_zero2", "_zero1")  # zero 2 runs zero 1's schedule (not measured separately)
    ranked = sorted(CANDIDATES, key=lambda c: -rows[c]["tokens_per_s"])
    best = ranked[0]
    lines = ["", f"dpmp_auto chose (dp, pp, mp, zero) = ({dp}, {pp}, {mp}, {zero}) on every rank and round", "",
             "| layout | measured tokens/s | / fastest | |", "|---|---:|---:|---|"]
    for c in ranked + ["dpmp_auto"]:
        mark = "**chosen**" if c == name else ("auto (its own run)" if c == "dpmp_auto" else "")
        ratio = rows[c]["tokens_per_s"] / rows[best]["tokens_per_s"]
        lines.append(f"| {c} | {rows[c]['tokens_per_s']:,.0f} | {ratio:.3f} | {mark} |")
    chosen_ratio = rows[best]["tokens_per_s"] / rows[name]["tokens_per_s"] if name in rows else float("nan")
    auto_ratio = rows[best]["tokens_per_s"] / rows["dpmp_auto"]["tokens_per_s"]
    verdict = "within 5%" if chosen_ratio <= 1.05 else "NOT within 5%"
    lines += ["", f"- measured fastest: {best}; the chosen layout {name} measured {chosen_ratio:.3f}x its step time"
                  f" per token ({verdict}); dpmp_auto's own run {auto_ratio:.3f}x",
              "", "The ranking dpmp_auto printed at setup (rank 0, first round):", "", "```", report, "```"]
    text = "\n".join(lines)
    with open(out / "results.md", "a") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
