"""Evaluation stage by stage under a pipeline (issue 42 item 4): validation during ``fit``, then
``trainer.validate``, ``test`` and ``predict`` on the same trainer, each running the stages' forward under the
pipeline's forward-only micro-batch schedule, each rank holding only its stages' parameters.

One pooled launch per (dp, pp, mp) = (1, 2, 1), (1, 2, 2), (2, 2, 1) runs ``pipeline_worker.py evaluate``: GPT
(tied table and head on both stages) in float64, 2 epochs of 3 steps with a validation run after each, logging
the mean token loss with ``sync_dist``, a torchmetrics ``MeanMetric`` (logged as the metric object) and a
``CatMetric`` (a list state) read in ``on_validation_epoch_end``; a ``BasePredictionWriter`` writes the predictions.
The oracle is single-process Lightning doing the same on the same global batches.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_dpmp.checkpoint.sharded import load_sharded_full
from tests.distributed import parity_worker as PW
from tests.distributed import pipeline_worker as W
from tests.support.layouts import layout_launches
from tests.support.models import build, reference_loader
from tests.support.reference import one_process_trainer

pytestmark = pytest.mark.slow

WORKER = "tests/distributed/pipeline_worker.py"
TOL = 1e-8
LAYOUTS = [(1, 2, 1), (1, 2, 2), (2, 2, 1)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Single-process Lightning: the same fit with validation, then validate, test and predict."""
    out = tmp_path_factory.mktemp("pp_eval_ref")
    L.seed_everything(PW.SEED, workers=True)
    net, dataset = build("gpt")
    model = W.MetricLM(net.net)
    recorder = W.EvalRecorder()
    trainer = one_process_trainer(max_epochs=W.EVAL_EPOCHS, limit_train_batches=W.EVAL_TRAIN_BATCHES,
                                  gradient_clip_val=PW.CLIP, gradient_clip_algorithm="norm",
                                  callbacks=[recorder, W.Writer(str(out))])
    evals = DataLoader(W.eval_data(), batch_size=W.EVAL_ROWS)
    trainer.fit(model, reference_loader(dataset, PW.GLOBAL_BATCH, PW.SEED), evals)
    trainer.save_checkpoint(out / "ref.ckpt")
    ref = {"ckpt": torch.load(out / "ref.ckpt", weights_only=True), "epochs": recorder.epochs,
           "returned": recorder.returned, "samples": model.epoch_samples}
    ref["validate"] = trainer.validate(model, evals, verbose=False)[0]
    ref["test"] = trainer.test(model, evals, verbose=False)[0]
    ref["predict"] = {int(i): row for index, sums in trainer.predict(model, evals) for i, row in zip(index, sums)}
    return ref


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return layout_launches(tmp_path_factory, WORKER, "pp_eval", timeout=600, mode=["evaluate"],
                           results="eval_rank{rank}.json")


def _worst(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"dp{a}pp{b}mp{c}" for a, b, c in LAYOUTS])
def test_validation_during_fit_logs_what_one_process_logs(runs, reference, layout):
    """Per epoch, on every rank: the logged loss (``sync_dist``), the logged ``MeanMetric`` and the ``CatMetric``'s
    samples equal one process's; what ``validation_step`` returned reaches ``on_validation_batch_end`` on every rank."""
    _, ranks = runs(layout)
    worst = 0.0
    for r in ranks:
        # the fit's validation epochs, then trainer.validate's (the recorder stays attached)
        assert len(r["epochs"]) == len(reference["epochs"]) == W.EVAL_EPOCHS + 1
        assert len(r["samples"]) == len(reference["samples"]) == W.EVAL_EPOCHS + 1
        for ours, ref in zip(r["epochs"], reference["epochs"]):
            worst = max(worst, _worst([ours["val_loss"], ours["val_ce"]], [ref["val_loss"], ref["val_ce"]]))
        for ours, ref in zip(r["samples"], reference["samples"]):
            worst = max(worst, _worst(ours, ref))  # (sorted: the DP ranks' shares, synced by the metric)
        # what the step returned: the loss of this DP rank's batch and each of its samples' losses
        per_sample = sorted(x for _, rows in r["returned"] for x in rows)
        peers = [q for q in ranks if q["grid"][1:] == r["grid"][1:]]  # the other DP ranks, same stage and MP rank
        union = sorted(x for q in peers for _, rows in q["returned"] for x in rows)
        ref_union = sorted(x for _, rows in reference["returned"] for x in rows)
        worst = max(worst, _worst(union, ref_union))
        assert len(per_sample) == len(ref_union) // layout[0]
        if layout[0] == 1:
            worst = max(worst, _worst([loss for loss, _ in r["returned"]], [x for x, _ in reference["returned"]]))
    print(f"pipeline evaluation during fit (dp, pp, mp)={layout}: max |logged - one process| = {worst:.2e}")
    assert worst <= TOL, (layout, worst)


