"""One launch per (dp, pp, mp): train models under DPMPStrategy(pp=...) with each schedule, as parity_worker does
without a pipeline, and record the point-to-point sends of one step, the stages and what was logged.

Usage (from the repo root): python tests/distributed/pipeline_worker.py DP PP MP OUT MODEL:SCHEDULE[:V],...
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_dpmp import DPMPStrategy  # noqa: E402
from lightning_dpmp.integration.accounting import CommCounter  # noqa: E402
from tests.distributed.parity_worker import CLIP, GLOBAL_BATCH, SEED, STEPS  # noqa: E402
from tests.support.models import build  # noqa: E402

MICROBATCHES = 4 // 1  # per DP rank's batch of GLOBAL_BATCH // dp rows (>= 4): 4 micro-batches of 1 or 2 rows


class Counter(L.Callback):
    """The collectives and sends of one whole training step (step 3), by group, and the logged values."""

    def __init__(self, step: int = 3) -> None:
        self.step, self.mode, self.counts, self.logged = step, None, {}, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            grid = trainer.strategy.grid
            self.mode = CommCounter({"mp": grid.mp_group, "dp": grid.dp_group, "pp": grid.pp_group})
            self.mode.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.counts = {f"{g}/{op}": n for (g, op), n in self.mode.counts.items()}
            self.mode = None
        self.logged[trainer.global_step] = float(trainer.callback_metrics["train_loss"])


def run(dp: int, pp: int, mp: int, precision: str, out: str, spec: str) -> dict:
    name, schedule, *v = spec.split(":")
    L.seed_everything(SEED, workers=True)
    model, dataset = build(name)
    counter = Counter()
    strategy = DPMPStrategy(dp=dp, mp=mp, pp=pp, pp_microbatches=MICROBATCHES, pp_schedule=schedule,
                            pp_stages_per_rank=int(v[0]) if v else 1, timeout=timedelta(minutes=2))
    trainer = L.Trainer(
        accelerator="cpu", devices=dp * pp * mp, strategy=strategy, precision=precision, max_steps=STEPS,
        gradient_clip_val=CLIP, gradient_clip_algorithm="norm", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[counter],
    )
    trainer.fit(model, DataLoader(dataset, batch_size=GLOBAL_BATCH // dp))
    tag = f"{spec.replace(':', '_')}_{precision.split('-')[0]}"
    trainer.save_checkpoint(os.path.join(out, f"{tag}.ckpt"))
    return {"counts": counter.counts, "logged": counter.logged, "plan_text": strategy.applied_plan.text,
            "ranges": strategy.pipeline.ranges if strategy.pipeline is not None else None}


if __name__ == "__main__":
    torch.set_num_threads(1)
    dp, pp, mp, out = (int(a) for a in sys.argv[1:4]), None, None, None
    dp, pp, mp = (int(a) for a in sys.argv[1:4])
    out = sys.argv[4]
    specs = sys.argv[5].split(",")
    precisions = os.environ.get("PRECISIONS", "64-true").split(",")
    results = {f"{s.replace(':', '_')}_{p.split('-')[0]}": run(dp, pp, mp, p, out, s) for s in specs for p in precisions}
    rank = dist.get_rank() if dist.is_initialized() else 0
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=1)
