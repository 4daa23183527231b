"""Launch-path checks: torchrun, the spawn launcher, and a wrong process count under torchrun.

Usage: python tests/integration/launch_worker.py MODE DEVICES DP MP OUT_DIR   (MODE: popen | spawn)
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_dpmp import CommAccounting, DPMPStrategy  # noqa: E402
from lightning_dpmp.parallel.sharding import shard_dims  # noqa: E402
from tests.support.models import ResMLP, make_dataset  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    mode, devices, dp, mp, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    L.seed_everything(0)
    model = ResMLP()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    accounting = CommAccounting()
    trainer = L.Trainer(
        accelerator="cpu", devices=devices,
        strategy=DPMPStrategy(dp=dp, mp=mp, start_method=mode, timeout=timedelta(minutes=1)),
        max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[accounting],
    )
    trainer.fit(model, DataLoader(make_dataset(), batch_size=4))
    trainer.save_checkpoint(os.path.join(out, "last.ckpt"))
    if trainer.is_global_zero:
        state = model.state_dict()
        report = {
            "world_size": trainer.world_size,
            "dense_in_main_process": not shard_dims(model) and all(state[k].shape == before[k].shape for k in before),
            "trained": any(not torch.equal(state[k], before[k]) for k in before),
            "env_rank": os.environ.get("RANK"),
            "comm": accounting.last,
        }
        with open(os.path.join(out, f"report_{mode}.json"), "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main()
