"""What a user does with the model once ``fit`` returns, for tests/distributed/test_after_fit.py.

Usage (from the repo root; 4 processes):
    python tests/distributed/after_fit_worker.py PP OUT CASE[,CASE...]

``PP`` 1 runs (dp, pp, mp) = (2, 1, 2), ``PP`` 2 runs (2, 2, 1). A case is ``z<level>:<consolidate>`` with
``<consolidate>`` one of ``rank0``, ``true``, ``false`` (``consolidate_on_teardown``). Each case, on GPT (tied
embeddings, float64) under ``DPMPStrategy(save_distributed_checkpoint=True)``:

1. ``fit`` for ``STEPS`` steps; what each rank holds afterwards (meta, plain or split tensors; parameter and
   optimizer-state bytes) is recorded, and rank 0 writes its module's weights (``<case>_weights.pt``) when they
   are plain;
2. ``trainer.save_checkpoint`` in both formats: ``<case>_s.ckpt`` (a sharded folder) and ``<case>_c.ckpt``;
3. ``trainer.validate``, ``trainer.test`` and ``trainer.predict`` on the same trainer (their logged losses, and
   each rank's predictions with the sample indices its DP rank saw);
4. a second ``fit`` of ``MORE`` steps on the same module with a new Trainer, then a consolidated save
   (``<case>_again.ckpt``);
5. with ``+resume`` (``z3:rank0+resume``): a fresh model resumes ``<case>_s.ckpt`` to ``STEPS + MORE`` steps and
   saves ``<case>_resumed.ckpt`` (consolidated).
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
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_dpmp import DPMPStrategy  # noqa: E402
from lightning_dpmp.parallel.sharding import shard_dims  # noqa: E402
from tests.support.models import LMModule, build, make_lm_dataset  # noqa: E402

STEPS, MORE, GLOBAL_BATCH, SEED, MICROBATCHES = 4, 2, 8, 0, 4
EVAL_ROWS = 16  # validation/test/predict: one batch per DP rank
CONSOLIDATE = {"rank0": "rank0", "true": True, "false": False}


class EvalLM(LMModule):
    """LMModule with validation, test and predict steps: the mean token loss over DP, and per-sample logits sums."""

    def _loss(self, batch):
        x, y = batch[0], batch[1]
        logits = self(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), sync_dist=True)  # (a mean: MP replicas agree)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._loss(batch), sync_dist=True)  # (a mean: MP replicas agree)

    def predict_step(self, batch, batch_idx):
        x, _, index = batch
        return index, self(x).sum(-1)  # (B, T): every logit contributes


def eval_data() -> TensorDataset:
    x, y = make_lm_dataset(n=EVAL_ROWS, seed=99).tensors
    return TensorDataset(x, y, torch.arange(EVAL_ROWS))


def make_trainer(layout: tuple[int, int, int], zero: int, consolidate, steps: int) -> L.Trainer:
    dp, pp, mp = layout
    strategy = DPMPStrategy(dp=dp, pp=pp, mp=mp, zero=zero, consolidate_on_teardown=consolidate,
                            save_distributed_checkpoint=True, timeout=timedelta(minutes=2),
                            **({"pp_microbatches": MICROBATCHES} if pp > 1 else {}))
    return L.Trainer(accelerator="cpu", devices=dp * pp * mp, strategy=strategy, precision="64-true", max_steps=steps,
                     logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def holdings(model: torch.nn.Module, trainer: L.Trainer) -> dict:
    """What this rank holds: meta or real parameters, split or plain layers, bytes of parameters and state."""
    params = list(model.parameters())
    state = [v for o in trainer.strategy.optimizers for s in o.state.values() for v in s.values()
             if isinstance(v, torch.Tensor) and v.dim()]
    return {
        "all_meta": all(p.is_meta for p in params), "any_meta": any(p.is_meta for p in params),
        "split": bool(shard_dims(model)),
        "param_bytes": sum(p.numel() * p.element_size() for p in params if not p.is_meta),
        "state_bytes": sum(v.numel() * v.element_size() for v in state if not v.is_meta),
        "state_meta": all(v.is_meta for v in state), "state_tensors": len(state),
        "checksum": float(sum(p.detach().double().sum() for p in params if not p.is_meta)),
    }


def save_both(trainer: L.Trainer, out: str, case: str) -> None:
    checkpointer = trainer.strategy.checkpointer
    trainer.save_checkpoint(os.path.join(out, f"{case}_s.ckpt"))  # the strategy's own format: sharded
    checkpointer.distributed = False
    try:
        trainer.save_checkpoint(os.path.join(out, f"{case}_c.ckpt"))
    finally:
        checkpointer.distributed = True


def run(pp: int, out: str, spec: str) -> dict:
    layout = (2, pp, 2 // pp)
    level, mode = spec.split("+")[0].split(":")
    zero, consolidate, case = int(level[1:]), CONSOLIDATE[mode], spec.replace(":", "_").replace("+", "_")
    rank = dist.get_rank() if dist.is_initialized() else 0
    L.seed_everything(SEED)
    net, data = build("gpt")
    model = EvalLM(net.net)
    trainer = make_trainer(layout, zero, consolidate, STEPS)
    trainer.fit(model, DataLoader(data, batch_size=GLOBAL_BATCH // layout[0]))
    rank = trainer.global_rank
    report: dict = {"after_fit": holdings(model, trainer)}
    if rank == 0 and not report["after_fit"]["split"]:
        torch.save(model.state_dict(), os.path.join(out, f"{case}_weights.pt"))
    save_both(trainer, out, case)
    evals = DataLoader(eval_data(), batch_size=EVAL_ROWS // layout[0])
    report["val_loss"] = trainer.validate(model, evals, verbose=False)[0]["val_loss"]
    report["test_loss"] = trainer.test(model, evals, verbose=False)[0]["test_loss"]
    predictions = trainer.predict(model, evals)
    report["predict"] = {int(i): row.tolist() for index, sums in predictions for i, row in zip(index, sums)}
    report["after_eval"] = holdings(model, trainer)
    again = make_trainer(layout, zero, consolidate, MORE)
    again.fit(model, DataLoader(data, batch_size=GLOBAL_BATCH // layout[0]))
    report["after_again"] = holdings(model, again)
    again.strategy.checkpointer.distributed = False
    again.save_checkpoint(os.path.join(out, f"{case}_again.ckpt"))
    if "+resume" in spec:
        L.seed_everything(SEED)
        fresh, _ = build("gpt")
        resumed = make_trainer(layout, zero, consolidate, STEPS + MORE)
        resumed.fit(EvalLM(fresh.net), DataLoader(data, batch_size=GLOBAL_BATCH // layout[0]),
                    ckpt_path=os.path.join(out, f"{case}_s.ckpt"))
        resumed.strategy.checkpointer.distributed = False
        resumed.save_checkpoint(os.path.join(out, f"{case}_resumed.ckpt"))
    return report


if __name__ == "__main__":
    torch.set_num_threads(1)
    pp_arg, out_dir = int(sys.argv[1]), sys.argv[2]
    reports = {spec: run(pp_arg, out_dir, spec) for spec in sys.argv[3].split(",")}
    with open(os.path.join(out_dir, f"pp{pp_arg}_rank{dist.get_rank()}.json"), "w") as f:
        json.dump(reports, f)
