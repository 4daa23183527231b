"""Pipeline launches for tests/distributed/test_pipeline.py.

Usage (from the repo root):
    python tests/distributed/pipeline_worker.py DP PP MP OUT MODEL:SCHEDULE[:V|:acc2|:guard|:compile|:zN|:keep]...
    python tests/distributed/pipeline_worker.py resume OUT    # 4 processes: save at (1,2,2), resume at (2,1,2)
    python tests/distributed/pipeline_worker.py refuse OUT    # 2 processes: a step that cannot be cut
    python tests/distributed/pipeline_worker.py meta OUT      # 2 processes: meta-device init at (1,2,1), (2,1,1)
    python tests/distributed/pipeline_worker.py zero OUT      # 4 processes: ZeRO under a pipeline, saved and resumed
    python tests/distributed/pipeline_worker.py evaluate DP PP MP OUT   # evaluation stage by stage

The first form trains each model under DPMPStrategy(dp, mp, pp) with the schedule (``V`` stages per rank for
``interleaved``; ``acc2``: ``accumulate_grad_batches=2``; ``guard``: the consistency guard every 5 steps;
``compile``: ``compile=True``; ``zN``: ``zero=N``; ``sp``: ``sequence_parallel=True``; ``fp32``:
``MixedPrecisionPolicy(float32, float64)``; ``keep``: ``reshard_after_forward=False``), as parity_worker does
without a pipeline, and records the collectives and sends of one step, the analytic MP collectives, the stages and
the logged loss.
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
from lightning.pytorch.callbacks import BasePredictionWriter  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_dpmp import DPMPStrategy  # noqa: E402
from lightning_dpmp.integration.accounting import CommCounter  # noqa: E402
from lightning_dpmp.parallel.compiled import repeated_blocks  # noqa: E402
from lightning_dpmp.parallel.dtensor_params import local_tensor  # noqa: E402
from tests.distributed.checkpoint_worker import SaveAtTrainEnd  # noqa: E402
from tests.distributed.parity_worker import CLIP, GLOBAL_BATCH, SEED, STEPS  # noqa: E402
from tests.support.models import LMModule, build  # noqa: E402

MICROBATCHES = 4  # of each DP rank's batch of GLOBAL_BATCH // dp rows: 4 micro-batches of 2 or 1 rows


class SetupSteps(L.Callback):
    """How many times the step ran at setup on this rank (issue 43 item 4): forwards of the first repeated block
    between the callbacks' setup (before the strategy's) and ``on_train_start``."""

    def __init__(self) -> None:
        self.count, self.handle = 0, None

    def setup(self, trainer, pl_module, stage):
        block = repeated_blocks(pl_module)[0][1]
        self.handle = block.register_forward_pre_hook(lambda *a: setattr(self, "count", self.count + 1))

    def on_train_start(self, trainer, pl_module):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


class Counter(L.Callback):
    """The collectives and sends of one whole training step (step 3), by group, and the logged values."""

    def __init__(self, step: int = 3) -> None:
        self.step, self.mode, self.counts, self.logged, self.memory = step, None, {}, {}, {}
        self.compiled_blocks = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            grid = trainer.strategy.grid
            self.mode = CommCounter({"mp": grid.mp_group, "dp": grid.dp_group, "pp": grid.pp_group})
            self.mode.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.mode is not None:
            self.memory = trainer.strategy.memory_report()
            self.compiled_blocks = sum("_dpmp_compiled" in vars(m) for m in pl_module.modules())
            self.mode.__exit__(None, None, None)
            self.counts = {f"{g}/{op}": n for (g, op), n in self.mode.counts.items()}
            self.mode = None
        if "train_loss" in trainer.callback_metrics:  # (not every model logs it)
            self.logged[trainer.global_step] = float(trainer.callback_metrics["train_loss"])


def make_trainer(dp: int, pp: int, mp: int, steps: int, precision: str = "64-true", callbacks=(), schedule="1f1b",
                 stages_per_rank: int = 1, guard: int = 0, compile: bool = False, zero: int = 0,
                 sequence_parallel: bool = False, mixed_precision=None, reshard_after_forward: bool = True,
                 **kwargs) -> L.Trainer:
    strategy = DPMPStrategy(dp=dp, mp=mp, pp=pp, pp_microbatches=MICROBATCHES, pp_schedule=schedule,
                            pp_stages_per_rank=stages_per_rank, timeout=timedelta(minutes=2),
                            check_consistency_every_n_steps=guard, compile=compile, zero=zero,
                            sequence_parallel=sequence_parallel, mixed_precision=mixed_precision,
                            reshard_after_forward=reshard_after_forward)
    return L.Trainer(
        accelerator="cpu", devices=dp * pp * mp, strategy=strategy, precision=precision, max_steps=steps,
        gradient_clip_val=CLIP, gradient_clip_algorithm="norm", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks), **kwargs,
    )


def run(dp: int, pp: int, mp: int, precision: str, out: str, spec: str) -> dict:
    name, schedule, *extra = spec.split(":")
    L.seed_everything(SEED, workers=True)
    model, dataset = build(name)
    counter, setup_steps = Counter(), SetupSteps()
    v = int(extra[0]) if extra and extra[0].isdigit() else 1
    accumulate = 2 if "acc2" in extra else 1
    zero = next((int(e[1:]) for e in extra if e.startswith("z")), 0)
    trainer = make_trainer(dp, pp, mp, STEPS, precision, [counter, setup_steps], schedule, v,
                           guard=5 if "guard" in extra else 0,
                           compile="compile" in extra, zero=zero, sequence_parallel="sp" in extra,
                           accumulate_grad_batches=accumulate, reshard_after_forward="keep" not in extra,
                           # fp32: computed in float32 with float64 masters and float64 reductions
                           mixed_precision=MixedPrecisionPolicy(torch.float32, torch.float64) if "fp32" in extra
                           else None)
    strategy = trainer.strategy
    trainer.fit(model, DataLoader(dataset, batch_size=GLOBAL_BATCH // dp))
    tag = f"{spec.replace(':', '_')}_{precision.split('-')[0]}"
    trainer.save_checkpoint(os.path.join(out, f"{tag}.ckpt"))
    analytic = strategy.applied_plan.plan.comm_per_step()
    return {"counts": counter.counts, "logged": counter.logged, "plan_text": strategy.applied_plan.text,
            "ranges": strategy.pipeline.ranges if strategy.pipeline is not None else None,
            "analytic_all_reduce": analytic["forward"]["all_reduce"] + analytic["backward"]["all_reduce"],
            "analytic": analytic,
            "grid": [strategy.grid.dp_rank, strategy.grid.pp_rank, strategy.grid.mp_rank],
            "compiled_blocks": counter.compiled_blocks, "setup_steps": setup_steps.count,
            "memory": counter.memory, "freed": strategy.pipeline.memory_freed() if strategy.pipeline else 0,
            "dense_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def resume(out: str) -> None:
    """Train gpt 10 steps at (dp, pp, mp) = (1, 2, 2), save both formats while split; resume each at (2, 1, 2) to
    20 steps and save consolidated (the test resumes that on one process to 30)."""
    L.seed_everything(SEED, workers=True)
    model, dataset = build("gpt")
    save = SaveAtTrainEnd([(True, os.path.join(out, "s.ckpt")), (False, os.path.join(out, "c.ckpt"))])
    make_trainer(1, 2, 2, STEPS // 2, callbacks=[save]).fit(model, DataLoader(dataset, batch_size=GLOBAL_BATCH))
    for tag in ("c", "s"):
        L.seed_everything(SEED, workers=True)
        model, dataset = build("gpt")
        trainer = make_trainer(2, 1, 2, STEPS)
        trainer.fit(model, DataLoader(dataset, batch_size=GLOBAL_BATCH // 2),
                    ckpt_path=os.path.join(out, f"{tag}.ckpt"))
        trainer.save_checkpoint(os.path.join(out, f"final_212_{tag}.ckpt"))


class Held(L.Callback):
    """Parameter bytes this rank holds when training starts, and those of the whole (dense) model."""

    def on_train_start(self, trainer, pl_module):
        self.held = trainer.strategy.memory_report()["parameters"]
        self.dense = sum(p.numel() * p.element_size() for p in pl_module.parameters())


def meta(out: str) -> None:
    """transformers' Llama built on the meta device (``init_module(empty_init=True)``): each rank initialises its
    stage's parameters (the split seeds them by name, whatever the layout), trains 20 steps at (1,2,1) and at
    (2,1,1), the same global batch; both save consolidated. Then a meta model at (1,2,1) resumes the (2,1,1)
    checkpoint at its last step (nothing left to train) and saves it again."""
    report = {}
    for dp, pp in ((1, 2), (2, 1)):
        L.seed_everything(SEED, workers=True)
        held = Held()
        trainer = make_trainer(dp, pp, 1, STEPS, callbacks=[held])
        with trainer.init_module(empty_init=True):
            model, dataset = build("hf_llama")
        trainer.fit(model, DataLoader(dataset, batch_size=GLOBAL_BATCH // dp))
        trainer.save_checkpoint(os.path.join(out, f"meta_{dp}{pp}1.ckpt"))
        report[f"{dp}{pp}1"] = {"held": held.held, "dense": held.dense}
    # a meta model at (1,2,1) loading the (2,1,1) checkpoint: the other stage's freed parameters are filled too
    L.seed_everything(SEED, workers=True)
    trainer = make_trainer(1, 2, 1, STEPS)
    with trainer.init_module(empty_init=True):
        model, dataset = build("hf_llama")
    trainer.fit(model, DataLoader(dataset, batch_size=GLOBAL_BATCH), ckpt_path=os.path.join(out, "meta_211.ckpt"))
    trainer.save_checkpoint(os.path.join(out, "meta_loaded_121.ckpt"))
    with open(os.path.join(out, f"meta_rank{dist.get_rank()}.json"), "w") as f:
        json.dump(report, f)


def _val_step(self, batch, batch_idx):
    x, y = batch
    logits = self(x)
    loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
    self.log("val_loss", loss, sync_dist=True)


def zero(out: str) -> None:
    """ZeRO under a pipeline at (dp, pp, mp) = (2, 2, 1): GPT trained 10 steps at zero=2 with a validation run at
    step 10 (every stage evaluates the whole model), saved in both formats; the consolidated file resumed at zero=3
    under the pipeline to 20 steps, the sharded folder at (2, 1, 2) zero=1. Then transformers' Llama built on the
    meta device trains 20 steps at zero=3 under the pipeline (each rank initialises its stage, and holds 1/dp of it),
    and at (4, 1, 1) without ZeRO or a pipeline (the meta model's oracle: the split seeds each module by name)."""
    import types

    L.seed_everything(SEED, workers=True)
    model, dataset = build("gpt")
    model.validation_step = types.MethodType(_val_step, model)
    save = SaveAtTrainEnd([(True, os.path.join(out, "zs.ckpt")), (False, os.path.join(out, "zc.ckpt"))])
    trainer = make_trainer(2, 2, 1, STEPS // 2, callbacks=[save], zero=2, val_check_interval=STEPS // 2,
                           limit_val_batches=1)
    trainer.fit(model, DataLoader(dataset, batch_size=GLOBAL_BATCH // 2), DataLoader(dataset, batch_size=GLOBAL_BATCH))
    report = {"val_loss": float(trainer.callback_metrics["val_loss"])}
    for tag, (dp, pp, mp, level) in (("c", (2, 2, 1, 3)), ("s", (2, 1, 2, 1))):
        L.seed_everything(SEED, workers=True)
        model, dataset = build("gpt")
        trainer = make_trainer(dp, pp, mp, STEPS, zero=level)
        trainer.fit(model, DataLoader(dataset, batch_size=GLOBAL_BATCH // dp),
                    ckpt_path=os.path.join(out, f"z{tag}.ckpt"))
        trainer.save_checkpoint(os.path.join(out, f"zfinal_{tag}.ckpt"))
    for tag, (dp, pp, level) in (("zmeta", (2, 2, 3)), ("zmeta_411", (4, 1, 0))):  # the second: the oracle
        L.seed_everything(SEED, workers=True)
        held = Held()
        trainer = make_trainer(dp, pp, 1, STEPS, callbacks=[held], zero=level)
        with trainer.init_module(empty_init=True):
            model, dataset = build("hf_llama")
        trainer.fit(model, DataLoader(dataset, batch_size=GLOBAL_BATCH // dp))
        trainer.save_checkpoint(os.path.join(out, f"{tag}.ckpt"))
        report[tag] = {"held": held.held, "dense": held.dense}
    with open(os.path.join(out, f"zero_rank{dist.get_rank()}.json"), "w") as f:
        json.dump(report, f)


class Reads(torch.nn.Module):
    """GPT whose loss also reads each block's output: a step no pipeline cut can carry."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net
        self.hidden: list = []
        for block in net.blocks:
            block.register_forward_hook(lambda mod, args, out: self.hidden.append(out))

    def forward(self, ids):
        self.hidden.clear()
        logits = self.net(ids)
        return logits + 0.0 * sum(h.mean() for h in self.hidden)


class Started(L.Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        open(self.path, "w").close()


class MetricLM(LMModule):
    """GPT with validation, test and predict steps for stage-by-stage evaluation: the mean token loss logged with
    ``sync_dist``, a ``MeanMetric`` of the per-token losses logged as a metric object, a ``CatMetric`` of each
    sample's loss (a list state) read in ``on_validation_epoch_end``, and per-sample logit sums as predictions; the
    validation step returns the batch's loss and per-sample losses (what ``on_validation_batch_end`` receives)."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__(net)
        from torchmetrics.aggregation import CatMetric, MeanMetric

        self.val_ce, self.per_sample = MeanMetric(), CatMetric()
        self.epoch_samples: list = []

    def on_validation_start(self):
        # torchmetrics casts each input to the metric's dtype (float32 by default: per-token values would round
        # to float32, and a module conversion sets it back), so float64 before every validation run, on every rank
        self.val_ce.set_dtype(torch.float64)
        self.per_sample.set_dtype(torch.float64)

    def _losses(self, batch):
        x, y = batch[0], batch[1]
        logits = self(x)
        per_token = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1), reduction="none")
        return per_token.view(x.shape), per_token.mean()

    def validation_step(self, batch, batch_idx):
        per_token, loss = self._losses(batch)
        self.val_ce.update(per_token)
        self.per_sample.update(per_token.mean(-1))
        self.log("val_loss", loss, sync_dist=True)
        self.log("val_ce", self.val_ce, on_epoch=True)
        return {"loss": loss, "per_sample": per_token.mean(-1)}

    def on_validation_epoch_end(self):
        if not self.trainer.sanity_checking:
            self.epoch_samples.append(sorted(self.per_sample.compute().tolist()))
        self.per_sample.reset()

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._losses(batch)[1], sync_dist=True)

    def predict_step(self, batch, batch_idx):
        x, _, index = batch
        return index, self(x).sum(-1)


class EvalRecorder(L.Callback):
    """Per validation epoch (after sanity checking): the logged ``val_loss`` and ``val_ce``; per validation batch:
    what the step returned and the parameter bytes this rank holds with storage (the freed ones count 0)."""

    def __init__(self) -> None:
        self.epochs: list = []
        self.returned: list = []
        self.held: set = set()

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        # (a DTensor parameter's bytes on this rank: its local tensor's; the DTensor itself reads as the dense one)
        self.held.add(sum(local_tensor(p).untyped_storage().nbytes() for p in pl_module.parameters()))
        if not trainer.sanity_checking:
            self.returned.append([float(outputs["loss"]), outputs["per_sample"].tolist()])

    def on_train_end(self, trainer, pl_module):  # (after SaveAtTrainEnd's saves: they gather nothing here)
        self.held_after_save = sum(local_tensor(p).untyped_storage().nbytes() for p in pl_module.parameters())

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.epochs.append({k: float(trainer.callback_metrics[k]) for k in ("val_loss", "val_ce")})


class Writer(BasePredictionWriter):
    """Writes each batch's predictions (sample index -> logit sums) to ``pred_rank<global rank>.pt``."""

    def __init__(self, out: str) -> None:
        super().__init__(write_interval="batch")
        self.out, self.rows = out, {}

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        index, sums = prediction
        self.rows.update({int(i): row.clone() for i, row in zip(index, sums)})
        torch.save(self.rows, os.path.join(self.out, f"pred_rank{trainer.global_rank}.pt"))


EVAL_ROWS, EVAL_EPOCHS, EVAL_TRAIN_BATCHES = 16, 2, 3


def eval_data():
    from torch.utils.data import TensorDataset

    from tests.support.models import make_lm_dataset

    x, y = make_lm_dataset(n=EVAL_ROWS, seed=99).tensors
    return TensorDataset(x, y, torch.arange(EVAL_ROWS))


def evaluate(dp: int, pp: int, mp: int, out: str) -> dict:
    """GPT (tied) fitted for ``EVAL_EPOCHS`` epochs of ``EVAL_TRAIN_BATCHES`` batches with a validation run after
    each, stage by stage; then ``trainer.validate``, ``test`` and ``predict`` (with a :class:`Writer`) on the
    same trainer. Returns what was logged and returned, and the parameter bytes held during evaluation and after
    both checkpoint formats were saved at the end of training (``eval_s.ckpt``, ``eval_c.ckpt``), stage by stage."""
    L.seed_everything(SEED, workers=True)
    net, dataset = build("gpt")
    model = MetricLM(net.net)
    recorder = EvalRecorder()
    save = SaveAtTrainEnd([(True, os.path.join(out, "eval_s.ckpt")), (False, os.path.join(out, "eval_c.ckpt"))])
    trainer = make_trainer(dp, pp, mp, -1, callbacks=[save, recorder, Writer(out)], max_epochs=EVAL_EPOCHS,
                           limit_train_batches=EVAL_TRAIN_BATCHES)
    evals = DataLoader(eval_data(), batch_size=EVAL_ROWS // dp)
    trainer.fit(model, DataLoader(dataset, batch_size=GLOBAL_BATCH // dp), evals)
    strategy = trainer.strategy
    report = {"epochs": recorder.epochs, "returned": recorder.returned, "samples": model.epoch_samples,
              "held_fit": sorted(recorder.held), "held_after_save": recorder.held_after_save,
              "dense_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}
    recorder.held = set()
    report["validate"] = trainer.validate(model, evals, verbose=False)[0]
    report["held_validate"] = sorted(recorder.held)
    report["stage_bytes"] = strategy.memory_report()["parameters"] if strategy.pipeline is not None else None
    report["test"] = trainer.test(model, evals, verbose=False)[0]
    predictions = trainer.predict(model, evals)
    report["predict"] = {int(i): row.tolist() for index, sums in predictions for i, row in zip(index, sums)}
    report["grid"] = [strategy.grid.dp_rank, strategy.grid.pp_rank, strategy.grid.mp_rank]
    with open(os.path.join(out, f"eval_rank{trainer.global_rank}.json"), "w") as f:
        json.dump(report, f)
    return report


def refuse(out: str) -> None:
    L.seed_everything(SEED, workers=True)
    model, dataset = build("gpt")
    model.net = Reads(model.net)
    started = os.path.join(out, f"started{dist.get_rank() if dist.is_initialized() else os.environ.get('RANK', 0)}")
    trainer = make_trainer(1, 2, 1, STEPS, callbacks=[Started(started)])
    trainer.fit(model, DataLoader(dataset, batch_size=GLOBAL_BATCH))


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "evaluate":
        evaluate(*(int(a) for a in sys.argv[2:5]), sys.argv[5])
        sys.exit(0)
    if sys.argv[1] in ("resume", "refuse", "meta", "zero"):
        {"resume": resume, "refuse": refuse, "meta": meta, "zero": zero}[sys.argv[1]](sys.argv[2])
        sys.exit(0)
    dp, pp, mp = (int(a) for a in sys.argv[1:4])
    out = sys.argv[4]
    specs = sys.argv[5].split(",")
    precisions = os.environ.get("PRECISIONS", "64-true").split(",")
    results = {f"{s.replace(':', '_')}_{p.split('-')[0]}": run(dp, pp, mp, p, out, s)
               for s in specs for p in precisions}
    rank = dist.get_rank() if dist.is_initialized() else 0
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=1)
