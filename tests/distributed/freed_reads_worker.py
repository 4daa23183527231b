"""User code reading parameters whose storage is freed between uses (zero=3, a pipeline's other stages): a
weight-norm callback in ``on_train_batch_end`` and ``on_validation_epoch_end``, and the model after fit, in float64.

Run by ``tests/distributed/test_freed_reads.py`` on pool ranks (``OUT LAYOUTS``, ``;``-separated, each
``dp,pp,mp,zero``) and
imported by it for the one-process reference (:func:`fit_layout` at ``1,1,1,0``). Each rank writes
``OUT/rank<r>.json``: ``{layout: {"train": {step: norm}, "val": [norm, ...], "after": norm or None}}``.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_dpmp import DPMPStrategy  # noqa: E402
from tests.support.models import LMModule, build, reference_loader  # noqa: E402

GLOBAL_BATCH, STEPS, SEED = 8, 4, 0


def weight_norm(module: torch.nn.Module) -> float:
    """What a user's callback computes: the norm over every parameter (each this rank's tensor)."""
    return float(torch.sqrt(sum(p.detach().pow(2).sum() for p in module.parameters())))


class Norms(L.Callback):
    def __init__(self) -> None:
        self.train: dict[int, float] = {}
        self.val: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.train[trainer.global_step] = weight_norm(pl_module)  # gradients enabled here, as Lightning runs it

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.val.append(weight_norm(pl_module))


class Validated(LMModule):
    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))


def fit_layout(layout: str) -> dict[str, Any]:
    """Train the test Llama for ``STEPS`` steps at ``layout`` (``dp,pp,mp,zero``; one process: ``1,1,1,0``) with a
    validation pass every 2 steps, and return the norms user code read."""
    dp, pp, mp, zero = (int(v) for v in layout.split(","))
    L.seed_everything(SEED, workers=True)
    base, dataset = build("llama")
    model = Validated(base.net)
    norms = Norms()
    kwargs: dict[str, Any] = dict(accelerator="cpu", precision="64-true", max_steps=STEPS, logger=False,
                                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                  callbacks=[norms], val_check_interval=2, limit_val_batches=2,
                                  num_sanity_val_steps=0)
    world = dp * pp * mp
    if world == 1:
        trainer = L.Trainer(devices=1, **kwargs)
        loader = reference_loader(dataset, GLOBAL_BATCH, SEED)
        val = DataLoader(dataset, batch_size=GLOBAL_BATCH)
    else:
        strategy = DPMPStrategy(dp=dp, mp=mp, pp=pp, zero=zero, timeout=timedelta(minutes=3))
        trainer = L.Trainer(devices=world, strategy=strategy, **kwargs)
        loader = DataLoader(dataset, batch_size=GLOBAL_BATCH // dp)
        val = DataLoader(dataset, batch_size=GLOBAL_BATCH // dp)
    trainer.fit(model, loader, val)
    after = weight_norm(model) if trainer.global_rank == 0 else None  # ("rank0": rank 0 holds the plain model)
    return {"train": norms.train, "val": norms.val, "after": after}


if __name__ == "__main__":
    torch.set_num_threads(1)
    out, layouts = sys.argv[1], sys.argv[2].split(";")
    result = {layout: fit_layout(layout) for layout in layouts}
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)
