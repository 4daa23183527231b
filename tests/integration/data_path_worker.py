"""The data path as users write it, at dp=2 x mp=2 in one launch (issue 27, items 1, 2 and 6).

Usage:
  python tests/integration/data_path_worker.py OUT_DIR            # the cases that train (one 4-rank launch)
  python tests/integration/data_path_worker.py OUT_DIR FAIL_CASE  # one case that must fail fast (2 or 4 ranks)

Training cases record, per rank, the batch every step trained on (after DPMPStrategy's MP broadcast), the raw batch
the rank's own loader produced, and the final weights: the test replays the trained batches in one process and
compares the weights (float64, 1e-8).
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
from lightning.pytorch.callbacks import BasePredictionWriter, StochasticWeightAveraging  # noqa: E402
from lightning.pytorch.callbacks.weight_averaging import EMAWeightAveraging  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from lightning_dpmp import DPMPStrategy  # noqa: E402
from lightning_dpmp.integration.mp_batch import broadcast_batch  # noqa: E402
from tests.support.models import ResMLP, make_dataset  # noqa: E402

STEPS = 6
PER_RANK = 4  # samples per DP rank per step


class Augmented(Dataset):
    """``make_dataset`` with random noise added per sample: from torch's global RNG (a loader worker's, seeded by
    Lightning), or from a generator keyed on the global rank (a loader written with ``trainer.global_rank``)."""

    def __init__(self, keyed_rank: int | None = None, n: int = 64) -> None:
        self.x, self.y = make_dataset(n).tensors
        self.keyed_rank = keyed_rank

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        if self.keyed_rank is None:
            noise = torch.randn(self.x.shape[1])
        else:
            noise = torch.randn(self.x.shape[1], generator=torch.Generator().manual_seed(self.keyed_rank * 1000 + i))
        return self.x[i] + 0.1 * noise, self.y[i]


class Recording(ResMLP):
    """Records the raw batch (before the strategy's transfer) and the batch each training step used."""

    def __init__(self) -> None:
        super().__init__()
        self.raw: list = []
        self.used: list = []
        self.recording = False

    def on_train_start(self) -> None:
        self.recording = True  # not the setup trace

    def on_before_batch_transfer(self, batch, dataloader_idx):
        if self.recording and self.trainer.training:
            self.raw.append([t.tolist() for t in batch])
        return batch

    def training_step(self, batch, batch_idx):
        if self.recording:
            self.used.append([t.tolist() for t in batch])
        return super().training_step(batch, batch_idx)


class Indexed(Dataset):
    def __init__(self, n: int = 64) -> None:
        self.x, self.y = make_dataset(n).tensors

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


class GatherIndices(ResMLP):
    """``self.all_gather`` in ``validation_step``, as users count or collect samples."""

    def __init__(self) -> None:
        super().__init__()
        self.gathered: list = []
        self.recording = False

    def on_validation_start(self) -> None:
        self.recording = True  # not the setup trace

    def validation_step(self, batch, batch_idx):
        x, y, idx = batch
        gathered = self.all_gather(idx)
        if self.recording:
            self.gathered += gathered.reshape(-1).tolist()

    def predict_step(self, batch, batch_idx):
        x, y, idx = batch
        return idx, self(x)


class Writer(BasePredictionWriter):
    """The usual per-rank writer: one file per rank, joined afterwards."""

    def __init__(self, out: str) -> None:
        super().__init__(write_interval="epoch")
        self.out = out

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
        idx = torch.cat([p[0] for p in predictions])
        logits = torch.cat([p[1] for p in predictions])
        torch.save({"idx": idx, "logits": logits}, os.path.join(self.out, f"pred_rank{trainer.global_rank}.pt"))


def averaging_callbacks() -> dict:
    """The averaging callbacks of the parity cases, each fresh (the test builds the same for its reference)."""
    return {
        "swa": StochasticWeightAveraging(swa_lrs=5e-3, swa_epoch_start=1, annealing_epochs=1),
        "ema": EMAWeightAveraging(decay=0.8),
    }


def trainer(dp: int, mp: int, **kw) -> L.Trainer:
    # the timeout bounds the start-up rendezvous too: on 2 loaded cores 4 ranks can take a minute to import torch
    strategy_kw = {k: kw.pop(k) for k in ("mp_batch", "check_consistency_every_n_steps", "zero") if k in kw}
    defaults = dict(accelerator="cpu", devices=dp * mp, logger=False, enable_checkpointing=False, precision="64-true",
                    enable_progress_bar=False, enable_model_summary=False)
    strategy_kw = {"consolidate_on_teardown": True, **strategy_kw}  # every rank reads the weights after fit
    strategy = DPMPStrategy(dp=dp, mp=mp, timeout=timedelta(minutes=5), **strategy_kw)
    return L.Trainer(strategy=strategy, **{**defaults, **kw})


def weights(model) -> dict:
    return {k: v.detach().double().tolist() for k, v in model.state_dict().items()}


def train_case(loader_kwargs: dict, dataset: Dataset, **strategy_kw) -> dict:
    L.seed_everything(0, workers=True)
    m = Recording()
    t = trainer(2, 2, max_steps=STEPS, check_consistency_every_n_steps=1, **strategy_kw)
    t.fit(m, DataLoader(dataset, batch_size=PER_RANK, **loader_kwargs))
    return {"raw": m.raw, "used": m.used, "weights": weights(m)}


def cost_of_broadcast(grid) -> dict:
    """Seconds per MP batch broadcast against seconds per training step, both on this rank, same batch shape."""
    x, y = make_dataset(PER_RANK).tensors
    batch = [x.double(), y]
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(200):
        broadcast_batch(batch, grid.mp_group, src=grid.dp_rank * grid.mp)
    per_broadcast = (time.perf_counter() - t0) / 200
    return {"broadcast_s": per_broadcast}


def run(out: str) -> dict:
    res: dict = {}
    # 1. seeded loader workers with random augmentation (workers seeded by DP rank, batch broadcast over MP)
    res["workers"] = train_case({"num_workers": 2}, Augmented())
    # 2. a dataset keyed on the global rank: the MP ranks' loaders differ; the broadcast makes one batch per group
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("LOCAL_RANK", 0))
    res["keyed"] = train_case({}, Augmented(keyed_rank=rank))
    # 3. all_gather in validation_step and a prediction writer
    L.seed_everything(0)
    m = GatherIndices()
    t = trainer(2, 2)
    t.validate(m, DataLoader(Indexed(), batch_size=8))
    res["gathered"] = m.gathered
    L.seed_everything(0)
    m = GatherIndices()
    t = trainer(2, 2, callbacks=[Writer(out)])
    t.predict(m, DataLoader(Indexed(), batch_size=8), return_predictions=False)
    res["cost"] = cost_of_broadcast(t.strategy.grid)

    class StepTime(L.Callback):
        def on_train_batch_start(self, tr, pl_module, batch, batch_idx):
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, tr, pl_module, outputs, batch, batch_idx):
            res["cost"].setdefault("step_s", []).append(time.perf_counter() - self.t0)

    L.seed_everything(0)
    t = trainer(2, 2, max_steps=20, callbacks=[StepTime()])
    t.fit(ResMLP(), DataLoader(make_dataset(), batch_size=PER_RANK))
    # 4. steps that leave parameters out: DPMPStrategy(find_unused_parameters=True), as DDP's message now says
    L.seed_everything(0)
    m = StepSkip()
    t = L.Trainer(accelerator="cpu", devices=4, precision="64-true", max_steps=STEPS, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  strategy=DPMPStrategy(dp=2, mp=2, timeout=timedelta(minutes=5), find_unused_parameters=True,
                                        consolidate_on_teardown=True))
    t.fit(m, DataLoader(make_dataset(), batch_size=PER_RANK))
    res["step_skip_weights"] = weights(m)
    # 5. weight averaging on the split model: 3 epochs, then a consolidated checkpoint with the averaged copy
    for name, cb in averaging_callbacks().items():
        L.seed_everything(0)
        m = ResMLP()
        t = trainer(2, 2, max_epochs=3, callbacks=[cb])
        t.fit(m, DataLoader(make_dataset(), batch_size=PER_RANK))
        res[f"{name}_weights"] = weights(m)
        t.save_checkpoint(os.path.join(out, f"{name}.ckpt"))
    return res


