"""One multi-process launch per layout: train ResMLP under DPMPStrategy in float64 and float32, and record
collective counts, plan figures and cross-rank consistency for the pytest side to compare with its reference.

Usage (from the repo root): python tests/distributed/parity_worker.py DP MP OUT_DIR [MODEL,MODEL,...]
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_dpmp import DPMPStrategy  # noqa: E402
from lightning_dpmp.integration.accounting import CommCounter  # noqa: E402
from lightning_dpmp.parallel.dtensor_params import local_tensor  # noqa: E402
from lightning_dpmp.parallel.sharding import shard_dims  # noqa: E402
from tests.support.models import build  # noqa: E402

GLOBAL_BATCH, STEPS, CLIP, SEED = 8, 20, 0.5, 0


class Probe(L.Callback):
    """Counts MP collectives of one whole training step and checks replicas bit for bit at the end."""

    def __init__(self, step: int = 3) -> None:
        self.step, self.mode, self.counts, self.bytes, self.consistent = step, None, {}, {}, {}
        self.drop_sequence_sync = False
        self.save_to = ""
        self.local_params: dict = {}

    def on_train_start(self, trainer, pl_module):
        if self.drop_sequence_sync:
            trainer.strategy.parallelized.partial_grads.clear()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            grid = trainer.strategy.grid
            self.mode = CommCounter({"mp": grid.mp_group, "dp": grid.dp_group})
            self.mode.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.counts = {f"{g}/{op}": n for (g, op), n in self.mode.counts.items()}
            self.bytes = {f"{g}/{op}": n for (g, op), n in self.mode.bytes.items()}
            self.mode = None

    def on_train_end(self, trainer, pl_module):
        dims = shard_dims(pl_module)  # parameter name -> (numel held here, split over MP, the dim it is split on)
        self.local_params = {n: (local_tensor(p).numel(), n in dims, dims.get(n))
                             for n, p in pl_module.named_parameters()}
        if self.save_to:  # a save while the model is still split: the gather path, not the consolidated teardown
            trainer.save_checkpoint(self.save_to)
        grid = trainer.strategy.grid
        with trainer.strategy.parallelized.whole():  # zero=3: the parameters hold their values only inside
            self.consistent = self._replicas_equal(pl_module, grid, dims)

    @staticmethod
    def _replicas_equal(pl_module, grid, dims) -> dict:
        dp_ok = mp_ok = True
        for name, p in pl_module.named_parameters():
            p = local_tensor(p)  # this rank's shard (a DTensor parameter's local tensor)
            for group, size, check in ((grid.dp_group, grid.dp, True), (grid.mp_group, grid.mp, name not in dims)):
                if size == 1 or not check:
                    continue
                parts = [torch.empty_like(p) for _ in range(size)]
                dist.all_gather(parts, p.detach().contiguous(), group=group)
                same = all(torch.equal(parts[0], q) for q in parts)
                if group is grid.dp_group:
                    dp_ok &= same
                else:
                    mp_ok &= same
        return {"dp_replicas_bitwise_equal": dp_ok, "mp_replicated_bitwise_equal": mp_ok}


def run(dp: int, mp: int, precision: str, out: str, name: str) -> dict:
    L.seed_everything(SEED, workers=True)
    base, _, variant = name.partition("+")
    model, dataset = build(base)
    probe = Probe()
    zero, _, dtype = variant.partition("_")  # +zero, +zero3, +zero3_bf16: mixed precision (compute, reduce)
    policy = {"bf16": (torch.bfloat16, torch.float32), "fp32": (torch.float32, torch.float64)}.get(dtype)
    strategy = DPMPStrategy(dp=dp, mp=mp, timeout=timedelta(minutes=2),
                            sequence_parallel=variant in ("sp", "sp_nosync"),
                            verify_plan=variant != "noverify", compile=variant == "compile",
                            zero=int(zero[4:] or 1) if zero.startswith("zero") else 0,
                            mixed_precision=MixedPrecisionPolicy(*policy) if policy else None)
    if variant == "sp_nosync":  # the bug sequence parallelism invites: never summing the partial gradients
        probe.drop_sequence_sync = True
    trainer = L.Trainer(
        accelerator=os.environ.get("DPMP_TEST_ACCELERATOR", "cpu"), devices=dp * mp, strategy=strategy,
        precision=precision, max_steps=STEPS,
        gradient_clip_val=CLIP, gradient_clip_algorithm="norm", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[probe],
    )
    loader = DataLoader(dataset, batch_size=GLOBAL_BATCH // dp)
    probe.save_to = os.path.join(out, f"{name}_{precision.split('-')[0]}_split.ckpt")
    with warnings.catch_warnings(record=True) as caught:  # the package's warnings are results (shown too)
        warnings.simplefilter("always")
        trainer.fit(model, loader)
    for w in caught:
        warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    tag = f"{name}_{precision.split('-')[0]}"
    trainer.save_checkpoint(os.path.join(out, f"{tag}.ckpt"))
    plan = strategy.applied_plan.plan
    return {
        "plan_text": strategy.applied_plan.text,
        "counts": probe.counts,
        "bytes": probe.bytes,
        "analytic": plan.comm_per_step(),
        "partial": plan.partial_params,
        "per_block": plan.per_block(),
        "styles": {n: lp.style for n, lp in plan.layers.items()},
        "notes": {n: lp.note for n, lp in plan.layers.items()},
        "verified": strategy.applied_plan.verified,
        "warnings": sorted({w.category.__name__ for w in caught if w.category.__module__.startswith("lightning_dpmp")}),
        "consistent": probe.consistent,
        "dense_after_fit": not shard_dims(model),
        "frozen_after_fit": sorted(n for n, p in model.named_parameters() if not p.requires_grad),
        "local_params": probe.local_params,
        "sampler": (
            trainer.train_dataloader.sampler.num_replicas if hasattr(trainer.train_dataloader, "sampler") else None
        ),
    }


if __name__ == "__main__":
    torch.set_num_threads(1)
    dp, mp, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    names = sys.argv[4].split(",") if len(sys.argv) > 4 else ["resmlp"]
    precisions = os.environ.get("PRECISIONS", "64-true,32-true").split(",")
    results = {f"{n}_{p.split('-')[0]}": run(dp, mp, p, out, n) for n in names for p in precisions}
    rank = dist.get_rank() if dist.is_initialized() else 0
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=1)
