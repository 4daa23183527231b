"""Lightning features under DPMPStrategy, one launch per layout (issue 6's checks).

Usage: python tests/integration/features_worker.py DP MP OUT_DIR
  (2, 2): metrics over a 64-sample validation set, gradient accumulation and ZeRO-1 parity runs, a bf16 run;
  (1, 2): predictions, a manual-optimization run, and a meta-device model larger than a per-process budget.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from torchmetrics import CatMetric, SumMetric  # noqa: E402
from torchmetrics.classification import MulticlassAccuracy  # noqa: E402

from lightning_dpmp import DPMPStrategy  # noqa: E402
from lightning_dpmp.integration.accounting import CommCounter  # noqa: E402
from lightning_dpmp.integration.zero import optimizer_state_bytes  # noqa: E402
from tests.support.models import ResMLP, build, make_dataset  # noqa: E402

BUDGET_BYTES = 200 * 2**20  # the stated per-process budget for parameters in the meta-init check


class MetricsMLP(ResMLP):
    def __init__(self) -> None:
        super().__init__()
        self.n, self.cat, self.acc = SumMetric(), CatMetric(), MulticlassAccuracy(num_classes=3, average="micro")

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.n.update(float(len(y)))
        self.cat.update(logits.argmax(-1).float())
        self.acc.update(logits, y)
        self.log("val_n", float(len(y)), reduce_fx="sum", sync_dist=True, on_epoch=True)

    def on_validation_epoch_end(self):
        self.result = {"sum": float(self.n.compute()), "cat_len": int(self.cat.compute().numel()),
                       "acc": float(self.acc.compute())}


class ManualMLP(ResMLP):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        opt.step()


class BigMLP(L.LightningModule):
    """~67M parameters (268 MB in float32): more than BUDGET_BYTES in one process, half of it at mp=2."""

    def __init__(self, width: int = 2048, hidden: int = 8192) -> None:
        super().__init__()
        self.inp = nn.Linear(64, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, hidden), nn.GELU(),
                                                  nn.Linear(hidden, width)) for _ in range(2))
        self.head = nn.Linear(width, 4)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.inp(x)
        for b in self.blocks:
            h = h + b(h)
        return F.cross_entropy(self.head(h), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def trainer(dp: int, mp: int, **kw) -> L.Trainer:
    strategy_kw = {k: kw.pop(k) for k in ("zero",) if k in kw}
    defaults = dict(accelerator="cpu", devices=dp * mp, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
    # every rank reads the trained weights after fit: each keeps the plain model (the default keeps it on rank 0)
    strategy_kw = {"consolidate_on_teardown": True, **strategy_kw}
    strategy = DPMPStrategy(dp=dp, mp=mp, timeout=timedelta(minutes=2), **strategy_kw)
    return L.Trainer(strategy=strategy, **{**defaults, **kw})


def weights(model: nn.Module) -> dict:
    return {k: v.detach().double().tolist() for k, v in model.state_dict().items()}


def grid_checks(dp: int, mp: int, out: str) -> dict:
    res: dict = {}
    if (dp, mp) == (2, 2):
        L.seed_everything(0)
        m = MetricsMLP().double()
        t = trainer(dp, mp, precision="64-true")
        t.validate(m, DataLoader(make_dataset(64), batch_size=8))
        res["metrics"] = {**m.result, "logged_sum": float(t.callback_metrics["val_n"])}

        L.seed_everything(0)
        m = ResMLP()

        class CountDP(L.Callback):  # DP all-reduces over one optimizer step made of 2 micro-batches
            def on_train_batch_start(self, tr, pl_module, batch, batch_idx):
                if tr.global_step == 2 and batch_idx % 2 == 0:
                    self.c = CommCounter({"dp": tr.strategy.grid.dp_group, "mp": tr.strategy.grid.mp_group}).__enter__()

            def on_train_batch_end(self, tr, pl_module, outputs, batch, batch_idx):
                if getattr(self, "c", None) is not None and batch_idx % 2 == 1:
                    self.c.__exit__(None, None, None)
                    res["accumulation_dp_all_reduces"] = self.c.counts.get(("dp", "all_reduce"), 0)
                    self.c = None

        t = trainer(dp, mp, precision="64-true", max_steps=10, accumulate_grad_batches=2, gradient_clip_val=0.5,
                    callbacks=[CountDP()])
        t.fit(m, DataLoader(make_dataset(), batch_size=4 // dp * 2 // 2))  # 2 per rank per micro-batch
        res["accumulation_weights"] = weights(m)

        L.seed_everything(0)
        m = ResMLP()
        class StateBytes(L.Callback):  # measured while the optimizer still holds this rank's share
            def __init__(self, key):
                self.key = key

            def on_train_end(self, tr, pl_module):
                res[self.key] = optimizer_state_bytes(tr.strategy.optimizers[0])

        t = trainer(dp, mp, precision="64-true", max_steps=10, gradient_clip_val=0.5, zero=1,
                    callbacks=[StateBytes("zero_state_bytes")])
        t.fit(m, DataLoader(make_dataset(), batch_size=4))
        res["zero_weights"] = weights(m)
        t.save_checkpoint(os.path.join(out, "zero.ckpt"))  # after fit: consolidated from the ZeRO partitions
        L.seed_everything(0)
        m = ResMLP()
        t = trainer(dp, mp, precision="64-true", max_steps=10, gradient_clip_val=0.5,
                    callbacks=[StateBytes("plain_state_bytes")])
        t.fit(m, DataLoader(make_dataset(), batch_size=4))
        t.save_checkpoint(os.path.join(out, "plain.ckpt"))

        L.seed_everything(0)
        m = ResMLP()
        t = trainer(dp, mp, precision="64-true", max_steps=10, gradient_clip_val=0.05, gradient_clip_algorithm="value")
        t.fit(m, DataLoader(make_dataset(), batch_size=4))
        res["value_clip_weights"] = weights(m)

        L.seed_everything(0)
        m, ds = build("gpt")
        losses: list = []

        class Losses(L.Callback):
            def on_train_batch_end(self, tr, pl_module, outputs, batch, batch_idx):
                losses.append(float(outputs["loss"]))

        t = trainer(dp, mp, precision="bf16-mixed", max_steps=30, callbacks=[Losses()])
        t.fit(m, DataLoader(ds, batch_size=8))
        res["bf16_losses"] = losses
    else:
        L.seed_everything(0)
        m, ds = build("gpt")

        class Predict(type(m)):
            def predict_step(self, batch, batch_idx):
                return self(batch[0])

        m.__class__ = Predict
        t = trainer(dp, mp, precision="64-true")
        preds = t.predict(m.double(), DataLoader(ds, batch_size=8))
        torch.save(torch.cat(preds), os.path.join(out, f"preds_rank{dist.get_rank()}.pt"))

        L.seed_everything(0)
        m = ManualMLP()
        t = trainer(dp, mp, precision="64-true", max_steps=10)
        t.fit(m, DataLoader(make_dataset(), batch_size=8))
        res["manual_weights"] = weights(m)
        res["manual_styles"] = {n: lp.style for n, lp in t.strategy.applied_plan.plan.layers.items()}

        L.seed_everything(0)
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        class SetupPeak(L.Callback):  # after setup (materialised shards), before any gradient exists
            def on_fit_start(self, tr, pl_module):
                res["meta_setup_rss_growth"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base

        strategy = DPMPStrategy(dp=dp, mp=mp, timeout=timedelta(minutes=2), consolidate_on_teardown=False)
        t = L.Trainer(accelerator="cpu", devices=dp * mp, strategy=strategy, max_steps=2, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[SetupPeak()])
        with t.init_module(empty_init=True):
            big = BigMLP()
        full = sum(p.numel() * 4 for p in big.parameters())
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(16, 64, generator=g), torch.randint(0, 4, (16,), generator=g))
        t.fit(big, DataLoader(data, batch_size=4))
        res["meta"] = {
            "full_bytes": full, "local_bytes": sum(p.numel() * p.element_size() for p in big.parameters()),
            "rss_growth": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base,
            "finite": all(torch.isfinite(p).all().item() for p in big.parameters()),
        }
    return res


if __name__ == "__main__":
    torch.set_num_threads(1)
    dp, mp, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    results = grid_checks(dp, mp, out)
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(results, f)
