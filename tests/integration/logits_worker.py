"""Logits under DPMPStrategy at dp=2 x mp=2, one launch (issue 12's checks).

Usage: python tests/integration/logits_worker.py OUT_DIR
  1. the ``mlp_digits`` experiment (composed from conf/, float64, 10 steps, validated with torchmetrics accuracy)
     with the automatic plan (its 10-class head stays whole) and with the head forced to ``vocab``;
  2. the tied GPT whose ``validation_step`` computes argmax / softmax / top-k of the logits on rank 0 only
     (after a vocab-parallel training step), with a sanity check and a validation run; torch's CommDebugMode and
     FlopCounterMode in training steps, and a full backward hook on the split head.
Each rank writes ``rank<r>.json``; rank 0 also writes the tensors it inspected and the trained weights (``.pt``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor.debug import CommDebugMode  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402
from torchmetrics.classification import MulticlassAccuracy  # noqa: E402

from lightning_dpmp import DPMPStrategy  # noqa: E402
from lightning_dpmp.integration.accounting import CommCounter  # noqa: E402
from tests.support.models import LMModule, build, make_lm_dataset  # noqa: E402

DP, MP = 2, 2
DIGITS_STEPS = 10  # 10 x 128 samples stay inside the first epoch (1437 images): no sampler padding to match
GPT_STEPS, GPT_BATCH, VAL_BATCH = 6, 8, 8
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def digits_config(tmp: str):
    """The ``mlp_digits`` experiment exactly as examples/train.py composes it."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import examples.config  # noqa: F401  (schemas and resolvers)

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=os.path.join(ROOT, "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=["experiment=mlp_digits", f"paths.output_dir={tmp}",
                                                        f"paths.cache_dir={tmp}/cache"])


def digits_parts(cfg):
    """(model, datamodule), seeded as examples/train.py seeds them."""
    from hydra.utils import instantiate

    L.seed_everything(cfg.seed)
    data = instantiate(cfg.data)
    model = instantiate(cfg.model, optimizer=instantiate(cfg.optimizer), scheduler=instantiate(cfg.scheduler))
    return model.double(), data


