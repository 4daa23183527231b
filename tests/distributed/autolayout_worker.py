"""One 4-process launch for ``DPMPStrategy(dp="auto", mp="auto")``: two float64 fits of ResMLP with the measured
link figures replaced, one latency-bound (expected: dp=4 x mp=1) and one bandwidth-bound (expected: mp > 1), and
one with this machine's own measured figures (whatever it picks must train right), each recording the choice, the
ranked table and a consolidated checkpoint for the pytest side's parity check.

Usage (from the repo root): python tests/distributed/autolayout_worker.py OUT_DIR
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

import lightning_dpmp.integration.autolayout as autolayout  # noqa: E402
from lightning_dpmp import DPMPStrategy  # noqa: E402
from lightning_dpmp.planner.cost import Links  # noqa: E402
from tests.distributed.parity_worker import CLIP, SEED, STEPS  # noqa: E402
from tests.support.models import build  # noqa: E402

PER_RANK_BATCH = 2  # the loader's batch: the global batch is dp times it, whichever dp is chosen
LINKS = {
    "latency": Links(intra_bw=1e12, intra_latency=1e-2, flops=1e12, mem_bw=1e12),  # many small messages hurt
    "bandwidth": Links(intra_bw=1e5, intra_latency=1e-9, flops=1e12, mem_bw=1e12),  # big gradients hurt
}


REAL_MEASURE = autolayout.measure_links


def run(case: str, out: str) -> dict:
    measured: list[str] = []

    def fake_measure(*args, **kwargs):  # the real one's signature; every rank gets the same figures
        measured.append(case)
        return LINKS[case]

    autolayout.measure_links = fake_measure if case in LINKS else REAL_MEASURE
    L.seed_everything(SEED, workers=True)
    model, dataset = build("resmlp")
    strategy = DPMPStrategy(timeout=timedelta(minutes=2))  # dp="auto", mp="auto"
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=strategy, precision="64-true", max_steps=STEPS,
        gradient_clip_val=CLIP, gradient_clip_algorithm="norm", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    pending = strategy.layout_pending
    trainer.fit(model, DataLoader(dataset, batch_size=PER_RANK_BATCH))
    trainer.save_checkpoint(os.path.join(out, f"{case}.ckpt"))
    return {
        "pending_before_fit": pending,
        "measured": measured,
        "layout": [strategy.dp, strategy.mp],
        "grid": [strategy.grid.dp, strategy.grid.mp],
        "sampler": trainer.train_dataloader.sampler.num_replicas,
        "report": strategy.layout_report,
        "plan_text": strategy.applied_plan.text,
    }


if __name__ == "__main__":
    torch.set_num_threads(1)
    out = sys.argv[1]
    results = {case: run(case, out) for case in [*LINKS, "measured"]}  # "measured": this machine's own figures
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(results, f, indent=1)
