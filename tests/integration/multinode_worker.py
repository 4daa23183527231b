"""DPMPStrategy(dp=2, mp=2) in float64 on NUM_NODES x DEVICES processes; rank 0 writes the trained weights and the
layout every rank saw. Launched by test_multinode.py as two torchrun "nodes" on this machine, and as one node.

Usage: python tests/integration/multinode_worker.py NUM_NODES DEVICES OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_dpmp import DPMPStrategy  # noqa: E402
from tests.support.models import ResMLP, make_dataset  # noqa: E402


class Layout(Callback):
    """Records, on every rank, its node and the nodes of its MP group's members (all_gather over the MP group)."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        grid = trainer.strategy.grid
        nodes: list[Any] = [None] * grid.mp
        dist.all_gather_object(nodes, trainer.node_rank, group=grid.mp_group)
        info = {"rank": trainer.global_rank, "node": trainer.node_rank,
                "mp_group": dist.get_process_group_ranks(grid.mp_group), "mp_group_nodes": nodes,
                "dp_group": dist.get_process_group_ranks(grid.dp_group)}
        (self.out / f"layout_{trainer.global_rank}.json").write_text(json.dumps(info))


def main() -> None:
    torch.set_num_threads(1)
    num_nodes, devices, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    L.seed_everything(0)
    model = ResMLP()
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, num_nodes=num_nodes, precision="64-true", max_steps=8,
        strategy=DPMPStrategy(dp=2, mp=2, timeout=timedelta(minutes=1), check_consistency_every_n_steps=4),
        gradient_clip_val=1.0,
        callbacks=[Layout(out)], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(make_dataset(), batch_size=4))
    trainer.save_checkpoint(str(out / "last.ckpt"))
    # Left to interpreter exit, gloo's threads were sometimes torn down mid-flight ("terminate called without an
    # active exception", SIGABRT after the work was done: seen in about 1 run in 4, at this stop's start commit too)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
