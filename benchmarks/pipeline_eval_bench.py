"""Memory per rank while a pipeline evaluates (issue 42, item 4; not a timed test): stage by stage against the way
evaluation ran before (every stage's parameters synced to every rank first).

One 2-process launch at (dp, pp, mp) = (1, 2, 1): a 16-layer GPT (width 256, vocabulary 512, tied, float64; 12.8 M
parameters, 97 MB dense) trains 2 steps, then a validation run of 4 batches of 8 sequences. During validation a
callback records, per rank, the parameter bytes held with storage (at every batch end) and the peak RSS above the
RSS when validation started (the kernel's high-water mark, reset at the start; glibc's mmap threshold fixed so that
RSS follows live memory). Twice: ``staged`` (this tree), and ``synced``, evaluation as it ran before: every stage's
parameters brought to every rank first (``strategy.sync_stages(with_state=False)``, what ``on_validation_start``
did), then each rank running the whole model's ``validation_step`` alone.

Usage (from the repo root; about 1 minute on 2 CPU cores):
    python -m torch.distributed.run --standalone --nproc_per_node=2 benchmarks/pipeline_eval_bench.py \
        [--out benchmarks/results/pipeline_eval]
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
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from examples.models.gpt import GPT  # noqa: E402
from lightning_dpmp import DPMPStrategy  # noqa: E402
from tests.support.models import LMModule, make_lm_dataset  # noqa: E402

DP, PP, MP, VOCAB, SEQ, MB = 1, 2, 1, 512, 16, 2**20


def rss(field: str) -> int:
    """A ``/proc/self/status`` field in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


class ValLM(LMModule):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1)), sync_dist=True)


class Synced(DPMPStrategy):
    """Evaluation as before: every stage's parameters synced to every rank for the run, and each rank evaluating
    the whole (MP-split) model alone."""

    def _stage_for_evaluation(self) -> None:
        self.sync_stages(with_state=False)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._in_step(), self.precision_plugin.val_step_context():
            return self.lightning_module.validation_step(*args, **kwargs)


class Watch(L.Callback):
    def __init__(self) -> None:
        self.held: set[int] = set()
        self.start = 0
        self.result: dict[str, Any] = {}

    def on_validation_start(self, trainer, pl_module):
        if trainer.sanity_checking:
            return
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        self.start = rss("VmRSS")

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if not trainer.sanity_checking:
            self.held.add(sum(p.untyped_storage().nbytes() for p in pl_module.parameters()))

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.result = {"peak_above_start": rss("VmHWM") - self.start, "held_params": max(self.held),
                           "dense_params": sum(p.numel() * p.element_size() for p in pl_module.parameters())}


def run(cls: type) -> dict[str, Any]:
    L.seed_everything(0, workers=True)
    net = GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=16, n_head=8, n_embd=256, dropout=0.0, tie_embeddings=True)
    watch = Watch()
    strategy = cls(dp=DP, pp=PP, mp=MP, pp_microbatches=4, timeout=timedelta(minutes=5))
    trainer = L.Trainer(accelerator="cpu", devices=DP * PP * MP, precision="64-true", max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        strategy=strategy, callbacks=[watch], val_check_interval=2, num_sanity_val_steps=0,
                        limit_val_batches=4)
    data = make_lm_dataset(n=32, vocab=VOCAB, seq=SEQ)
    trainer.fit(ValLM(net), DataLoader(data, batch_size=8), DataLoader(data, batch_size=8))
    return watch.result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join("benchmarks", "results", "pipeline_eval"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    try:  # RSS as live memory
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 17)
    except OSError:
        pass
    results = {"staged": run(DPMPStrategy), "synced": run(Synced)}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, results)
    if dist.get_rank() != 0:
        return
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(everyone, f, indent=1)
    dense = everyone[0]["staged"]["dense_params"]
    lines = [f"dense model {dense / MB:.1f} MB (float64); (dp, pp, mp) = ({DP}, {PP}, {MP}); validation of 4 batches"
             " of 8 x 16 tokens, 4 micro-batches",
             "| evaluation | rank | parameters held MB | peak RSS above the start MB |", "|---|---|---|---|"]
    for mode in ("staged", "synced"):
        for r, res in enumerate(everyone):
            x = res[mode]
            lines.append(f"| {mode} | {r} | {x['held_params'] / MB:.1f} | {x['peak_above_start'] / MB:.1f} |")
    text = "\n".join(lines)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
