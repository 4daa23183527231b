"""Issue 44 item 3's acceptance: ``DPMPStrategy(dp="auto", mp="auto", pp="auto", zero="auto")`` on 4 CPU processes
picks the measured-fastest layout of the benchmark within 5%.

One ``gpt_bench.py`` run (interleaved rounds) measures every candidate layout of the benchmark model (transformers'
Llama, 8 layers, hidden 256, 8 heads / 4 kv heads, sequence 128, float32, AdamW) at world 4, and ``dpmp_auto``
beside them. The loader's batch is per rank (``--per-rank-batch``, 4 sequences), so the global batch is dp times it
and layouts are compared by **tokens/s**, as the strategy ranks them. Candidates: (dp, pp, mp) = (4,1,1), (2,2,1),
(2,1,2) at zero 0, 1 and 3 (zero 2 runs zero 1's schedule), (1,4,1), (1,2,2), (1,1,4); pipelines with 4
micro-batches, 1F1B. ``dpmp_auto`` measures its links and chooses afresh in each round; for each round the report
names the layout it chose (read from its ranks) and compares

* the chosen layout's own measured tokens/s (its dedicated runs) with the fastest candidate's, and
* ``dpmp_auto``'s measured tokens/s in that round (the setup-time measurement excluded: steps only; its global batch
  is the chosen dp x 4 sequences) with the fastest's::

    python benchmarks/auto_layout_check.py     # ~20 min on 2 CPU cores; writes benchmarks/results/auto_layout
    python benchmarks/auto_layout_check.py --rounds 1 --out /tmp/auto_layout
    python benchmarks/auto_layout_check.py --report-only --out benchmarks/results/auto_layout/run5
"""

from __future__ import annotations

import argparse
import json
import statistics
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
    p.add_argument("--report-only", action="store_true", help="report on the results already in --out")
    a = p.parse_args()
    out = Path(a.out)
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpt_bench.py"), "--model", "hf_llama", "--layers", "8",
           "--rounds", str(a.rounds), "--steps", str(a.steps), "--warmup", str(a.warmup), "--per-rank-batch",
           str(a.per_rank_batch), "--pp-microbatches", "4", "--world", "4", "--out", str(out),
           "--configs", ",".join(CANDIDATES + ["dpmp_auto"])]
    if not a.report_only:
        subprocess.run(cmd, cwd=ROOT, check=True)
    text = report(out, a.per_rank_batch, a.warmup)
    with open(out / "results.md", "a") as f:
        f.write(text + "\n")
    print(text)


def _name(dp: int, pp: int, mp: int, zero: int) -> str:
    name = f"dpmp_{dp}x{mp}" + (f"_pp{pp}" if pp > 1 else "") + (f"_zero{zero}" if zero else "")
    return name.replace("_zero2", "_zero1")  # zero 2 runs zero 1's schedule (not measured separately)


def report(out: Path, per_rank_batch: int, warmup: int, seq: int = 128) -> str:
    """The acceptance per round: each round of ``dpmp_auto`` chooses afresh (its own measurement of the links), so
    each round's choice is compared with the fastest candidate, and its own run's tokens/s computed from the layout
    it chose (its global batch is that layout's dp x ``per_rank_batch``)."""
    rows = json.loads((out / "results.json").read_text())["rows"]
    runs = json.loads((out / "runs.json").read_text())
    ranked = sorted(CANDIDATES, key=lambda c: -rows[c]["tokens_per_s"])
    best = ranked[0]
    choices = []
    for i, r in enumerate(runs["dpmp_auto"]):
        layouts = {tuple(x["layout"]) for x in r["ranks"]}
        if len(layouts) != 1:
            raise SystemExit(f"round {i}: the ranks chose different layouts {sorted(layouts)}")
        (dp, pp, mp, zero), = layouts
        rank0 = next(x for x in r["ranks"] if x["rank"] == 0)
        own = dp * per_rank_batch * seq / statistics.median(rank0["step_times"][warmup:])
        choices.append((i, (dp, pp, mp, zero), _name(dp, pp, mp, zero), own, rank0["layout_report"]))
    picked = {c[2] for c in choices}
    lines = ["", "| layout | measured tokens/s | / fastest | |", "|---|---:|---:|---|"]
    for c in ranked:
        mark = "**chosen** in round(s) " + ", ".join(str(i) for i, _, n, _, _ in choices if n == c) if c in picked \
            else ""
        share = rows[c]["tokens_per_s"] / rows[best]["tokens_per_s"]
        lines.append(f"| {c} | {rows[c]['tokens_per_s']:,.0f} | {share:.3f} | {mark} |")
    lines.append("")
    for i, lay, name, own, _ in choices:
        ratio = rows[best]["tokens_per_s"] / rows[name]["tokens_per_s"] if name in rows else float("nan")
        verdict = "within 5%" if ratio <= 1.05 else "NOT within 5%"
        lines.append(f"- round {i}: dpmp_auto chose (dp, pp, mp, zero) = {lay}: {name} measured {ratio:.3f}x the"
                     f" fastest's ({best}) step time per token ({verdict}); dpmp_auto's own run in that round"
                     f" {own:,.0f} tokens/s = {own / rows[best]['tokens_per_s']:.3f} of the fastest")
    for i, _, _, _, text in choices:
        lines += ["", f"The ranking dpmp_auto printed at setup (rank 0, round {i}):", "", "```", text, "```"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
