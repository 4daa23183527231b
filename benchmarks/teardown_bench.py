"""Memory per rank at the end of ``fit`` under ZeRO-3: what the teardown holds at its peak, against the bytes the
rank held before it and the dense state (issue 42, item 6; not a timed test).

One 4-process launch at (dp, mp) = (2, 2), zero=3: the 16-layer GPT of ``tests/distributed/checkpoint_memory_worker``
(width 256, float64, AdamW; 12.6 M parameters, 101 MB of weights and 202 MB of moments dense) trains 2 steps, once
per ``consolidate_on_teardown`` (``"rank0"``, ``True``, ``False``) and once more at ``"rank0"`` the way teardown
worked before it streamed from the shards (``rank0/release-first``: the engine released first, so every rank held
its whole MP-local model and optimizer state, then the MP gather onto rank 0). Around ``strategy.teardown`` the
kernel's peak RSS mark is reset (``peak_during``, glibc's mmap threshold fixed so that RSS follows live memory):
``peak`` is the most the teardown held at once above what the rank held when it began.

Usage (from the repo root; about 2 minutes on 2 CPU cores, ~3 GB of RAM):
    python benchmarks/teardown_bench.py [--out benchmarks/results/teardown]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import lightning_dpmp.integration.parallelize as parallelize_mod  # noqa: E402
from examples.models.gpt import GPT  # noqa: E402
from lightning_dpmp import DPMPStrategy  # noqa: E402
from lightning_dpmp.integration.zero import release_engine  # noqa: E402
from tests.distributed.checkpoint_memory_worker import peak_during  # noqa: E402
from tests.support.models import LMModule, make_lm_dataset  # noqa: E402

DP, MP, VOCAB, SEQ, MB = 2, 2, 512, 16, 2**20
MODES: dict[str, Any] = {"rank0": "rank0", "true": True, "false": False, "rank0/release-first": "rank0"}


class Measured(DPMPStrategy):
    """DPMPStrategy whose teardown is measured: bytes held before (parameters, optimizer state), the peak above
    them during it, and what the rank holds after."""

    result: dict[str, Any]

    def teardown(self) -> None:
        if self._parallel is None:  # (Lightning calls teardown again on the way out of other entry points)
            super().teardown()
            return
        before = self.memory_report()
        peak_rss, peak_anon = peak_during(super().teardown)
        lm = self.lightning_module
        after_params = sum(p.numel() * p.element_size() for p in lm.parameters() if not p.is_meta)
        after_state = sum(v.numel() * v.element_size() for o in self.optimizers for s in o.state.values()
                          for v in s.values() if torch.is_tensor(v) and v.dim() and not v.is_meta)
        self.result = {"held_before": before["parameters"] + before["optimizer_state"],
                       "peak_rss": peak_rss, "peak_anon": peak_anon, "held_after": after_params + after_state}


def run(mode: str) -> dict[str, Any]:
    saved = parallelize_mod.consolidate_engine
    if mode.endswith("/release-first"):  # the old order: whole MP-local state everywhere, then the MP gather
        parallelize_mod.consolidate_engine = (  # type: ignore[assignment]
            lambda module, grid, engine, optimizers, configs, everywhere: release_engine(engine, optimizers, configs))
    try:
        L.seed_everything(0, workers=True)
        net = GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=16, n_head=8, n_embd=256, dropout=0.0,
                  tie_embeddings=True)
        strategy = Measured(dp=DP, mp=MP, zero=3, consolidate_on_teardown=MODES[mode], timeout=timedelta(minutes=5))
        trainer = L.Trainer(accelerator="cpu", devices=DP * MP, precision="64-true", max_steps=2, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            strategy=strategy)
        model = LMModule(net)
        trainer.fit(model, DataLoader(make_lm_dataset(n=16, vocab=VOCAB, seq=SEQ), batch_size=4 // DP))
        dense = sum(p.numel() for p in net.parameters() if not p.is_meta) * 8 if trainer.global_rank == 0 else None
        return {**strategy.result, "dense_params": dense}
    finally:
        parallelize_mod.consolidate_engine = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join("benchmarks", "results", "teardown"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    try:  # RSS as live memory (see tests/distributed/checkpoint_memory_worker.py)
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 17)
    except OSError:
        pass
    results = {mode: run(mode) for mode in MODES}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, results)
    if dist.get_rank() != 0:
        return
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(everyone, f, indent=1)
    dense = everyone[0]["rank0"]["dense_params"]
    lines = [f"dense model {dense / MB:.1f} MB + AdamW moments {2 * dense / MB:.1f} MB; (dp, mp) = ({DP}, {MP}),"
             " zero=3",
             "| consolidate_on_teardown | rank | held before MB | teardown peak MB (RSS) | held after MB |",
             "|---|---|---|---|---|"]
    for mode in MODES:
        for r, res in enumerate(everyone):
            x = res[mode]
            lines.append(f"| {mode} | {r} | {x['held_before'] / MB:.1f} | {x['peak_rss'] / MB:.1f} |"
                         f" {x['held_after'] / MB:.1f} |")
    text = "\n".join(lines)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
