"""Dropout masks under DPMPStrategy at dp=1 x mp=2: one training step per seed, masks saved per rank.

Usage: python tests/distributed/dropout_worker.py OUT_DIR
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_dpmp import DPMPStrategy  # noqa: E402
from tests.support.models import make_dataset  # noqa: E402


class DropMLP(L.LightningModule):
    """fc1 -> gelu -> dropout (inside the split region) -> fc2 -> dropout (replicated region)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(12, 64), nn.Linear(64, 12), nn.Linear(12, 3)
        self.inner, self.outer = nn.Dropout(0.5), nn.Dropout(0.5)
        self.masks: dict[str, torch.Tensor] = {}
        for name in ("inner", "outer"):
            getattr(self, name).register_forward_hook(self._record(name))

    def _record(self, name):
        def hook(module, args, out):
            if self.training:
                self.masks[name] = (out == 0) & (args[0] != 0)
        return hook

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.head(self.outer(self.fc2(self.inner(F.gelu(self.fc1(x)))))), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def one_step(seed: int) -> dict:
    L.seed_everything(seed)
    model = DropMLP()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DPMPStrategy(dp=1, mp=2, timeout=timedelta(minutes=2)),
                        max_steps=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(make_dataset(), batch_size=16))
    styles = {n: lp.style for n, lp in trainer.strategy.applied_plan.plan.layers.items()}
    return {**model.masks, "fc1_column": torch.tensor(styles["fc1"] == "column")}


if __name__ == "__main__":
    torch.set_num_threads(1)
    out = sys.argv[1]
    runs = {"a": one_step(7), "b": one_step(7), "c": one_step(8)}
    torch.save(runs, os.path.join(out, f"masks_rank{dist.get_rank()}.pt"))
