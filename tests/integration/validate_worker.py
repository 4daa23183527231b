"""Checks that can only run after launch, and the warnings of rank 0 (tests/integration/test_early_errors.py).

Usage: python tests/integration/validate_worker.py MODE
  idle       dp=2 x mp=2 on a model with nothing to split and a 1-sample dataset: two warnings, once each
  late_glob  dp=1 x mp=2, a plan glob that matches nothing in a model built in configure_model: rank 0 reports
  late_compile  dp=1 x mp=2, a submodule compiled with torch.compile in configure_model: refused at setup
  bad_glob   dp=1 x mp=2, a glob that matches nothing (run under torchrun: every rank checks before launch)
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_dpmp import DPMPStrategy  # noqa: E402


class Odd(L.LightningModule):
    """Only a 3 -> 3 Linear: no mp > 1 divides it, so nothing is split."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(3, 3)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.net(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Later(Odd):
    """Odd with one more layer built in configure_model: its structure is complete only at setup."""

    def configure_model(self) -> None:
        if not hasattr(self, "extra"):
            self.extra = nn.Linear(4, 4)


class LaterCompiled(Odd):
    """Odd whose configure_model compiles a submodule (as a user might): the planner cannot see inside it."""

    def configure_model(self) -> None:
        if not hasattr(self, "extra"):
            self.extra = torch.compile(nn.Linear(4, 4))


def main() -> None:
    torch.set_num_threads(1)
    mode = sys.argv[1]
    L.seed_everything(0)
    if mode == "idle":
        devices, strategy, model, n = 4, DPMPStrategy(dp=2, mp=2), Odd(), 1
    elif mode == "late_glob":
        strategy = DPMPStrategy(dp=1, mp=2, plan_overrides={"extar": "column"}, timeout=timedelta(minutes=1))
        devices, model, n = 2, Later(), 8
    elif mode == "late_compile":
        devices, strategy, model, n = 2, DPMPStrategy(dp=1, mp=2, timeout=timedelta(minutes=1)), LaterCompiled(), 8
    else:
        strategy = DPMPStrategy(dp=1, mp=2, plan_overrides={"nte": "column"}, timeout=timedelta(minutes=1))
        devices, model, n = 2, Odd(), 8
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(TensorDataset(torch.randn(n, 3)), batch_size=1))
    print(f"[rank {trainer.global_rank}] DONE")


if __name__ == "__main__":
    main()
