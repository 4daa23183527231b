"""After ``fit`` (issue 42, items 1 and 6): what each rank holds at every ``consolidate_on_teardown`` and ZeRO level,
with and without a pipeline, and everything a user does next.

One 4-process launch per pipeline setting, (dp, pp, mp) = (2, 1, 2) (DTensor parameters at zero=0) and (2, 2, 1),
runs GPT (tied embeddings, float64, AdamW with an LR warm-up) through every case of
``tests/distributed/after_fit_worker.py``: zero 0..3 times ``consolidate_on_teardown`` ``"rank0"``, ``True``,
``False``, each under ``save_distributed_checkpoint=True``. The oracle is single-process Lightning doing the same
(fit 4 steps, save, validate/test/predict, a second fit of 2 steps with a new Trainer, a resume to 6 steps).

- after ``fit``, ``"rank0"``: rank 0 holds the plain model and its optimizer state, the other ranks nothing but meta
  tensors, at every ZeRO level (item 6); ``True``: every rank the same plain model; ``False``: every rank its
  MP-local model (split at mp > 1);
- ``trainer.save_checkpoint`` then works in both formats (a sharded folder crashed on the meta tensors with "Cannot
  copy out of meta tensor"): the consolidated file holds the single-process weights and AdamW moments within 1e-8,
  rank 0's module equals it exactly, and the sharded folder converts to exactly the consolidated file;
- ``validate``, ``test`` and ``predict`` on the same trainer give the single-process losses and logits (1e-8);
- a second ``fit`` on the same module with a new Trainer ends on the single-process weights (1e-8);
- a fresh fit resuming the sharded folder (zero=3) ends on the single-process resumed weights (1e-8).
"""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_dpmp.checkpoint.sharded import is_sharded_checkpoint, load_sharded_full
from tests.conftest import run_ranks
from tests.distributed import after_fit_worker as W
from tests.support.models import build, reference_loader
from tests.support.reference import one_process_trainer

pytestmark = pytest.mark.slow

WORKER = "tests/distributed/after_fit_worker.py"
TOL = 1e-8
CASES = [f"z{z}:{mode}" for z in range(4) for mode in W.CONSOLIDATE]
RESUMED = "z3:rank0+resume"
RUNS = [RESUMED if c == "z3:rank0" else c for c in CASES]
DENSE_PARAMS = 28_032  # GPT's parameters (the tied table once)


