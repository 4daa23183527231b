"""Data-dependent parameter use (issue 22): a top-1 ``ModuleList`` mixture of experts at every zero level.

Usage: python tests/distributed/moe_worker.py DP MP OUT_DIR MODEL:ZERO[,MODEL:ZERO...] [JSON strategy kwargs]
  For each run: 20 AdamW steps in float64 with norm clipping, torch reseeded at each step (LayerDrop draws),
  saved consolidated as ``{model}_z{zero}.ckpt``;
  each rank writes the DP collectives of step 3 and which experts got tokens on it, per step.
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
from tests.distributed.parity_worker import CLIP, GLOBAL_BATCH, SEED, STEPS  # noqa: E402
from tests.distributed.zero_worker import Probe  # noqa: E402
from tests.support.models import build  # noqa: E402


class SeedEachStep(L.Callback):
    """LayerDrop draws from torch's RNG: the same draws in every process and in the single-process reference
    (Lightning's multi-process start leaves the stream elsewhere than a single-device run)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        torch.manual_seed(SEED + trainer.global_step)


def fit(dp: int, mp: int, zero: int, out: str, name: str = "moe_list", **strategy_kw) -> dict:
    L.seed_everything(SEED, workers=True)
    model, dataset = build(name)
    used: list[set] = []

    def seen(name: str):
        def hook(module, args) -> None:
            if used:  # not while the strategy traces the step at setup
                used[-1].add(name)
        return hook

    for path, mod in model.named_modules():
        if path.endswith(".experts"):
            for i, expert in enumerate(mod):
                expert.register_forward_pre_hook(seen(f"{path}.{i}"))
    probe = Probe()

    class Steps(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            used.append(set())

    trainer = L.Trainer(
        accelerator="cpu", devices=dp * mp,
        strategy=DPMPStrategy(dp=dp, mp=mp, zero=zero, timeout=timedelta(minutes=2), **strategy_kw),
        precision="64-true", max_steps=STEPS, gradient_clip_val=CLIP, gradient_clip_algorithm="norm", logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[Steps(), probe, SeedEachStep()],
    )
    trainer.fit(model, DataLoader(dataset, batch_size=GLOBAL_BATCH // dp))
    trainer.save_checkpoint(os.path.join(out, f"{name}_z{zero}.ckpt"))
    return {"counts": probe.res.get("counts", {}), "used": [sorted(u) for u in used]}


if __name__ == "__main__":
    torch.set_num_threads(1)
    dp, mp, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    kw = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
    runs = [item.split(":") for item in sys.argv[4].split(",")]
    res = {}
    for item in runs:
        name, z = item[0], item[1]
        if len(item) > 2 and item[2] == "fails":  # the run must fail: its error's message, from every rank
            try:
                fit(dp, mp, int(z), out, name)
                res[f"{name}_z{z}_fails"] = {"error": None}
            except RuntimeError as exc:
                res[f"{name}_z{z}_fails"] = {"error": str(exc)}
        else:
            res[f"{name}_z{z}"] = fit(dp, mp, int(z), out, name, **kw)
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(res, f, indent=1)
