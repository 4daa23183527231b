"""ZeRO-2/3 checks, several trainers per launch (issue 14).

Usage: python tests/distributed/zero_worker.py DP MP OUT_DIR [RESUME_DIR]
  every layout: resmlp and gpt at zero=2 and zero=3 (20 AdamW steps, norm clipping, float64): consolidated
    checkpoint, DP collectives of one step, bytes held per rank after a step (from the tensors) and memory_report;
  (2, 2): also gradient accumulation 2 at zero=2 and zero=3, and a zero=3 run (AdamW + StepLR) of 10 steps saved
    in on_train_end (still sharded) as a consolidated file ``mid_c.ckpt`` and a sharded folder ``mid_s.ckpt``;
    Then, at zero=3, the GPT with frozen attention, the GPT with sequence parallelism and the consistency guard,
    and one built on the meta device (``init_module(empty_init=True)``) trained in bf16-mixed;
  (4, 1) with RESUME_DIR: zero=2 resumes the sharded (2,2,zero=3) checkpoint, zero=0 the consolidated one, to 20;
    zero=3 resumes a (4,1,zero=0) checkpoint of 10 steps.
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
from lightning_dpmp.integration.accounting import CommCounter  # noqa: E402
from tests.distributed.checkpoint_worker import SaveAtTrainEnd, SchedResMLP  # noqa: E402
from tests.distributed.parity_worker import CLIP, GLOBAL_BATCH, SEED, STEPS  # noqa: E402
from tests.support.models import build, make_dataset  # noqa: E402


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        # (a DTensor parameter or gradient: its local tensor's storage, read without dispatch; a user's read of it
        # would gather a freed one)
        st = getattr(t, "_local_tensor", t).untyped_storage()
        if st.nbytes() and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


class Probe(L.Callback):
    """DP collectives of step 3 (forward, backward and optimizer step) and bytes held after step 4."""

    def __init__(self) -> None:
        self.counter = None
        self.res: dict = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 3 and self.counter is None and "counts" not in self.res:
            g = trainer.strategy.grid
            self.counter = CommCounter({"dp": g.dp_group, "mp": g.mp_group}).__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.counter is not None and trainer.global_step == 4:
            self.counter.__exit__(None, None, None)
            self.res["counts"] = {f"{g}/{op}": n for (g, op), n in self.counter.counts.items()}
            self.counter = None
        engine = trainer.strategy.zero_engine
        if trainer.global_step == 5 and "held" not in self.res and engine is not None:
            shards = engine.shard_params() + [b.shard for b in engine.buckets if not b.trainable]
            params = list(pl_module.parameters()) + shards
            opt = trainer.strategy.optimizers[0]
            state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]
            self.res["held"] = {
                "parameters": _storage_bytes(params),
                "gradients": _storage_bytes([p.grad for p in params if p.grad is not None]),
                "optimizer_state": _storage_bytes(state),  # the moments (the scalar step counts are not state bytes)
            }
            self.res["report"] = trainer.strategy.memory_report()
            self.res["buckets"] = {
                "total": len([b for b in engine.buckets if b.trainable]),
                "root": len([b for b in engine.buckets if b.unit < 0]),
                "child": len([b for b in engine.buckets if b.unit >= 0]),
                # units: the collectives' unit (one coalesced gather / reduce-scatter per unit)
                "units": len({b.unit for b in engine.buckets if b.trainable}),
                "child_units": len({b.unit for b in engine.buckets if b.unit >= 0}),
            }
            local = [getattr(p, "_local_tensor", p) for p in pl_module.parameters()]  # (a DTensor's MP shard)
            self.res["local_numel"] = sum(t.numel() * t.element_size() for t in local)


def fit(dp, mp, name, zero, out, tag, steps=STEPS, accumulate=1, ckpt_path=None, callbacks=(), precision="64-true",
        meta=False, **strategy_kw):
    L.seed_everything(SEED, workers=True)
    if not meta:  # built right after seeding, as the single-process reference builds it
        model, dataset = (SchedResMLP(), make_dataset()) if name == "sched" else build(name)  # sched: AdamW + StepLR
    strategy = DPMPStrategy(dp=dp, mp=mp, timeout=timedelta(minutes=2), zero=zero, **strategy_kw)
    probe = Probe()
    callbacks = [probe, *callbacks]
    trainer = L.Trainer(
        accelerator="cpu", devices=dp * mp, strategy=strategy, precision=precision, max_steps=steps,
        accumulate_grad_batches=accumulate, gradient_clip_val=CLIP, gradient_clip_algorithm="norm", logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )
    if meta:  # Trainer.init_module(empty_init=True): each rank materialises only its MP shard, then its 1/dp of it
        dataset = build(name)[1]  # the data are real tensors
        with trainer.init_module(empty_init=True):
            model, _ = build(name)
    trainer.fit(model, DataLoader(dataset, batch_size=GLOBAL_BATCH // dp // accumulate), ckpt_path=ckpt_path)
    trainer.save_checkpoint(os.path.join(out, f"{tag}.ckpt"))  # after fit: dense again, consolidated
    return probe.res


def main(dp: int, mp: int, out: str, resume: str) -> dict:
    res: dict = {}
    for name in ("resmlp", "gpt"):
        for zero in (2, 3):
            res[f"{name}_z{zero}"] = fit(dp, mp, name, zero, out, f"{name}_z{zero}")
    if (dp, mp) == (2, 2):
        for zero in (2, 3):
            res[f"accum_z{zero}"] = fit(dp, mp, "resmlp", zero, out, f"accum_z{zero}", accumulate=2)
        save = SaveAtTrainEnd([(True, os.path.join(out, "mid_s.ckpt")), (False, os.path.join(out, "mid_c.ckpt"))])
        fit(dp, mp, "sched", 3, out, "mid", steps=STEPS // 2, callbacks=[save])
        res["gpt_frozen_z3"] = fit(dp, mp, "gpt_frozen", 3, out, "gpt_frozen_z3")  # frozen attention: gathered only
        # sequence parallelism and the consistency guard (every 5 steps, gathering the parameters to check them)
        res["gpt_sp_z3"] = fit(dp, mp, "gpt", 3, out, "gpt_sp_z3", sequence_parallel=True,
                               check_consistency_every_n_steps=5)
        losses: list = []

        class Losses(L.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                losses.append(float(outputs["loss"]))

        res["meta_bf16_z3"] = fit(dp, mp, "gpt", 3, out, "meta_bf16_z3", precision="bf16-mixed", meta=True,
                                  callbacks=[Losses()])
        res["meta_bf16_z3"]["losses"] = losses
    if resume:
        fit(dp, mp, "sched", 2, out, "resume_z2", ckpt_path=os.path.join(resume, "mid_s.ckpt"))
        fit(dp, mp, "sched", 0, out, "resume_z0", ckpt_path=os.path.join(resume, "mid_c.ckpt"))
        # and the other way: a zero=0 checkpoint (consolidated, saved in on_train_end) resumed at zero=3
        save = SaveAtTrainEnd([(False, os.path.join(out, "mid_z0_c.ckpt"))])
        fit(dp, mp, "sched", 0, out, "mid_z0", steps=STEPS // 2, callbacks=[save])
        fit(dp, mp, "sched", 3, out, "resume_z3", ckpt_path=os.path.join(out, "mid_z0_c.ckpt"))
    return res


if __name__ == "__main__":
    torch.set_num_threads(1)
    dp, mp, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    results = main(dp, mp, out, sys.argv[4] if len(sys.argv) > 4 else "")
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(results, f, indent=1)
