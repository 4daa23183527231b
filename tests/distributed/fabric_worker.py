"""Worker for test_fabric.py: transformers' Llama trained with Lightning Fabric under FabricDPMPStrategy.

Usage: ``fabric_worker.py DP MP OUT``. Writes ``OUT/rank<r>.json`` and, from global rank 0, ``OUT/*.ckpt``:

- ``straight.ckpt``: 10 float64 AdamW steps (loss on the logits outside the model, ``fabric.clip_gradients``);
- ``resumed.ckpt``: 6 steps, ``fabric.save``, then a fresh model and optimizer, ``fabric.load`` before their first
  call (the optimizer state is sliced at the split), 4 more steps;
- ``accumulated.ckpt``: 5 steps of 2 micro-batches each under ``fabric.no_backward_sync``;
- ``pretrained.ckpt``: 10 steps of a model saved with ``save_pretrained`` and loaded with
  ``lightning_dpmp.from_pretrained`` (meta until the first call, then each rank reads its slices).
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_dpmp import CommCounter, FabricDPMPStrategy  # noqa: E402
from lightning_dpmp.parallel.sharding import shard_dims  # noqa: E402
from tests.support.models import make_lm_dataset  # noqa: E402

VOCAB, SEQ, GLOBAL_BATCH, LR, CLIP, SEED = 64, 16, 8, 3e-3, 0.5, 0
COUNTED_STEP = 2
WATCHED_STEPS, L2 = 4, 1e-3


def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=SEQ))


def loss_of(model, ids):
    logits = model(input_ids=ids).logits  # whole on every rank: the user's loss is computed outside the model
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def batches(fabric, micro: int):
    data = make_lm_dataset(vocab=VOCAB, seq=SEQ)
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=GLOBAL_BATCH // micro // fabric.strategy.dp))
    while True:
        yield from loader


def one_step(fabric, model, optimizer, data, micro: int = 1, l2: float = 0.0, watch=None) -> None:
    """One optimizer step of ``micro`` accumulated micro-batches from ``data``, clipped; with ``l2`` the loss adds
    ``l2`` times every parameter's sum of squares; ``watch`` (a dict) gets what user code reads of the model: the
    clip's total norm, the gradients' and the weights' sums of squares over ``model.parameters()`` and over
    ``model.state_dict()`` (one value per step each)."""
    for m in range(micro):
        with fabric.no_backward_sync(model, enabled=m < micro - 1):
            loss = loss_of(model, next(data)[0]) / micro
            if l2:
                loss = loss + l2 * sum(p.pow(2).sum() for p in model.parameters())
            fabric.backward(loss)
    total = fabric.clip_gradients(model, optimizer, max_norm=CLIP)
    if watch is not None:
        watch.setdefault("clip_total", []).append(float(total))
        with torch.no_grad():
            watch.setdefault("grad_sq", []).append(
                float(sum(p.grad.pow(2).sum() for p in model.parameters() if p.grad is not None)))
    optimizer.step()
    optimizer.zero_grad()
    if watch is not None:
        with torch.no_grad():
            watch.setdefault("weight_sq", []).append(float(sum(p.pow(2).sum() for p in model.parameters())))
            watch.setdefault("state_sq", []).append(
                float(sum(v.pow(2).sum() for v in model.state_dict().values())))


def train(fabric, steps: int, micro: int = 1, load: str = "", save: str = "", skip: int = 0, record=None,
          net=None, l2: float = 0.0, watch=None):
    net = net if net is not None else llama()
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.01)
    model, optimizer = fabric.setup(net, optimizer)
    if load:
        fabric.load(load, {"model": model, "optimizer": optimizer})
    data = batches(fabric, micro)
    for _ in range(skip * micro):
        next(data)
    for step in range(steps):
        counter = CommCounter({"mp": fabric.strategy.grid.mp_group, "dp": fabric.strategy.grid.dp_group})
        with counter if (record is not None and step == COUNTED_STEP) else open(os.devnull):
            one_step(fabric, model, optimizer, data, micro, l2, watch)
        if record is not None and step == COUNTED_STEP:
            record["counts"] = {f"{g}/{op}": n for (g, op), n in counter.counts.items()}
    if save:
        fabric.save(save, {"model": model, "optimizer": optimizer, "step": skip + steps})
    return model


def main(dp: int, mp: int, out: str) -> None:
    torch.set_num_threads(1)
    strategy = FabricDPMPStrategy(dp=dp, mp=mp, timeout=timedelta(minutes=5))
    fabric = Fabric(accelerator="cpu", devices=dp * mp, strategy=strategy, precision="64-true")
    fabric.launch()
    fabric.seed_everything(SEED)
    record: dict = {}
    model = train(fabric, 10, save=os.path.join(out, "straight.ckpt"), record=record)
    plan = fabric.strategy.applied_plan
    record.update(
        styles={n: lp.style for n, lp in plan.plan.layers.items()}, verified=plan.verified,
        split=len(shard_dims(model._original_module)), comm=plan.plan.comm_per_step(), text=plan.text,
    )
    train(fabric, 6, save=os.path.join(out, "half.ckpt"))
    train(fabric, 4, load=os.path.join(out, "half.ckpt"), save=os.path.join(out, "resumed.ckpt"), skip=6)
    train(fabric, 5, micro=2, save=os.path.join(out, "accumulated.ckpt"))
    # what user code reads of the model (DTensor parameters at mp > 1): norms, gradients, state_dict, an L2 term
    record["watched"] = {}
    train(fabric, WATCHED_STEPS, l2=L2, watch=record["watched"], save=os.path.join(out, "watched.ckpt"))
    # one bridge for every module this strategy split (the runs above each set up a model): not one per module
    record["modes"] = torch._C._len_torch_function_stack()
    # a pretrained folder read lazily: built on meta, each rank reads its slices at the first call
    from transformers import LlamaForCausalLM

    import lightning_dpmp

    folder = os.path.join(out, "pretrained")
    if fabric.global_rank == 0:
        llama().save_pretrained(folder)
    fabric.barrier()
    net = lightning_dpmp.from_pretrained(LlamaForCausalLM, folder)
    record["pretrained_lazy"] = all(p.is_meta for p in net.parameters())
    train(fabric, 10, save=os.path.join(out, "pretrained.ckpt"), net=net)
    # user collectives default to the DP group: each sample once, sums not counted mp times
    rank = torch.tensor([float(fabric.global_rank // mp)], dtype=torch.float64)
    record["gathered"] = fabric.all_gather(rank).reshape(-1).tolist()
    record["summed"] = float(fabric.all_reduce(torch.ones((), dtype=torch.float64), reduce_op="sum"))
    with open(os.path.join(out, f"rank{fabric.global_rank}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
