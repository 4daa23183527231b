"""Checkpoint launches for tests/distributed/test_checkpoint.py (several fits per launch: each launch costs seconds).

Usage (from the repo root):
    python tests/distributed/checkpoint_worker.py resume OUT_DIR     # 4 processes: save at (2,2), resume at 3 layouts
    python tests/distributed/checkpoint_worker.py mismatch OUT_DIR   # 2 processes: a different model must be refused
    python tests/distributed/checkpoint_worker.py spawn OUT_DIR      # spawn launcher + sharded saves
    python tests/distributed/checkpoint_worker.py fused OUT_DIR DP MP [MODEL,...]  # fused blocks: save or resume

``fused``: FusedLM (one qkv projection split block by block). With ``DP MP`` = ``1 2`` it trains 10 steps and saves
``fused_s.ckpt`` (sharded) and ``fused_c.ckpt`` (consolidated) in ``on_train_end``; with any other layout it
resumes both to 20 steps and writes the final dense weights to ``fused_final_<dp><mp>_<c|s>.pt``.

``resume``: trains SchedResMLP (AdamW, a per-step StepLR, norm clipping, float64) for 10 steps at (dp, mp) = (2, 2)
under ``save_distributed_checkpoint=True`` with a top-k/``save_last`` ModelCheckpoint, and saves the state reached
in ``on_train_end`` both sharded (``s.ckpt``, a folder) and consolidated (``c.ckpt``). Then resumes each to 20
steps at (2, 2), (1, 4) and (4, 1), writing the final dense weights to ``final_<dp><mp>_<c|s>.pt``.
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
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_dpmp import DPMPStrategy  # noqa: E402
from lightning_dpmp.parallel.sharding import shard_dims  # noqa: E402
from tests.support.models import ResMLP, make_dataset  # noqa: E402

GLOBAL_BATCH, STEPS, CLIP, SEED = 8, 10, 0.5, 0
RESUME_LAYOUTS = [(2, 2), (1, 4), (4, 1)]


class SchedResMLP(ResMLP):
    """ResMLP with AdamW and a per-step StepLR, so that resuming must restore the scheduler too."""

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class SaveAtTrainEnd(L.Callback):
    """Saves in ``on_train_end``, while the layers are still sharded (teardown consolidates them afterwards).

    ``formats``: ``[(sharded?, path)]``; the strategy's format is switched for each save and put back.
    """

    def __init__(self, formats: list[tuple[bool, str]]) -> None:
        self.formats = formats

    def on_train_end(self, trainer, pl_module):
        checkpointer = getattr(trainer.strategy, "checkpointer", None)
        before = getattr(checkpointer, "distributed", None)
        for sharded, path in self.formats:
            if before is not None:
                checkpointer.distributed = sharded
            trainer.save_checkpoint(path)
        if before is not None:
            checkpointer.distributed = before


def make_trainer(dp: int, mp: int, steps: int, sharded: bool = False, callbacks=(), **kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=dp * mp, precision="64-true", max_steps=steps, gradient_clip_val=CLIP,
        gradient_clip_algorithm="norm", logger=False, enable_progress_bar=False, enable_model_summary=False,
        strategy=DPMPStrategy(dp=dp, mp=mp, timeout=timedelta(minutes=2), save_distributed_checkpoint=sharded,
                              **kwargs),
        callbacks=list(callbacks), enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
    )


def loader(dp: int) -> DataLoader:
    return DataLoader(make_dataset(), batch_size=GLOBAL_BATCH // dp)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def resume(out: str) -> None:
    L.seed_everything(SEED)
    mc = ModelCheckpoint(dirpath=os.path.join(out, "mc_sharded"), every_n_train_steps=3, save_top_k=2, monitor="step",
                         mode="max", save_last=True)
    save = SaveAtTrainEnd([(True, os.path.join(out, "s.ckpt")), (False, os.path.join(out, "c.ckpt"))])
    make_trainer(2, 2, STEPS, sharded=True, callbacks=[mc, save]).fit(SchedResMLP(), loader(2))
    report = {"mc_sharded_best": mc.best_model_path}
    for dp, mp in RESUME_LAYOUTS:
        for tag in ("c", "s"):
            L.seed_everything(SEED)
            model = SchedResMLP()
            callbacks = []
            if (dp, mp, tag) == (1, 4, "c"):  # ModelCheckpoint with consolidated files, on a resumed run
                callbacks.append(ModelCheckpoint(dirpath=os.path.join(out, "mc_consolidated"), every_n_train_steps=4,
                                                 save_top_k=1, monitor="step", mode="max", save_last=True))
            trainer = make_trainer(dp, mp, 2 * STEPS, callbacks=callbacks)
            trainer.fit(model, loader(dp), ckpt_path=os.path.join(out, f"{tag}.ckpt"))
            if rank() == 0:
                assert not shard_dims(model)
                torch.save(model.state_dict(), os.path.join(out, f"final_{dp}{mp}_{tag}.pt"))
                report[f"{dp}{mp}{tag}"] = {"global_step": trainer.global_step,
                                            "lr": trainer.optimizers[0].param_groups[0]["lr"]}
    if rank() == 0:
        with open(os.path.join(out, "resume.json"), "w") as f:
            json.dump(report, f)


def mismatch(out: str) -> None:
    # A model with a wider hidden layer: fc1/fc2 shapes differ from the checkpoint's.
    make_trainer(1, 2, 2 * STEPS).fit(SchedResMLP(hidden=48), loader(1), ckpt_path=os.path.join(out, "s.ckpt"))


def spawn(out: str) -> None:
    L.seed_everything(SEED)
    model = SchedResMLP()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = make_trainer(1, 2, 4, sharded=True, start_method="spawn")
    trainer.fit(model, loader(1))
    # The parent process (spawn): it has no process group; the model it got back must be dense and trained.
    state = model.state_dict()
    trainer.save_checkpoint(os.path.join(out, "spawn.ckpt"))
    report = {
        "dense_in_main_process": not shard_dims(model) and all(state[k].shape == before[k].shape for k in before),
        "trained": any(not torch.equal(state[k], before[k]) for k in before),
    }
    torch.save(state, os.path.join(out, "spawn_parent_state.pt"))
    with open(os.path.join(out, "spawn.json"), "w") as f:
        json.dump(report, f)


FUSED_SAVE_LAYOUT = (1, 2)


def fused(out: str, dp: int, mp: int, name: str = "fused") -> None:
    from tests.support.models import build

    L.seed_everything(SEED)
    model, data = build(name)
    batches = DataLoader(data, batch_size=GLOBAL_BATCH // dp)
    if (dp, mp) == FUSED_SAVE_LAYOUT:
        save = SaveAtTrainEnd(
            [(True, os.path.join(out, f"{name}_s.ckpt")), (False, os.path.join(out, f"{name}_c.ckpt"))]
        )
        make_trainer(dp, mp, STEPS, callbacks=[save]).fit(model, batches)
        return
    for tag in ("c", "s"):
        L.seed_everything(SEED)
        model, _ = build(name)
        trainer = make_trainer(dp, mp, 2 * STEPS)
        trainer.fit(model, batches, ckpt_path=os.path.join(out, f"{name}_{tag}.ckpt"))
        if rank() == 0:
            assert not shard_dims(model) and trainer.global_step == 2 * STEPS
            torch.save(model.state_dict(), os.path.join(out, f"{name}_final_{dp}{mp}_{tag}.pt"))


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "fused":  # MODEL may be a comma-separated list: several models in one launch
        for model_name in (sys.argv[5] if len(sys.argv) > 5 else "fused").split(","):
            fused(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), model_name)
    else:
        {"resume": resume, "mismatch": mismatch, "spawn": spawn}[sys.argv[1]](sys.argv[2])