class StepSkip(ResMLP):
    """LayerDrop-like control flow: every other step skips the last block (its parameters get no gradient)."""

    SKIP_ON = 0  # the steps (global_step % 2) that skip it

    def forward(self, x):
        x = self.inp(x)
        for i, block in enumerate(self.blocks):
            if i == len(self.blocks) - 1 and self.trainer.global_step % 2 == self.SKIP_ON:
                continue
            x = block(x)
        return self.head(self.norm(x))


class Unused(StepSkip):
    """Skips its last block on odd steps, decided by a Python int the traced step (step 0, every block used, no
    data-dependent op) cannot reveal: at mp=1 (DDP averages the gradients) DDP's unused-parameter error at step 1,
    with our advice. (With mp > 1 the strategy's own DP all-reduce keeps such a parameter's gradient None, as one
    process does; a layer the traced step leaves out, or a branch on the data, is found at setup and trains at
    every level: tests/distributed/test_data_dependent.py.)
    """

    SKIP_ON = 1


def fail(case: str, out: str) -> None:
    L.seed_everything(0)
    if case == "swa":  # zero=3 frees the parameters SWA averages: refused before any process starts
        t = trainer(1, 2, max_epochs=2, zero=3, callbacks=[StochasticWeightAveraging(swa_lrs=1e-2)])
        t.fit(ResMLP(), DataLoader(make_dataset(), batch_size=PER_RANK))
    elif case == "check":  # mp_batch='check' with a loader keyed on the global rank
        t = trainer(1, 2, max_steps=4, mp_batch="check")
        t.fit(Recording(), DataLoader(Augmented(keyed_rank=int(os.environ.get("LOCAL_RANK", 0))), batch_size=PER_RANK))
    elif case == "uneven_dp":  # DP rank 1 has one batch more (no DistributedSampler, data sliced by hand)
        rank = int(os.environ.get("LOCAL_RANK", 0))
        n = 16 if rank // 2 == 0 else 20
        t = trainer(2, 2, max_epochs=1, use_distributed_sampler=False)
        t.fit(ResMLP(), DataLoader(torch.utils.data.Subset(make_dataset(), range(n)), batch_size=PER_RANK))
    elif case == "uneven_mp":  # the two ranks of one MP group read loaders of different lengths
        rank = int(os.environ.get("LOCAL_RANK", 0))
        t = trainer(1, 2, max_epochs=1, use_distributed_sampler=False)
        t.fit(ResMLP(), DataLoader(torch.utils.data.Subset(make_dataset(), range(16 + 4 * rank)), batch_size=PER_RANK))
    elif case == "unused":
        t = trainer(4, 1, max_steps=3)
        t.fit(Unused(), DataLoader(make_dataset(), batch_size=PER_RANK))
    else:
        raise SystemExit(f"unknown case {case}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    out = sys.argv[1]
    if len(sys.argv) > 2:
        fail(sys.argv[2], out)
        raise SystemExit(0)
    results = run(out)
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(results, f)
