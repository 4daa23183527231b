"""Logits are never a hidden collective (issue 12): one launch at dp=2 x mp=2 against single-process runs.

- ``mlp_digits`` (composed from conf/) trains and validates with torchmetrics accuracy equal to a single-process run
  (same seed, same permutation), float64 weights within 1e-8; its 10-class head stays whole by itself, and forced to
  ``vocab`` it still validates (the layer gathers full logits in eval mode).
- A GPT whose ``validation_step`` computes argmax / softmax / top-k on rank 0 only finishes in seconds with the
  single-process values, while its training step keeps the logits vocab-parallel.
"""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from tests.conftest import run_ranks
from tests.integration import logits_worker as LW
from tests.support.models import build, make_lm_dataset, reference_loader

WORKER = "tests/integration/logits_worker.py"


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    out = tmp_path_factory.mktemp("logits")
    proc = run_ranks(4, [WORKER, str(out)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(LW.DP * LW.MP)]


def _max_diff(ours: dict, ref: dict) -> float:
    assert ours.keys() == ref.keys()
    return max((ours[k].double() - ref[k].double()).abs().max().item() for k in ref)


def _single_digits(tmp_path) -> tuple[float, dict]:
    cfg = LW.digits_config(str(tmp_path))
    model, data = LW.digits_parts(cfg)
    data.setup("fit")
    trainer = L.Trainer(accelerator="cpu", devices=1, num_sanity_val_steps=0, **LW.DIGITS_TRAINER)
    trainer.fit(model, reference_loader(data.train_set, LW.DP * cfg.data.batch_size, cfg.seed), data.val_dataloader())
    return float(trainer.callback_metrics["val/acc"]), model.state_dict()


@pytest.mark.slow
def test_mlp_digits_validates_with_the_single_process_accuracy(launch, tmp_path):
    out, ranks = launch
    acc, weights = _single_digits(tmp_path)
    for key in ("auto", "vocab"):
        assert _max_diff(torch.load(out / f"digits_{key}.pt", weights_only=True), weights) <= 1e-8, key
        for r in ranks:
            assert r[f"digits_{key}"]["acc"] == acc, (key, r[f"digits_{key}"], acc)
    for r in ranks:
        assert r["digits_auto"]["head"] == "replicate"  # a 10-class head on a 128-wide input is not worth splitting
        assert "kept whole: out_features=10 <= in_features=128" in r["digits_auto"]["note"]
        assert r["digits_vocab"]["head"] == "vocab"


@pytest.mark.slow
def test_rank_zero_only_logits_code_in_validation_finishes_with_single_process_values(launch):
    out, ranks = launch
    for r in ranks:
        g = r["gpt"]
        # training stays vocab-parallel
        assert g["styles"]["net.lm_head"] == "vocab" and g["styles"]["net.wte"] == "vocab"
        assert g["validation_s"] < 20, g  # no collective waits for rank 0 (a hang would end at the 30 s timeout)
    assert ranks[0]["gpt"]["inspected"] == 3 and ranks[1]["gpt"]["inspected"] == 0  # sanity batch + 2 val batches
    for r in ranks:  # torch's own tools accept the sharded logits and see what the project's counter sees
        tools = r["gpt"]["tools"]
        ours = sum(n for k, n in tools["our_counts"].items() if k.endswith("/all_reduce"))
        assert ours > 0 and tools["torch_counts"] == {"c10d.allreduce_": ours}, tools
        assert tools["flops"] > 0 and tools["flops"] == ranks[0]["gpt"]["tools"]["flops"], tools
        # the hook ran once per training step, with this rank's shard of the logits' gradient (64 classes / 2)
        assert tools["hook_calls"] == LW.GPT_STEPS and tools["hook_grad_shape"][-1] == 64 // LW.MP, tools

    L.seed_everything(0)
    base, ds = build("gpt")
    model = LW.RankZeroInspect(base.net).double()
    trainer = L.Trainer(accelerator="cpu", devices=1, precision="64-true", max_steps=LW.GPT_STEPS,
                        val_check_interval=LW.GPT_STEPS, check_val_every_n_epoch=None, num_sanity_val_steps=0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, reference_loader(ds, LW.GPT_BATCH * LW.DP, 0),
                DataLoader(make_lm_dataset(n=32, seed=99), batch_size=LW.VAL_BATCH))
    for r in ranks:
        assert r["gpt"]["acc"] == float(trainer.callback_metrics["val_acc"]), r["gpt"]
    saved = torch.load(out / "gpt.pt", weights_only=True)
    assert _max_diff(saved["state_dict"], model.state_dict()) <= 1e-8
    model.eval()
    with torch.no_grad():
        for seen in saved["inspected"][1:]:  # after training (the first is the sanity check, before it)
            logits = model(seen["x"])
            assert seen["shape"] == list(logits.shape)  # the full vocabulary
            assert torch.equal(seen["argmax"], logits.argmax(-1))
            assert torch.equal(seen["topk"], logits.topk(3, dim=-1).indices)
            assert (seen["softmax"] - logits.softmax(-1)).abs().max().item() <= 1e-10
