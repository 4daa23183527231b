"""Activation checkpointing launches for tests/distributed/test_recompute.py (4 processes).

Usage (from the repo root):
    python tests/distributed/recompute_worker.py OUT CASE,...

A CASE is ``DP.PP.MP:SETTING[:zN][:sp][:drop][:midK][:scaled]``: the example GPT with 4 blocks (``gpt4``; ``drop``:
with dropout 0.1 everywhere, attention included; ``scaled``: instead ``resmlp_scaled``, whose blocks read their own
``scale`` parameter directly) trained 20 float64 AdamW steps with norm clipping under
``DPMPStrategy(dp, mp, pp, activation_checkpointing=SETTING)`` (``none``, ``blocks``), ``zero=N``,
``sequence_parallel``; ``midK`` (with ``auto``): a device memory limit, as on CUDA, set between the predicted peaks
of K and K - 1 recomputed blocks per stage; ``fabric:SETTING``: Fabric at (2, 2) (:func:`fabric_run`); each rank
writes the collectives of step 3 by group, the analytic per-step MP collectives of the plan, the blocks wrapped and
the plan printout to ``OUT/rank{r}.json``; the consolidated checkpoint goes to ``OUT/{case}.ckpt``.
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

from lightning_dpmp import DPMPStrategy  # noqa: E402
from lightning_dpmp.parallel.recompute import checkpointed_blocks  # noqa: E402
from tests.distributed.parity_worker import CLIP, GLOBAL_BATCH, SEED, STEPS  # noqa: E402
from tests.distributed.pipeline_worker import MICROBATCHES, Counter  # noqa: E402
from tests.support.models import LMModule, build, make_lm_dataset  # noqa: E402


class Wrapped(L.Callback):
    """The blocks under activation checkpointing while training (teardown removes them)."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def on_train_start(self, trainer, pl_module):
        self.names = checkpointed_blocks(pl_module)


def model_for(case: str):
    if case.endswith(":scaled"):
        return build("resmlp_scaled")
    if case.endswith(":drop"):
        from examples.models.gpt import GPT

        net = GPT(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32, dropout=0.1, tie_embeddings=True)
        return LMModule(net), make_lm_dataset(vocab=64)
    return build("gpt4")


def fake_memory_limit(k: int) -> None:
    """``"auto"`` as on a device with a memory limit (CUDA's ``mem_get_info``): a limit half-way between the peaks the
    estimator predicts for this run with ``k`` and ``k - 1`` recomputed blocks per stage."""
    from dataclasses import replace

    import lightning_dpmp.integration.parallelize as P
    from lightning_dpmp.integration.activations import layout_spec, recompute_count
    from lightning_dpmp.tools.estimate import DEVICES, predict

    def between(prof, topology, sequence_parallel, sequences, precision, budget):
        spec = layout_spec(topology, sequence_parallel)
        n = topology.dp * topology.pp * topology.mp

        def peak(j: int) -> float:
            s = replace(spec, recompute=j > 0, recompute_blocks=j)
            return predict(prof, DEVICES["h100"], n, sequences * topology.dp, s, precision).peak_mem_gib * 2**30

        return recompute_count(prof, topology, sequence_parallel, sequences, precision, (peak(k) + peak(k - 1)) / 2)

    P.device_budget = lambda device: 1.0  # (any limit: `between` sets the one that counts)
    P.recompute_count = between


def run(case: str, out: str) -> dict:
    layout, setting, *flags = case.split(":")
    dp, pp, mp = (int(x) for x in layout.split("."))
    zero = next((int(f[1:]) for f in flags if f.startswith("z")), 0)
    mid = next((int(f[3:]) for f in flags if f.startswith("mid")), None)
    if mid is not None:
        fake_memory_limit(mid)
    L.seed_everything(SEED, workers=True)
    model, dataset = model_for(case)
    counter, wrapped = Counter(), Wrapped()
    strategy = DPMPStrategy(dp=dp, mp=mp, pp=pp, zero=zero, sequence_parallel="sp" in flags,
                            activation_checkpointing=None if setting == "none" else setting,
                            timeout=timedelta(minutes=2),
                            **({"pp_microbatches": MICROBATCHES} if pp > 1 else {}))
    trainer = L.Trainer(accelerator="cpu", devices=dp * pp * mp, strategy=strategy, precision="64-true",
                        max_steps=STEPS, gradient_clip_val=CLIP, gradient_clip_algorithm="norm", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[counter, wrapped])
    trainer.fit(model, DataLoader(dataset, batch_size=GLOBAL_BATCH // dp))
    trainer.save_checkpoint(os.path.join(out, f"{case.replace(':', '_')}.ckpt"))
    grid = strategy.grid
    return {"counts": counter.counts, "analytic": strategy.applied_plan.plan.comm_per_step(),
            "wrapped": wrapped.names, "plan_text": strategy.applied_plan.text,
            "grid": [grid.dp_rank, grid.pp_rank, grid.mp_rank],
            "ranges": strategy.pipeline.ranges if strategy.pipeline is not None else None,
            "left": checkpointed_blocks(model), "rank": trainer.global_rank}


def fabric_run(setting: str, out: str) -> dict:
    """``fabric:SETTING``: the same GPT under Lightning Fabric at (2, 2), 6 float64 AdamW steps with norm clipping;
    the collectives of step 2 and the weights (``OUT/fabric_SETTING.ckpt``)."""
    import torch.nn.functional as F
    from lightning.fabric import Fabric

    from lightning_dpmp import CommCounter, FabricDPMPStrategy

    strategy = FabricDPMPStrategy(dp=2, mp=2, activation_checkpointing=None if setting == "none" else setting,
                                  timeout=timedelta(minutes=2))
    fabric = Fabric(accelerator="cpu", devices=4, strategy=strategy, precision="64-true")
    fabric.launch()
    fabric.seed_everything(SEED)
    net, dataset = build("gpt4")
    model, optimizer = fabric.setup(net.net, torch.optim.AdamW(net.net.parameters(), lr=3e-3, weight_decay=0.01))
    loader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=GLOBAL_BATCH // 2))
    counts: dict = {}
    for step, (x, y) in zip(range(6), loader):
        counter = CommCounter({"mp": strategy.grid.mp_group, "dp": strategy.grid.dp_group})
        with counter:
            logits = model(x)
            fabric.backward(F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)))
            fabric.clip_gradients(model, optimizer, max_norm=CLIP)
            optimizer.step()
            optimizer.zero_grad()
        if step == 2:
            counts = {f"{g}/{op}": n for (g, op), n in counter.counts.items()}
    fabric.save(os.path.join(out, f"fabric_{setting}.ckpt"), {"model": model})
    return {"counts": counts, "wrapped": checkpointed_blocks(net.net), "plan_text": strategy.applied_plan.text,
            "rank": fabric.global_rank}


def main() -> None:
    torch.set_num_threads(1)
    out, cases = sys.argv[1], sys.argv[2].split(",")
    results = {case: fabric_run(case.split(":")[1], out) if case.startswith("fabric:") else run(case, out)
               for case in cases}
    rank = next(iter(results.values()))["rank"]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
