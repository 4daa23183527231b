"""Steps as people write them, traced and verified at setup (issue 27, items 4 and 5), one launch per layout.

Usage: python tests/integration/trace_worker.py DP MP OUT_DIR

Cases (each a ``fit``; results per rank in OUT_DIR/rank{r}.json):
  plain     ResMLP, float64: the reference plan and its collectives per step;
  lr        a step reading ``self.trainer.optimizers[0].param_groups[0]["lr"]`` and
            ``self.lr_schedulers().get_last_lr()`` (StepLR), scaling its loss by the schedule: float64, 10 steps;
  rank      ``loss * (1 + self.global_rank)``: setup must raise (caught here, timed) on every rank;
  stateful  a loss scaled by a call counter: even the plan that splits nothing disagrees, setup must raise;
  loader    a step reading ``len(self.trainer.train_dataloader)`` (None at setup): not traced, a warning says so;
  half      float16 parameters at precision 32-true: 2 steps, the plan must verify;
  f32loss   a float64 model whose loss is ``F.cross_entropy(logits.float(), y)``: float64, 10 steps;
  evalmode  a submodule left in eval mode before fit, whose forward adds a Linear only in train mode: the step is
            traced in the modes it trains in, so that Linear is not called (and not split).
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_dpmp import DPMPStrategy, PlanVerificationError  # noqa: E402
from lightning_dpmp.integration.accounting import CommCounter  # noqa: E402
from tests.support.models import ResMLP, make_dataset  # noqa: E402

STEPS = 10
BATCH = 8  # global batch; per DP rank BATCH // dp


class LRReading(ResMLP):
    """Reads the optimizer's and the scheduler's learning rate in the step, and scales its loss by their ratio to
    the initial one (so a wrong value would change the trained weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list[float]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        lr = self.trainer.optimizers[0].param_groups[0]["lr"]
        last = self.lr_schedulers().get_last_lr()[0]
        self.seen.append([lr, last])
        return F.cross_entropy(self(x), y) * (last / self.hparams.lr) * (lr / last)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class RankDependent(ResMLP):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y) * (1 + self.global_rank)


class CallCounting(ResMLP):
    """A step whose loss changes from one call to the next (the same on every rank): not reproducible."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.calls += 1
        return F.cross_entropy(self(x), y) * self.calls


class LoaderReading(ResMLP):
    """Reads the trainer's train dataloader, which Lightning sets up only after the strategy's setup."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y) * (len(self.trainer.train_dataloader) / 20)


class HalfInput(ResMLP):
    """float16 parameters (the module is ``.half()``) under precision 32-true: the batch is cast to them."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x.to(self.dtype)), y)


class Float32Loss(ResMLP):
    """A float64 model whose loss is computed in float32, as transformers' ``labels=`` loss does."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x).float(), y)


class EvalModeAux(ResMLP):
    """``aux`` runs only while its module is in train mode; the user puts it in eval mode before fit."""

    def __init__(self) -> None:
        super().__init__()
        self.aux = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))

    def forward(self, x):
        x = self.inp(x)
        if self.aux.training:
            x = x + self.aux(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class CountStep(L.Callback):
    """MP collectives of the third training step (forward, backward and optimizer step)."""

    def __init__(self) -> None:
        self.counter: CommCounter | None = None
        self.counts: dict[str, int] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 2:
            self.counter = CommCounter({"mp": trainer.strategy.grid.mp_group}).__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.counter is not None:
            self.counter.__exit__(None, None, None)
            self.counts = {f"{g}/{op}": n for (g, op), n in self.counter.counts.items()}
            self.counter = None


def weights(model: torch.nn.Module) -> dict:
    return {k: v.detach().double().tolist() for k, v in model.state_dict().items()}


def fit(dp: int, mp: int, model: L.LightningModule, precision: str, steps: int) -> dict:
    """Train ``model`` and return what the tests read: plan, verification, warnings, weights, collectives."""
    count = CountStep()
    strategy = DPMPStrategy(dp=dp, mp=mp, timeout=timedelta(minutes=2), consolidate_on_teardown=True)
    trainer = L.Trainer(accelerator="cpu", devices=dp * mp, strategy=strategy,
                        precision=precision, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[count])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        trainer.fit(model, DataLoader(make_dataset(), batch_size=BATCH // dp))
        seconds = time.perf_counter() - t0
    applied = trainer.strategy.applied_plan
    return {
        "styles": {n: lp.style for n, lp in applied.plan.layers.items()},
        "verified": applied.verified,
        "max_error": applied.max_error,
        "plan_text": applied.text,
        "warnings": sorted({w.category.__name__ for w in caught if w.category.__module__.startswith("lightning_dpmp")}),
        "counts": count.counts,
        "weights": weights(model),
        "seconds": seconds,
    }


def main(dp: int, mp: int, out: str) -> dict:
    res: dict = {}
    L.seed_everything(0)
    res["plain"] = fit(dp, mp, ResMLP(), "64-true", STEPS)

    L.seed_everything(0)
    m = LRReading()
    res["lr"] = fit(dp, mp, m, "64-true", STEPS)
    res["lr"]["seen"] = m.seen

    L.seed_everything(0)
    t0 = time.perf_counter()
    try:
        fit(dp, mp, RankDependent(), "64-true", STEPS)
        res["rank"] = {"raised": None}
    except PlanVerificationError as exc:  # every rank raises, together: none is left waiting in a collective
        res["rank"] = {"raised": type(exc).__name__, "message": str(exc), "seconds": time.perf_counter() - t0}

    L.seed_everything(0)
    t0 = time.perf_counter()
    try:
        fit(dp, mp, CallCounting(), "64-true", STEPS)
        res["stateful"] = {"raised": None}
    except PlanVerificationError as exc:
        res["stateful"] = {"raised": type(exc).__name__, "message": str(exc), "seconds": time.perf_counter() - t0}

    L.seed_everything(0)
    res["loader"] = fit(dp, mp, LoaderReading(), "64-true", 2)
    res["loader"].pop("weights")

    L.seed_everything(0)
    res["half"] = fit(dp, mp, HalfInput().half(), "32-true", 2)
    res["half"].pop("weights")

    L.seed_everything(0)
    res["f32loss"] = fit(dp, mp, Float32Loss(), "64-true", STEPS)

    L.seed_everything(0)
    m = EvalModeAux()
    m.aux.eval()
    res["evalmode"] = fit(dp, mp, m, "64-true", 2)
    res["evalmode"].pop("weights")
    return res


if __name__ == "__main__":
    torch.set_num_threads(1)
    dp, mp, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    results = main(dp, mp, out)
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(results, f)
