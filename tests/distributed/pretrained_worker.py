"""One multi-process launch per layout: fine-tune tiny transformers checkpoints loaded with
``lightning_dpmp.from_pretrained`` (each rank reading only its slices) and record what the pytest side compares.

For each case: whether the model was still on the meta device after ``from_pretrained``, the largest difference
between every tensor this rank holds right after the load and its slice of the file (exactly 0 when right), the
trained checkpoint, an export written with ``strategy.save_pretrained`` while the model is split, and which ranks
hold the plain model after ``fit`` (``consolidate_on_teardown="rank0"``). A case ``<model>+again`` fits a second
time on the same module (its weights then come from rank 0); ``+z3`` trains at zero=3; ``+sharded`` reads a
sharded index; ``<model>@generate`` runs ``trainer.validate`` with a step that generates.

Usage (from the repo root): python tests/distributed/pretrained_worker.py DP MP OUT_DIR CASE[,CASE...]
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import lightning_dpmp  # noqa: E402
from lightning_dpmp import DPMPStrategy  # noqa: E402
from lightning_dpmp.checkpoint.weights import WeightFiles, match_keys  # noqa: E402
from lightning_dpmp.integration.accounting import CommCounter  # noqa: E402
from lightning_dpmp.parallel.dtensor_params import local_tensor  # noqa: E402
from lightning_dpmp.parallel.sharding import shard_blocks, shard_dims, shard_tensor  # noqa: E402
from tests.support import pretrained as P  # noqa: E402

GLOBAL_BATCH, STEPS, CLIP, SEED = 8, 20, 0.5, 0
AGAIN_STEPS = (6, 4)  # a first fit, then a second on the same module
COUNTED_STEP = 3  # the MP collectives of this training step are counted


class AfterLoad(L.Callback):
    """Right after the split and the load: this rank's tensors against its slices of the file; at the end of the
    fit, an export while the model is still split."""

    def __init__(self, path: str, export: str, load_kwargs: Optional[dict] = None) -> None:
        self.path, self.export, self.load_diff, self.read, self.mode = path, export, None, {}, None
        self.load_kwargs = load_kwargs or {}

    def on_fit_start(self, trainer, pl_module):
        if self.load_diff is not None:
            return
        net, files = pl_module.net, WeightFiles(self.path)
        net = getattr(net, "base_model", net)  # peft: PeftModel -> LoraModel
        net = getattr(net, "model", net)  # the transformers model the checkpoint holds
        names = match_keys(net, files.keys(), getattr(net, "base_model_prefix", None))
        dims, blocks = shard_dims(net), shard_blocks(net)
        grid = trainer.strategy.grid
        worst = 0.0
        # Tensors the file stores in another layout (Mixtral's per-expert w1/w3 -> one stacked gate_up_proj): what
        # transformers' own from_pretrained makes of them, in this process, is the truth they are compared with.
        converted = {}
        if any(k not in names and "lora_" not in k for k in net.state_dict()):
            converted = type(net).from_pretrained(self.path, **self.load_kwargs).state_dict()
        self.read["converted_tensors"] = sum(1 for k in converted if k not in names)
        with trainer.strategy.parameters_whole():  # zero=3: the MP-local parameters exist only inside
            for key, t in net.state_dict().items():
                if key not in names and key not in converted:  # an adapter: not in the checkpoint
                    assert "lora_" in key, f"{key} is neither in {self.path} nor an adapter"
                    continue
                full = (files.read(names[key]) if key in names else converted[key]).to(t.dtype)
                want = shard_tensor(full, dims[key], grid.mp, grid.mp_rank, blocks.get(key, 1)) if key in dims else full
                worst = max(worst, (local_tensor(t) - want).abs().max().item())  # this rank's shard
        self.load_diff = worst
        self.read.update(split_tensors=sum(1 for k in net.state_dict() if k in dims))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == COUNTED_STEP:
            self.mode = CommCounter({"mp": trainer.strategy.grid.mp_group})
            self.mode.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.read["step_counts"] = {f"{g}/{op}": n for (g, op), n in self.mode.counts.items()}
            self.mode = None

    def on_train_end(self, trainer, pl_module):
        grid, dims = trainer.strategy.grid, shard_dims(pl_module)
        same = True  # every parameter that is not split is the same bit for bit on every MP rank
        with trainer.strategy.parameters_whole():
            for name, p in pl_module.named_parameters():
                p = local_tensor(p)
                if grid.mp > 1 and name not in dims:
                    parts = [torch.empty_like(p) for _ in range(grid.mp)]
                    dist.all_gather(parts, p.detach().contiguous(), group=grid.mp_group)
                    same &= all(torch.equal(parts[0], q) for q in parts)
        self.read["mp_replicated_bitwise_equal"] = same
        if self.export:
            trainer.strategy.save_pretrained(pl_module.net, self.export, max_shard_size="30KB")


def trainer_for(dp: int, mp: int, zero: int, steps: int, callbacks: list) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=dp * mp,
        strategy=DPMPStrategy(dp=dp, mp=mp, zero=zero, timeout=timedelta(minutes=5)),
        precision="64-true", max_steps=steps, gradient_clip_val=CLIP, gradient_clip_algorithm="norm",
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=callbacks,
    )


class CountValidation(L.Callback):
    """MP collectives of the whole (generating) validation batch."""

    def __init__(self) -> None:
        self.mode, self.counts = None, {}

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self.mode = CommCounter({"mp": trainer.strategy.grid.mp_group})
        self.mode.__enter__()

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.mode.__exit__(None, None, None)
        self.counts = {f"{g}/{op}": n for (g, op), n in self.mode.counts.items()}


def generate(dp: int, mp: int, path: str) -> dict:
    """``trainer.validate`` whose step generates: the tokens, the plan and the MP collectives of the batch."""
    counter = CountValidation()
    strategy = DPMPStrategy(dp=dp, mp=mp, timeout=timedelta(minutes=5))
    trainer = L.Trainer(accelerator="cpu", devices=dp * mp, strategy=strategy,
                        precision="64-true", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=1, callbacks=[counter])
    model = P.GenerateLM(lightning_dpmp.from_pretrained(P.model_class("llama"), path))
    trainer.validate(model, DataLoader(P.dataset(), batch_size=2))
    plan = trainer.strategy.applied_plan
    return {"tokens": model.generated, "counts": counter.counts, "plan_text": plan.text,
            "styles": {n: lp.style for n, lp in plan.plan.layers.items()}}


def run(dp: int, mp: int, out: str, case: str) -> dict:
    L.seed_everything(SEED, workers=True)
    if case.endswith("@generate"):
        return generate(dp, mp, os.path.join(out, "..", "pretrained", P.base(case)))
    path = os.path.join(out, "..", "pretrained", P.checkpoint_case(case))
    export = os.path.join(out, f"{case}_export") if "+lora" not in case else ""  # adapters: no Hugging Face export
    probe = AfterLoad(path, export, P.load_kwargs(case))
    again = "+again" in case
    trainer = trainer_for(dp, mp, 3 if "+z3" in case else 0, AGAIN_STEPS[0] if again else STEPS, [probe])
    net = lightning_dpmp.from_pretrained(P.model_class(case), path, **P.load_kwargs(case))  # after the Trainer: lazy
    lazy = all(p.is_meta for p in net.parameters())
    model = P.lightning_module(case, net)
    loader = DataLoader(P.dataset(), batch_size=GLOBAL_BATCH // dp)
    trainer.fit(model, loader)
    kept = {"rank_holds_model": not any(p.is_meta for p in model.parameters())}
    if again:
        probe.export = ""
        trainer = trainer_for(dp, mp, 0, AGAIN_STEPS[1], [])
        trainer.fit(model, loader)
    trainer.save_checkpoint(os.path.join(out, f"{case}.ckpt"))
    plan = trainer.strategy.applied_plan
    return {"lazy": lazy, "load_diff": probe.load_diff, **probe.read, **kept,
            "styles": {n: lp.style for n, lp in plan.plan.layers.items()}, "verified": plan.verified,
            "comm": plan.plan.comm_per_step(), "per_block": plan.plan.per_block(), "plan_text": plan.text}


if __name__ == "__main__":
    torch.set_num_threads(1)
    dp, mp, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    results = {case: run(dp, mp, out, case) for case in sys.argv[4].split(",")}
    rank = dist.get_rank() if dist.is_initialized() else 0
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=1)
