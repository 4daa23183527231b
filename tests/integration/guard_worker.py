"""DPMPStrategy(dp=2, mp=2, check_consistency_every_n_steps=1) on 4 processes, optionally broken on purpose.

Usage: python tests/integration/guard_worker.py CASE OUT_DIR
CASE: clean | param (rank 3 nudges its shard of blocks.0.fc1.weight after step 2) | batch (the data is split by
global rank with use_distributed_sampler=False, so the two ranks of an MP group read different batches; with
mp_batch="check" the strategy's per-step batch check names it before the guard, which, under the default broadcast,
never sees two batches in one MP group).
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from torch.utils.data import DataLoader, Subset  # noqa: E402

from lightning_dpmp import DPMPStrategy  # noqa: E402
from lightning_dpmp.integration.guard import ConsistencyGuard  # noqa: E402
from lightning_dpmp.parallel.dtensor_params import local_tensor  # noqa: E402
from tests.support.models import ResMLP, make_dataset  # noqa: E402


class Nudge(Callback):
    """Changes one rank's copy of a parameter, as a rank-local bug would."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_rank == 3 and trainer.global_step == 2:
            with torch.no_grad():
                local_tensor(pl_module.blocks[0].fc1.weight)[0, 0] += 1e-6  # this rank's shard alone


class TimedGuard(ConsistencyGuard):
    """Records the wall time of each check (the guard's cost)."""

    seconds: list[float] = []

    def check(self, *args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        super().check(*args, **kwargs)
        self.seconds.append(time.perf_counter() - start)


def main() -> None:
    torch.set_num_threads(1)
    case, out = sys.argv[1], Path(sys.argv[2])
    L.seed_everything(0)
    strategy = DPMPStrategy(dp=2, mp=2, timeout=timedelta(minutes=1), check_consistency_every_n_steps=1,
                            mp_batch="check" if case == "batch" else "broadcast")
    strategy._guard = TimedGuard(1)
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=strategy, max_steps=6, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=case != "batch",
        callbacks=[Nudge()] if case == "param" else [],
    )
    data = make_dataset()
    if case == "batch":  # the classic mistake: shard by global rank instead of DP rank
        data = Subset(data, range(trainer.global_rank, len(data), trainer.world_size))
    trainer.fit(ResMLP(), DataLoader(data, batch_size=4))
    if trainer.is_global_zero:
        (out / "guard.json").write_text(json.dumps({"checks": len(TimedGuard.seconds), "seconds": TimedGuard.seconds}))


if __name__ == "__main__":
    main()
