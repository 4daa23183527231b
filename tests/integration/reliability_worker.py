"""One DPMPStrategy(dp=2, mp=2) training job in which one rank fails in a chosen way; used by test_reliability.py.

Usage: python tests/integration/reliability_worker.py CASE RANK OUT_DIR   (under torchrun, or alone: popen launcher)

CASE: none | train | val | callback | checkpoint | sigkill | hang (the rank sleeps for an hour inside its step, alive
but never joining the next collective; set DPMP_TEST_TIMEOUT_S to bound the others' wait). Every rank writes
``pid_<rank>`` when it starts, and the failing rank writes ``fail_time`` (``time.time()``) just before it fails, so
the test can measure the time to exit and look for orphans.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.fabric.plugins import TorchCheckpointIO  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_dpmp import DPMPStrategy  # noqa: E402
from tests.support.models import ResMLP, make_dataset  # noqa: E402

FAIL_STEP = 3


def _fail(out: Path, how: str) -> None:
    (out / "fail_time").write_text(repr(time.time()))
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "hang":
        time.sleep(3600)
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))
    raise RuntimeError(f"injected failure ({how}) on rank {rank}")


class Failing(ResMLP):
    def __init__(self, case: str, rank: int, out: Path) -> None:
        super().__init__()
        self.case, self.fail_rank, self.out = case, rank, out

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        failing = self.global_rank == self.fail_rank and self.global_step == FAIL_STEP
        if self.case in ("train", "sigkill", "hang") and failing:
            _fail(self.out, self.case)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if self.case == "val" and self.global_rank == self.fail_rank and batch_idx == 1:
            _fail(self.out, self.case)
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self(x), y), sync_dist=True)


class FailingCallback(Callback):
    def __init__(self, rank: int, out: Path) -> None:
        self.fail_rank, self.out = rank, out

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_rank == self.fail_rank and trainer.global_step == FAIL_STEP:
            _fail(self.out, "callback")


class FailingIO(TorchCheckpointIO):
    """Fails every write (only global rank 0 writes), like a full disk."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        _fail(self.out, "checkpoint")


class StartTogether(DPMPStrategy):
    """Rank 0 opens the rendezvous only once every rank has started (written ``pid_<rank>``).

    The process-group timeout also bounds the start-up rendezvous. The stuck-rank case sets it short (45 s) and runs
    beside other launches, and on a loaded 2-core machine the three children once took longer than that to import
    torch and Lightning ("Timed out after 46 seconds waiting for clients. 1/4 clients joined"). Waiting here keeps
    the timeout's subject the stuck step, not the start-up.
    """

    def __init__(self, out: Path, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.out = out

    def setup_environment(self) -> None:
        deadline = time.time() + 300
        while len(list(self.out.glob("pid_*"))) < 4 and time.time() < deadline:
            time.sleep(0.2)
        super().setup_environment()


def main() -> None:
    torch.set_num_threads(1)
    case, rank, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    timeout_s = float(os.environ.get("DPMP_TEST_TIMEOUT_S", "600"))
    L.seed_everything(0)
    model = Failing(case, rank, out)
    callbacks: list[Callback] = [FailingCallback(rank, out)] if case == "callback" else []
    io = None
    if case == "checkpoint":
        io = FailingIO(out)
        callbacks.append(ModelCheckpoint(dirpath=str(out / "ckpt"), every_n_train_steps=FAIL_STEP, save_top_k=-1))
    trainer = L.Trainer(
        accelerator="cpu", devices=4,
        strategy=StartTogether(out, dp=2, mp=2, timeout=timedelta(seconds=timeout_s), checkpoint_io=io),
        max_steps=12, limit_val_batches=4, val_check_interval=6, callbacks=callbacks, logger=False,
        enable_checkpointing=case == "checkpoint", enable_progress_bar=False, enable_model_summary=False,
    )
    (out / f"pid_{trainer.global_rank}").write_text(str(os.getpid()))
    data = make_dataset()
    trainer.fit(model, DataLoader(data, batch_size=4), DataLoader(data, batch_size=4))
    (out / f"done_{trainer.global_rank}").write_text("ok")


if __name__ == "__main__":
    main()
