"""``DPMPStrategy(dp="auto", mp="auto", pp="auto", zero="auto")`` (issue 44 item 3) in pooled launches.

``choose OUT`` (4 processes): two float64 fits of the 4-block GPT, each choosing its layout at setup: one with the
link figures replaced by bandwidth-bound ones (a pipeline moves the least bytes: expected pp > 1), one with this
machine's measured figures. Each rank records the layout it trains at in ``on_train_start`` and the ranked table;
rank 0 saves a consolidated checkpoint for the pytest side's parity check.

``refuse OUT`` (2 processes): a given ``DPMPStrategy(dp=2, mp=1)`` with ``DPMP_DEVICE_MEMORY_GIB`` (set by the test)
far below the model's predicted peak: refused at setup on every rank, before any step (a ``started`` file would
say otherwise).

Usage (from the repo root): python tests/distributed/layout_search_worker.py choose|refuse OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import lightning_dpmp.integration.autolayout as autolayout  # noqa: E402
from lightning_dpmp import DPMPStrategy  # noqa: E402
from lightning_dpmp.planner.cost import Links  # noqa: E402
from tests.distributed.pipeline_worker import SetupSteps  # noqa: E402
from tests.support.models import build  # noqa: E402

SEED, STEPS, PER_RANK_BATCH, MODEL = 0, 6, 4, "gpt4"
BANDWIDTH_BOUND = Links(intra_bw=1e5, intra_latency=1e-9, flops=1e12, mem_bw=1e12)
REAL_MEASURE = autolayout.measure_links


class Record(L.Callback):
    """What each rank trains at, read when training starts (after setup chose, before the first step)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.seen: dict = {}

    def on_train_start(self, trainer, pl_module):  # noqa: ANN001
        s = trainer.strategy
        self.seen = {"pending": s.layout_pending, "layout": [s.dp, s.pp, s.mp, s.zero],
                     "grid": [s.grid.dp, s.grid.pp, s.grid.mp],
                     "sampler": trainer.train_dataloader.sampler.num_replicas}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # noqa: ANN001
        (self.out / f"started{trainer.global_rank}").touch()


def fit(case: str, out: Path) -> dict:
    calls: list[str] = []

    def fake_measure(*args, **kwargs):  # every rank gets the same figures, as the real one broadcasts rank 0's
        calls.append(case)
        return BANDWIDTH_BOUND

    autolayout.measure_links = fake_measure if case == "bandwidth" else REAL_MEASURE
    L.seed_everything(SEED, workers=True)
    model, dataset = build(MODEL)
    strategy = DPMPStrategy(dp="auto", mp="auto", pp="auto", zero="auto", timeout=timedelta(minutes=2))
    record, setup_steps = Record(out), SetupSteps()
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, precision="64-true", max_steps=STEPS,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[record, setup_steps])
    pending = strategy.layout_pending
    trainer.fit(model, DataLoader(dataset, batch_size=PER_RANK_BATCH))
    trainer.save_checkpoint(str(out / f"{case}.ckpt"))
    return {"pending_before_fit": pending, "calls": calls, **record.seen, "report": strategy.layout_report,
            "setup_steps": setup_steps.count}


def choose(out: Path) -> None:
    results = {case: fit(case, out) for case in ("bandwidth", "measured")}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results, indent=1))


def refuse(out: Path) -> None:
    L.seed_everything(SEED, workers=True)
    model, dataset = build(MODEL)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DPMPStrategy(dp=2, mp=1, timeout=timedelta(minutes=1)),
                        precision="64-true", max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Record(out)])
    trainer.fit(model, DataLoader(dataset, batch_size=PER_RANK_BATCH))


if __name__ == "__main__":
    torch.set_num_threads(1)
    {"choose": choose, "refuse": refuse}[sys.argv[1]](Path(sys.argv[2]))