def _tag(spec: str) -> str:
    return spec.replace(":", "_").replace("+", "_")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Single-process Lightning: fit, save, validate/test/predict, a second fit, and a resume of the first save."""
    out = tmp_path_factory.mktemp("after_fit_ref")
    L.seed_everything(W.SEED)
    module, data = build("gpt")
    model = W.EvalLM(module.net).double()  # float64 from the start, as DPMPStrategy's conversion leaves it
    trainer = one_process_trainer(max_steps=W.STEPS)
    trainer.fit(model, reference_loader(data, W.GLOBAL_BATCH, W.SEED))
    trainer.save_checkpoint(out / "ref.ckpt")
    evals = DataLoader(W.eval_data(), batch_size=W.EVAL_ROWS)
    ref = {"fit": torch.load(out / "ref.ckpt", weights_only=True),
           "val_loss": trainer.validate(model, evals, verbose=False)[0]["val_loss"],
           "test_loss": trainer.test(model, evals, verbose=False)[0]["test_loss"]}
    with torch.no_grad():
        x, _, _ = W.eval_data().tensors
        ref["predict"] = model(x).sum(-1)
    one_process_trainer(max_steps=W.MORE).fit(model, reference_loader(data, W.GLOBAL_BATCH, W.SEED))
    ref["again"] = {k: v.clone() for k, v in model.state_dict().items()}
    L.seed_everything(W.SEED)
    fresh, _ = build("gpt")
    resumed = W.EvalLM(fresh.net).double()
    one_process_trainer(max_steps=W.STEPS + W.MORE).fit(resumed, reference_loader(data, W.GLOBAL_BATCH, W.SEED),
                                                       ckpt_path=str(out / "ref.ckpt"))
    ref["resumed"] = resumed.state_dict()
    return ref


@pytest.fixture(scope="module", params=[1, 2], ids=["pp1", "pp2"])
def run(request, tmp_path_factory):
    pp = request.param
    out = tmp_path_factory.mktemp(f"after_fit_pp{pp}")
    proc = run_ranks(4, [WORKER, str(pp), str(out), ",".join(RUNS)], timeout=1500)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return pp, out, [json.loads((out / f"pp{pp}_rank{r}.json").read_text()) for r in range(4)]


def _diff(ours: dict, ref: dict) -> float:
    assert ours.keys() == ref.keys(), set(ours) ^ set(ref)
    return max((ours[k].double() - ref[k].double()).abs().max().item() for k in ref)


def _state_diff(ours: dict, ref: dict) -> float:
    """Largest difference between two optimizer ``state`` dicts (every tensor; scalars must be equal)."""
    assert ours.keys() == ref.keys()
    worst = 0.0
    for idx, per in ref.items():
        assert ours[idx].keys() == per.keys(), idx
        for key, value in per.items():
            worst = max(worst, (torch.as_tensor(ours[idx][key]).double() - torch.as_tensor(value).double())
                        .abs().max().item())
    return worst


def _equal_checkpoints(a: dict, b: dict) -> None:
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for key, value in b["state_dict"].items():
        assert torch.equal(a["state_dict"][key], value), key
    sa, sb = a["optimizer_states"][0], b["optimizer_states"][0]
    assert sa["param_groups"] == sb["param_groups"] and sa["state"].keys() == sb["state"].keys()
    for idx, per in sb["state"].items():
        for key, value in per.items():
            assert torch.equal(torch.as_tensor(sa["state"][idx][key]), torch.as_tensor(value)), (idx, key)


@pytest.mark.parametrize("spec", RUNS)
def test_what_each_rank_holds_after_fit(run, spec):
    pp, _, ranks = run
    mode, dense = spec.split("+")[0].split(":")[1], DENSE_PARAMS * 8
    for stage in ("after_fit", "after_eval", "after_again"):
        held = [r[spec][stage] for r in ranks]
        if mode == "rank0":  # item 6: rank 0 the plain model, every other rank nothing but shapes
            assert not held[0]["any_meta"] and not held[0]["split"] and held[0]["param_bytes"] == dense, held[0]
            assert not held[0]["state_meta"] and held[0]["state_bytes"] == 2 * dense, held[0]
            for h in held[1:]:
                assert h["all_meta"] and h["state_meta"] and h["param_bytes"] == h["state_bytes"] == 0, (stage, h)
        elif mode == "true":
            for h in held:
                assert not h["any_meta"] and not h["split"] and h["param_bytes"] == dense, (stage, h)
                assert h["state_bytes"] == 2 * dense and h["checksum"] == held[0]["checksum"], (stage, h)
        else:  # left as trained: the MP-local model, split at mp > 1
            for h in held:
                assert not h["any_meta"] and h["split"] == (pp == 1), (stage, h)
                assert h["param_bytes"] < dense if pp == 1 else h["param_bytes"] == dense, (stage, h)


@pytest.mark.parametrize("spec", RUNS)
def test_save_after_fit_in_both_formats_holds_the_trained_state(run, reference, spec):
    pp, out, _ = run
    tag = _tag(spec)
    consolidated = torch.load(out / f"{tag}_c.ckpt", weights_only=True)
    ref = reference["fit"]
    assert _diff(ref["state_dict"], build("gpt")[0].double().state_dict()) > 1e-3, "training did not move"
    weights = _diff(consolidated["state_dict"], ref["state_dict"])
    moments = _state_diff(consolidated["optimizer_states"][0]["state"], ref["optimizer_states"][0]["state"])
    print(f"pp={pp} {spec}: saved after fit, max |w - w_ref| = {weights:.2e}, optimizer state {moments:.2e}")
    assert weights <= TOL and moments <= TOL, (weights, moments)
    assert consolidated["global_step"] == W.STEPS
    if "false" not in spec:  # rank 0's module holds exactly what was saved
        module = torch.load(out / f"{tag}_weights.pt", weights_only=True)
        for key, value in consolidated["state_dict"].items():
            assert torch.equal(module[key], value), key
    assert is_sharded_checkpoint(out / f"{tag}_s.ckpt")
    _equal_checkpoints(load_sharded_full(str(out / f"{tag}_s.ckpt")), consolidated)


@pytest.mark.parametrize("spec", RUNS)
def test_validate_test_predict_and_a_second_fit_after_fit(run, reference, spec):
    pp, out, ranks = run
    for r in ranks:
        got = r[spec]
        assert abs(got["val_loss"] - reference["val_loss"]) <= TOL, (got["val_loss"], reference["val_loss"])
        assert abs(got["test_loss"] - reference["test_loss"]) <= TOL
    seen: dict[int, list] = {}
    for r in ranks:
        seen.update({int(i): row for i, row in r[spec]["predict"].items()})
    assert sorted(seen) == list(range(W.EVAL_ROWS))  # the DP ranks' shares cover the set
    worst = max((torch.tensor(row, dtype=torch.float64) - reference["predict"][i]).abs().max().item()
                for i, row in seen.items())
    again = _diff(torch.load(out / f"{_tag(spec)}_again.ckpt", weights_only=True)["state_dict"], reference["again"])
    print(f"pp={pp} {spec}: predict max diff {worst:.2e}, second fit max |w - w_ref| = {again:.2e}")
    assert worst <= TOL and again <= TOL, (worst, again)


def test_a_fresh_fit_resumes_the_folder_saved_after_fit(run, reference):
    pp, out, _ = run
    resumed = torch.load(out / f"{_tag(RESUMED)}_resumed.ckpt", weights_only=True)
    diff = _diff(resumed["state_dict"], reference["resumed"])
    print(f"pp={pp}: resumed the sharded folder saved after fit (zero=3), max |w - w_ref| = {diff:.2e}")
    assert diff <= TOL and resumed["global_step"] == W.STEPS + W.MORE
