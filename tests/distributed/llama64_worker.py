"""transformers' Llama as issue 42 reported its float64 drifts, under DPMPStrategy and on one process: eager
attention (float32 softmax), ``LlamaRMSNorm`` in float32, float32 rotary tables, GQA (8 query / 4 key-value heads),
untied embeddings, a hand-written ``F.cross_entropy`` loss, ``precision="64-true"``, global batch 8, 6 AdamW steps;
under the pipeline at (dp, pp, mp) = (1,2,1), (1,2,2), (2,2,1), and ``compile=True`` at (dp, mp) = (2,2).

Run by ``tests/distributed/test_llama64.py`` on pool ranks (``OUT CASE,CASE,...``, every case of one world size)
and imported by it for the one-process reference (:func:`fit_case` with ``layout=(1, 1, 1)``). A case is
``DPPPMP-MODEL[-FLAG]`` (``121-llama``, ``212-llama-compile``); MODEL is ``llama`` (as reported) or
``llama_dtype`` (its loss weights the positions by a table the step builds in the default dtype, as user code
does); FLAG ``compile`` (``compile=True``) or ``bf16`` (``precision="bf16-mixed"``, one step: what the step runs
under). Each rank writes ``OUT/rank<r>.json``: ``{case: {"logged": {step: loss}, "weights": ..., "seen": ...,
"aot_eager": ...}}``; ``seen`` lists the default dtype and autocast state ``training_step`` ran under.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings
from datetime import timedelta
from typing import Any
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_dpmp import DPMPStrategy  # noqa: E402
from lightning_dpmp.parallel import compiled  # noqa: E402
from lightning_dpmp.parallel.compiled import compile_blocks  # noqa: E402
from tests.support.models import make_lm_dataset, reference_loader  # noqa: E402

GLOBAL_BATCH, STEPS, SEED, VOCAB, SEQ = 8, 6, 0, 128, 16


class Llama64(L.LightningModule):
    """Next-token loss written by hand (no ``labels=``: transformers' own loss upcasts the logits to float32)."""

    def __init__(self, weighted: bool = False) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(SEED)  # the same dense init in every process and in the reference
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                          num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=SEQ,
                          tie_word_embeddings=False, attn_implementation="eager")
        self.net = LlamaForCausalLM(cfg)
        self.weighted = weighted
        self.seen: set[tuple[str, bool]] = set()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.add((str(torch.get_default_dtype()), torch.is_autocast_enabled("cpu")))
        ids = batch[0]
        logits = self.net(input_ids=ids).logits
        losses = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1), reduction="none")
        if self.weighted:  # later positions count more: a table in the default dtype (float64 under 64-true)
            losses = losses.view(ids.shape[0], -1) * torch.linspace(0.5, 1.5, ids.shape[1] - 1)
        loss = losses.mean()
        self.log("train_loss", loss, sync_dist=True)  # the DP ranks' mean: the global batch's loss
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)


class Logged(L.Callback):
    def __init__(self) -> None:
        self.logged: dict[int, float] = {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.logged[trainer.global_step] = float(trainer.callback_metrics["train_loss"])


def parse(case: str) -> tuple[tuple[int, int, int], str, set[str]]:
    """``"212-llama-compile"`` -> ``((2, 1, 2), "llama", {"compile"})``."""
    layout, model, *flags = case.split("-")
    return (int(layout[0]), int(layout[1]), int(layout[2])), model, set(flags)


def fit_named(case: str) -> dict[str, Any]:
    """:func:`fit_case` for a case name."""
    layout, name, flags = parse(case)
    return fit_case(name, layout, compile="compile" in flags or "inductor" in flags, inductor="inductor" in flags,
                    precision="bf16-mixed" if "bf16" in flags else "64-true", steps=1 if "bf16" in flags else STEPS)


def fit_case(model_name: str, layout: tuple[int, int, int] = (1, 1, 1), compile: bool = False,
             precision: str = "64-true", steps: int = STEPS, inductor: bool = False) -> dict[str, Any]:
    """Train ``model_name`` at ``layout`` = (dp, pp, mp) (one process: ``(1, 1, 1)``, the sampler's permutation
    drawn as Lightning draws it for many) and return the logged losses, rank 0's weights, what the step ran under
    and how many compiled graphs took the ``aot_eager`` path. ``inductor``: the blocks compiled by Inductor whatever
    their dtypes (the strategy's backend replaced; on one process, :func:`compile_blocks` with Inductor): the
    float32 islands computed by Inductor's fused kernels in both."""
    dp, pp, mp = layout
    L.seed_everything(SEED, workers=True)
    model = Llama64(weighted=model_name == "llama_dtype")
    if inductor and dp * pp * mp == 1:
        compile_blocks(model, backend="inductor")
    dataset = make_lm_dataset(vocab=VOCAB, seq=SEQ)
    logged = Logged()
    kwargs: dict[str, Any] = dict(accelerator="cpu", precision=precision, max_steps=steps, logger=False,
                                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                  num_sanity_val_steps=0, callbacks=[logged])
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if dp * pp * mp == 1:
            trainer = L.Trainer(devices=1, **kwargs)
            loader = reference_loader(dataset, GLOBAL_BATCH, SEED)
        else:
            strategy = DPMPStrategy(dp=dp, mp=mp, pp=pp, compile=compile, timeout=timedelta(minutes=3),
                                    consolidate_on_teardown="rank0")
            trainer = L.Trainer(devices=dp * pp * mp, strategy=strategy, **kwargs)
            loader = DataLoader(dataset, batch_size=GLOBAL_BATCH // dp)
        with mock.patch.object(compiled, "exact_backend", "inductor") if inductor else contextlib.nullcontext():
            trainer.fit(model, loader)
    weights = {}
    if trainer.global_rank == 0:  # consolidate_on_teardown="rank0": rank 0 holds the plain model
        weights = {k: v.double().reshape(-1).tolist() for k, v in model.state_dict().items()}
    return {"logged": logged.logged, "weights": weights, "seen": sorted(model.seen),
            "aot_eager": sum("'aot_eager' backend instead" in str(w.message) for w in caught)}


if __name__ == "__main__":
    torch.set_num_threads(1)
    out, cases = sys.argv[1], sys.argv[2].split(",")
    result = {case: fit_named(case) for case in cases}
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)