@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"dp{a}pp{b}mp{c}" for a, b, c in LAYOUTS])
def test_validate_test_and_predict_after_fit_equal_one_process(runs, reference, layout):
    """``trainer.validate``/``test`` results and the predictions (returned, and written once per DP rank by the
    prediction writer) equal one process's."""
    out, ranks = runs(layout)
    dp = layout[0]
    worst = 0.0
    for r in ranks:
        for key in ("val_loss", "val_ce"):
            worst = max(worst, abs(r["validate"][key] - reference["validate"][key]))
        worst = max(worst, abs(r["test"]["test_loss"] - reference["test"]["test_loss"]))
        peers = [q for q in ranks if q["grid"][1:] == r["grid"][1:]]
        seen = {int(i): row for q in peers for i, row in q["predict"].items()}
        assert sorted(seen) == list(range(W.EVAL_ROWS))
        worst = max(worst, max((torch.tensor(row, dtype=torch.float64) - reference["predict"][i]).abs().max().item()
                               for i, row in seen.items()))
    written = sorted(out.glob("pred_rank*.pt"))
    assert len(written) == dp, written  # one writer per DP replica: the first rank of its MP group and pipeline
    rows: dict = {}
    for path in written:
        rows.update(torch.load(path, weights_only=True))
    assert sorted(rows) == list(range(W.EVAL_ROWS))
    worst = max(worst, max((rows[i] - reference["predict"][i]).abs().max().item() for i in rows))
    print(f"pipeline validate/test/predict (dp, pp, mp)={layout}: max |ours - one process| = {worst:.2e}")
    assert worst <= TOL, (layout, worst)


@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"dp{a}pp{b}mp{c}" for a, b, c in LAYOUTS])
def test_each_rank_holds_only_its_stage_while_evaluating(runs, layout):
    """In every ``on_validation_batch_end`` (during fit and in ``trainer.validate``) a rank's parameters with
    storage are its stage's only: the ranks of one MP rank and DP replica sum to the MP-local model plus the tied
    table held by both stages, never the whole model on one rank."""
    _, ranks = runs(layout)
    mp = layout[2]
    for r in ranks:
        dense = r["dense_bytes"]
        for held in (r["held_fit"], r["held_validate"]):
            assert len(held) == 1, held  # the same bytes at every batch
            assert held[0] < 0.6 * dense, (r["grid"], held, dense)
        stages = [q["held_fit"][0] for q in ranks if q["grid"][0] == r["grid"][0] and q["grid"][2] == r["grid"][2]]
        table = 64 * 32 * 8 // mp  # GPT's tied table (vocab 64 x 32, float64), split over MP, on both stages
        print(f"(dp, pp, mp)={layout} grid {r['grid']}: holds {r['held_fit'][0]} B while evaluating, the stages "
              f"{stages} of {dense} B")
        assert sum(stages) - table <= dense, (stages, dense)


@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"dp{a}pp{b}mp{c}" for a, b, c in LAYOUTS])
def test_checkpoints_are_written_from_the_stages(runs, reference, layout):
    """Saved at the end of training in both formats with nothing synced: each rank still holds only its stage
    afterwards; the consolidated file holds one process's weights and AdamW state (1e-8) and the sharded folder
    converts to exactly that file."""
    out, ranks = runs(layout)
    for r in ranks:
        assert r["held_after_save"] == r["held_fit"][0], (r["grid"], r["held_after_save"], r["held_fit"])
    ours, ref = torch.load(out / "eval_c.ckpt", weights_only=True), reference["ckpt"]
    assert ours["state_dict"].keys() == ref["state_dict"].keys()
    worst = max((ours["state_dict"][k] - v).abs().max().item() for k, v in ref["state_dict"].items())
    mine, theirs = ours["optimizer_states"][0]["state"], ref["optimizer_states"][0]["state"]
    assert mine.keys() == theirs.keys()
    for idx, per in theirs.items():
        assert mine[idx].keys() == per.keys(), idx
        for key, value in per.items():
            worst = max(worst, (torch.as_tensor(mine[idx][key]).double() - torch.as_tensor(value).double())
                        .abs().max().item())
    print(f"pipeline checkpoint from the stages (dp, pp, mp)={layout}: max |ours - one process| = {worst:.2e}")
    assert worst <= TOL, (layout, worst)
    sharded = load_sharded_full(str(out / "eval_s.ckpt"))
    for key, value in ours["state_dict"].items():
        assert torch.equal(sharded["state_dict"][key], value), key
    for idx, per in mine.items():
        for key, value in per.items():
            assert torch.equal(torch.as_tensor(sharded["optimizer_states"][0]["state"][idx][key]),
                               torch.as_tensor(value)), (idx, key)
