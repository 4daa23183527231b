"""``16-mixed`` across the grid (issue 22): an inf in one MP rank's gradient shard at one step.

Usage: python tests/distributed/fp16_worker.py DP MP OUT_DIR ZERO[,ZERO...]
  ResMLP, 8 AdamW steps in fp16 autocast with a GradScaler on CPU (the plugin given explicitly: Lightning turns
  ``precision="16-mixed"`` into bf16 on CPU); at step 3, global rank 1 (DP rank 0, MP rank 1) writes
  an inf into one gradient element of an MP-split weight before the scaler unscales. Each rank writes, per step,
  the loss scale after the step and its optimizer's step count, and its final parameters, as JSON; and what
  ``trainer.strategy.device_mesh`` is (shape, names, groups, a DTensor gathered over its "mp" dim).
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
from lightning.pytorch.plugins import MixedPrecision  # noqa: E402
from torch.distributed.tensor import DTensor, Shard  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_dpmp import DPMPStrategy  # noqa: E402
from lightning_dpmp.parallel.dtensor_params import local_tensor  # noqa: E402
from lightning_dpmp.parallel.sharding import shard_dims  # noqa: E402
from tests.distributed.parity_worker import GLOBAL_BATCH, SEED  # noqa: E402
from tests.support.models import build  # noqa: E402

STEPS, POISONED_STEP, POISONED_RANK = 8, 3, 1


class Poison(L.Callback):
    """After the backward of step 3, one element of an MP-split weight's gradient becomes inf on one rank."""

    def __init__(self) -> None:
        self.scales: list[float] = []
        self.steps: list[int] = []

    def on_after_backward(self, trainer, pl_module):
        if trainer.global_step == POISONED_STEP and dist.get_rank() == POISONED_RANK:
            engine = trainer.strategy.zero_engine
            if engine is not None:  # zero=2/3: the gradients are DP shards by now
                name, p = "the first MP-split DP shard", engine.shard_params("split")[0]
            else:
                split = set(shard_dims(pl_module))
                name, p = next((n, p) for n, p in pl_module.named_parameters() if n in split)
            local_tensor(p.grad).view(-1)[0] = float("inf")  # this rank's shard of the gradient
            print(f"rank {POISONED_RANK}: inf written into {name}.grad at step {POISONED_STEP}", flush=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        opt = trainer.optimizers[0]
        inner = getattr(opt, "optim", opt)
        counts = [int(s["step"]) for s in inner.state.values() if "step" in s]
        self.steps.append(max(counts) if counts else 0)
        self.scales.append(float(trainer.precision_plugin.scaler.get_scale()))


def fit(dp: int, mp: int, zero: int) -> dict:
    L.seed_everything(SEED, workers=True)
    model, dataset = build("resmlp")
    poison = Poison()
    trainer = L.Trainer(
        accelerator="cpu", devices=dp * mp,
        strategy=DPMPStrategy(dp=dp, mp=mp, zero=zero, timeout=timedelta(minutes=2), consolidate_on_teardown=False),
        plugins=[MixedPrecision("16-mixed", "cpu")], max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False, callbacks=[poison],
    )
    trainer.fit(model, DataLoader(dataset, batch_size=GLOBAL_BATCH // dp))
    mesh, grid = trainer.strategy.device_mesh, trainer.strategy.grid
    # DTensor over our MP group: a tensor sharded by MP rank, gathered whole
    local = torch.full((2,), float(grid.mp_rank))
    whole = DTensor.from_local(local, mesh["mp"], [Shard(0)]).full_tensor().tolist()
    with trainer.strategy.parameters_whole():
        params = {n: p.detach().double().reshape(-1).tolist() for n, p in model.named_parameters()}
    return {"scales": poison.scales, "steps": poison.steps, "params": params, "mesh": {
        "shape": list(mesh.shape), "names": list(mesh.mesh_dim_names), "dtensor_mp": whole,
        "groups": [mesh["dp"].get_group() is grid.dp_group, mesh["mp"].get_group() is grid.mp_group],
        "coordinate": list(mesh.get_coordinate()), "grid": [grid.dp_rank, grid.pp_rank, grid.mp_rank]}}


if __name__ == "__main__":
    torch.set_num_threads(1)
    dp, mp, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    res = {f"z{z}": fit(dp, mp, int(z)) for z in sys.argv[4].split(",")}
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(res, f)