DIGITS_TRAINER = dict(precision="64-true", max_steps=DIGITS_STEPS, val_check_interval=DIGITS_STEPS,
                      check_val_every_n_epoch=None, limit_val_batches=None, gradient_clip_val=1.0, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


class RankZeroInspect(LMModule):
    """Validation inspects the logits on rank 0 only, the way users write debugging code; accuracy everywhere."""

    def __init__(self, net) -> None:
        super().__init__(net)
        self.acc = MulticlassAccuracy(num_classes=64, average="micro")
        self.inspected: list = []

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        if self.global_rank == 0:  # no other rank runs these lines
            self.inspected.append({"x": x, "shape": list(logits.shape), "argmax": logits.argmax(-1),
                                   "softmax": logits.softmax(-1), "topk": logits.topk(3, dim=-1).indices})
        self.acc.update(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        self.log("val_acc", self.acc, on_step=False, on_epoch=True)


class ToolsInspect(RankZeroInspect):
    """torch's own tools on vocab-parallel training steps, entered the way users enter them: ``CommDebugMode``
    around the third step's forward and loss (in ``training_step``) and around its backward (Lightning's backward
    hooks), the project's ``CommCounter`` inside it each time; ``FlopCounterMode`` around the fourth step's forward
    and loss; and a full backward hook on the split LM head."""

    def __init__(self, net) -> None:
        super().__init__(net)
        self.tools: dict = {"hook_calls": 0, "torch_counts": {}, "our_counts": {}}
        self.modes: list = []

    def on_train_start(self):
        def hook(module, grad_input, grad_output):
            self.tools["hook_calls"] += 1
            self.tools["hook_grad_shape"] = list(grad_output[0].shape)

        self.net.lm_head.register_full_backward_hook(hook)

    def _enter(self) -> None:
        grid = self.trainer.strategy.grid
        self.modes = [CommDebugMode(), CommCounter({"mp": grid.mp_group, "dp": grid.dp_group})]
        for mode in self.modes:
            mode.__enter__()

    def _exit(self) -> None:
        for mode in reversed(self.modes):
            mode.__exit__(None, None, None)
        torch_comm, ours = self.modes
        for key, n in torch_comm.get_comm_counts().items():
            self.tools["torch_counts"][str(key)] = self.tools["torch_counts"].get(str(key), 0) + n
        for (g, op), n in ours.counts.items():
            self.tools["our_counts"][f"{g}/{op}"] = self.tools["our_counts"].get(f"{g}/{op}", 0) + n
        self.modes = []

    def training_step(self, batch, batch_idx):
        if batch_idx == 2:
            self._enter()
            loss = super().training_step(batch, batch_idx)
            self._exit()
            return loss
        if batch_idx == 3:
            with FlopCounterMode(display=False) as flops:
                loss = super().training_step(batch, batch_idx)
            self.tools["flops"] = flops.get_total_flops()
            return loss
        return super().training_step(batch, batch_idx)

    def on_before_backward(self, loss):
        if self.trainer.global_step == 2:
            self._enter()

    def on_after_backward(self):
        if self.modes:
            self._exit()


def main(out: str) -> None:
    res: dict = {}
    for key, plan in (("auto", None), ("vocab", {"net.head": "vocab"})):
        cfg = digits_config(os.path.join(out, "hydra"))
        model, data = digits_parts(cfg)
        strategy = DPMPStrategy(dp=DP, mp=MP, plan_overrides=plan, timeout=timedelta(minutes=1))
        t = L.Trainer(accelerator="cpu", devices=DP * MP, strategy=strategy, num_sanity_val_steps=2, **DIGITS_TRAINER)
        t.fit(model, datamodule=data)
        res[f"digits_{key}"] = {"acc": float(t.callback_metrics["val/acc"]),
                                "loss": float(t.callback_metrics["val/loss"]),
                                "head": t.strategy.applied_plan.plan.layers["net.head"].style,
                                "note": t.strategy.applied_plan.plan.layers["net.head"].note}
        if dist.get_rank() == 0:
            torch.save(model.state_dict(), os.path.join(out, f"digits_{key}.pt"))

    L.seed_everything(0)
    base, ds = build("gpt")
    model = ToolsInspect(base.net).double()
    val = DataLoader(make_lm_dataset(n=32, seed=99), batch_size=VAL_BATCH)
    timing: dict = {}

    class Clock(L.Callback):
        def on_sanity_check_start(self, tr, pm):
            timing["t0"] = time.perf_counter()

        def on_validation_end(self, tr, pm):
            timing["validation_s"] = time.perf_counter() - timing["t0"]

        def on_validation_start(self, tr, pm):
            if not tr.sanity_checking:
                timing["t0"] = time.perf_counter()

    strategy = DPMPStrategy(dp=DP, mp=MP, timeout=timedelta(seconds=30))
    t = L.Trainer(accelerator="cpu", devices=DP * MP, strategy=strategy,
                  precision="64-true", max_steps=GPT_STEPS, val_check_interval=GPT_STEPS, check_val_every_n_epoch=None,
                  num_sanity_val_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, callbacks=[Clock()])
    started = time.perf_counter()
    t.fit(model, DataLoader(ds, batch_size=GPT_BATCH), val)
    res["gpt"] = {"styles": {n: lp.style for n, lp in t.strategy.applied_plan.plan.layers.items()},
                  "acc": float(t.callback_metrics["val_acc"]), "validation_s": timing["validation_s"],
                  "fit_s": time.perf_counter() - started, "inspected": len(model.inspected), "tools": model.tools}
    if dist.get_rank() == 0:
        torch.save({"inspected": model.inspected, "state_dict": model.state_dict()}, os.path.join(out, "gpt.pt"))
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1])
