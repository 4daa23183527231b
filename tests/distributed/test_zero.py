"""ZeRO-2/3 (issue 14): single-process weights, exact DP collectives, bytes held per rank, resume across zero levels.

Two 4-process launches of ``zero_worker.py``: (2, 2) then (4, 1), the second resuming the first's (2,2,zero=3)
checkpoints. ResMLP and the GPT example (tied embeddings: the root unit's), 20 AdamW steps with norm clipping in
float64, must land within 1e-8 of single-process training, as every other layout does.
"""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch

from tests.conftest import run_ranks
from tests.distributed import checkpoint_worker as CW
from tests.support.models import build, make_dataset, reference_loader
from tests.support.reference import reference_run

WORKER = "tests/distributed/zero_worker.py"
TOL = 1e-8
RUNS = [(name, zero) for name in ("resmlp", "gpt") for zero in (2, 3)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero_reference")
    return {name: reference_run(name, "64-true", tmp / f"{name}.ckpt") for name in ("resmlp", "gpt", "gpt_frozen")}


def _launch(tmp_path_factory, dp: int, mp: int, *extra: str):
    out = tmp_path_factory.mktemp(f"zero_{dp}x{mp}")
    proc = run_ranks(dp * mp, [WORKER, str(dp), str(mp), str(out), *extra], timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(dp * mp)]


@pytest.fixture(scope="module")
def grid22(tmp_path_factory):
    return _launch(tmp_path_factory, 2, 2)


@pytest.fixture(scope="module")
def grid41(tmp_path_factory, grid22):
    return _launch(tmp_path_factory, 4, 1, str(grid22[0]))


@pytest.fixture(scope="module", params=["22", "41"])
def layout(request, grid22, grid41):
    return {"22": (2, 2, *grid22), "41": (4, 1, *grid41)}[request.param]


def _diff(ckpt: dict, ref: dict) -> float:
    ours, theirs = ckpt["state_dict"], ref["state_dict"]
    assert ours.keys() == theirs.keys()
    return max((ours[k] - theirs[k]).abs().max().item() for k in theirs)


@pytest.mark.slow
def test_weights_and_optimizer_state_match_single_process(layout, reference):
    dp, mp, out, _ = layout
    for name, zero in RUNS:
        ckpt = torch.load(out / f"{name}_z{zero}.ckpt", weights_only=True)
        plain, _ = build(name)
        plain.double().load_state_dict(ckpt["state_dict"], strict=True)  # consolidated: loads into the plain model
        worst = _diff(ckpt, reference[name])
        print(f"zero={zero} {name} dp={dp} mp={mp}: max |w - w_ref| = {worst:.2e}")
        assert worst <= TOL, (name, zero, worst)
        ours, theirs = ckpt["optimizer_states"][0]["state"], reference[name]["optimizer_states"][0]["state"]
        assert ours.keys() == theirs.keys()
        for i in theirs:
            for key in ("exp_avg", "exp_avg_sq"):
                assert ours[i][key].shape == theirs[i][key].shape
                assert (ours[i][key] - theirs[i][key]).abs().max().item() <= TOL, (name, zero, i, key)


@pytest.mark.slow
def test_exact_dp_collectives_per_step(layout):
    dp, mp, _, ranks = layout
    for name, zero in RUNS:
        for r in ranks:
            res = r[f"{name}_z{zero}"]
            b, counts = res["buckets"], res["counts"]
            # One bucket per unit (2 blocks + the root) and kind: MP-split and replicated at mp=2, replicated at mp=1.
            assert b["total"] == 3 * (2 if mp > 1 else 1) and b["root"] == (2 if mp > 1 else 1)
            assert b["child"] == (4 if mp > 1 else 2) and b["units"] == 3 and b["child_units"] == 2
            # A unit's buckets go in one coalesced collective: one reduce-scatter per unit, in the backward.
            assert counts["dp/reduce_scatter"] == b["units"]
            # zero=2: one all-gather of every bucket after the step; zero=3: the root once, each block for its
            # forward and again for its backward.
            assert counts["dp/all_gather"] == (1 if zero == 2 else 1 + 2 * b["child_units"])
            assert counts["dp/all_reduce"] == 1  # the global-norm clip (no DDP all-reduce of gradients)
            assert not any(k.startswith("dp/broadcast") for k in counts)


@pytest.mark.slow
def test_bytes_held_per_rank_under_zero3(layout):
    dp, mp, _, ranks = layout
    for name in ("resmlp", "gpt"):
        model, _ = build(name)
        dense = sum(p.numel() for p in model.parameters()) * 8  # float64
        for r in ranks:
            res = r[f"{name}_z3"]
            held, local = res["held"], res["local_numel"]
            # Each rank holds 1/dp of its MP-local parameters: total/(dp*mp) at mp=1, and for the GPT at (2,2) too
            # (measured +3.4%: norms, biases, wpe are MP-replicated); ResMLP's replicated 3-class head and norms are
            # 7% of its MP-local parameters, so there the target is MP-local/dp.
            target = dense / (dp * mp) if mp == 1 or name == "gpt" else local / dp
            print(f"{name} dp={dp} mp={mp} zero=3: held {held}, total/(dp*mp) = {dense / (dp * mp):.0f}")
            for key, factor in (("parameters", 1), ("gradients", 1), ("optimizer_state", 2)):  # AdamW: 2 moments
                assert abs(held[key] - factor * target) <= 0.05 * factor * target, (name, key, held, target)
            report = res["report"]
            assert report["parameters"] == held["parameters"] and report["gradients"] == held["gradients"]
            assert 0 <= report["optimizer_state"] - held["optimizer_state"] <= 8 * 16  # + the scalar step counts
            z2 = r[f"{name}_z2"]["held"]  # zero=2 keeps the whole parameters, plus the shards it steps
            assert z2["gradients"] == held["gradients"] and z2["parameters"] > held["parameters"] * dp


@pytest.mark.slow
def test_gradient_accumulation_reduce_scatters_once_per_step_at_zero2(grid22, reference):
    out, ranks = grid22
    for zero in (2, 3):
        worst = _diff(torch.load(out / f"accum_z{zero}.ckpt", weights_only=True), reference["resmlp"])
        assert worst <= TOL, (zero, worst)  # 2 micro-batches of 2 per rank: the same global batch of 8
        counts = ranks[0][f"accum_z{zero}"]["counts"]
        # zero=2: accumulated locally, reduce-scattered on the last micro-batch; zero=3: every micro-batch
        # (the full gradients are freed as they are produced).
        assert counts["dp/reduce_scatter"] == 3 * (1 if zero == 2 else 2)  # 3 units (2 blocks + the root)


@pytest.mark.slow
def test_resume_across_dp_mp_and_zero(grid41):
    out, _ = grid41
    L.seed_everything(CW.SEED)
    model = CW.SchedResMLP().double()  # float64 from the start (see tests/distributed/test_checkpoint.py)
    single = lambda steps, cbs=(): L.Trainer(  # noqa: E731
        accelerator="cpu", devices=1, precision="64-true", max_steps=steps, gradient_clip_val=CW.CLIP,
        gradient_clip_algorithm="norm", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=list(cbs))
    loader = lambda: reference_loader(make_dataset(), CW.GLOBAL_BATCH, CW.SEED)  # noqa: E731
    single(CW.STEPS, [CW.SaveAtTrainEnd([(False, str(out / "ref10.ckpt"))])]).fit(model, loader())
    L.seed_everything(CW.SEED)
    model = CW.SchedResMLP().double()
    single(2 * CW.STEPS).fit(model, loader(), ckpt_path=str(out / "ref10.ckpt"))
    ref = {"state_dict": model.state_dict()}
    # (2,2,zero=3) sharded folder -> (4,1,zero=2); (2,2,zero=3) consolidated file -> (4,1,zero=0);
    # (4,1,zero=0) consolidated file -> (4,1,zero=3).
    for tag in ("resume_z2", "resume_z0", "resume_z3"):
        worst = _diff(torch.load(out / f"{tag}.ckpt", weights_only=True), ref)
        print(f"{tag}: max |w - w_ref| = {worst:.2e}")
        assert worst <= TOL, (tag, worst)


@pytest.mark.slow
def test_sequence_parallel_guard_meta_init_bf16_and_frozen_compose(grid22, reference):
    out, ranks = grid22
    worst = _diff(torch.load(out / "gpt_sp_z3.ckpt", weights_only=True), reference["gpt"])
    assert worst <= TOL, worst  # the partial kind's shard gradients summed over MP; the guard checked every 5 steps
    for r in ranks:
        sp = r["gpt_sp_z3"]  # a step the guard does not check gathers nothing extra
        assert sp["counts"]["dp/all_gather"] == 1 + 2 * sp["buckets"]["child_units"]
        meta = r["meta_bf16_z3"]
        assert abs(meta["held"]["parameters"] - meta["local_numel"] / 2) <= 0.05 * meta["local_numel"] / 2
        losses = meta["losses"]
        assert len(losses) == 20 and all(torch.isfinite(torch.tensor(losses)))
        assert sum(losses[-5:]) < sum(losses[:5])
        frozen = r["gpt_frozen_z3"]  # frozen attention sharded and gathered (for forward and backward), not reduced
        assert frozen["held"]["parameters"] == frozen["local_numel"] // 2
        # 2 blocks + the root, each gathered (its frozen and trainable buckets together) in one collective
        assert frozen["counts"]["dp/reduce_scatter"] == 3 and frozen["counts"]["dp/all_gather"] == 1 + 2 * 2
    ckpt = torch.load(out / "gpt_frozen_z3.ckpt", weights_only=True)
    assert _diff(ckpt, reference["gpt_frozen"]) <= TOL
    assert ckpt["optimizer_states"][0]["state"].keys() == reference["gpt_frozen"]["optimizer_states"][0]["state"].keys()
