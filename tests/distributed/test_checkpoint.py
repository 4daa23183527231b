"""Checkpoints: resume at other layouts on the single-process trajectory, sharded <-> consolidated, ModelCheckpoint,
a mismatched model refused with a clear error, the spawn launcher with sharded saves.

One 4-process launch trains SchedResMLP (AdamW + per-step StepLR + norm clipping, float64) for 10 steps at (2, 2),
saves sharded and consolidated in ``on_train_end``, and resumes both to 20 steps at (2, 2), (1, 4), (4, 1). The
oracle is the same *interrupted* run done by single-process Lightning (save at 10, ``fit(ckpt_path=...)`` to 20):
Lightning's fit loop decides which batches a resumed run sees (a non-resumable loader restarts the epoch's
permutation), so only an interrupted reference compares like with like. The reference model is float64 from the
start, because single-process Lightning restores *before* the precision plugin converts the module (a float64
checkpoint would be rounded through float32, ~6e-8); DPMPStrategy restores after setup and keeps every bit.
"""

from __future__ import annotations

import json
import os

import lightning as L
import pytest
import torch

from lightning_dpmp.checkpoint.convert import convert
from lightning_dpmp.checkpoint.sharded import is_sharded_checkpoint
from tests.conftest import run_ranks, run_script
from tests.distributed import checkpoint_worker as W
from tests.support.models import ResMLP, make_dataset, reference_loader

WORKER = "tests/distributed/checkpoint_worker.py"
TOL = 1e-8


def _single(steps: int, callbacks=()) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=1, precision="64-true", max_steps=steps, gradient_clip_val=W.CLIP,
        gradient_clip_algorithm="norm", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=list(callbacks),
    )


def _resume_single(path) -> tuple[dict, float]:
    L.seed_everything(W.SEED)
    model = W.SchedResMLP().double()
    trainer = _single(2 * W.STEPS)
    trainer.fit(model, reference_loader(make_dataset(), W.GLOBAL_BATCH, W.SEED), ckpt_path=str(path))
    return model.state_dict(), trainer.optimizers[0].param_groups[0]["lr"]


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in b)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt")
    proc = run_ranks(4, [WORKER, "resume", str(out)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return out


@pytest.fixture(scope="module")
def reference(run):
    """The single-process interrupted run: 10 steps, save in on_train_end, resume to 20."""
    L.seed_everything(W.SEED)
    model = W.SchedResMLP().double()
    _single(W.STEPS, [W.SaveAtTrainEnd([(False, str(run / "ref10.ckpt"))])]).fit(
        model, reference_loader(make_dataset(), W.GLOBAL_BATCH, W.SEED)
    )
    return _resume_single(run / "ref10.ckpt")


@pytest.mark.slow
def test_resume_at_any_layout_matches_single_process_interrupted_run(run, reference):
    ref, ref_lr = reference
    report = json.loads((run / "resume.json").read_text())
    init = W.SchedResMLP().double().state_dict()
    assert _max_diff(ref, init) > 1e-2, "training did not move the weights: the comparison would prove nothing"
    for dp, mp in W.RESUME_LAYOUTS:
        for tag in ("c", "s"):
            final = torch.load(run / f"final_{dp}{mp}_{tag}.pt", weights_only=True)
            diff = _max_diff(final, ref)
            kind = "consolidated" if tag == "c" else "sharded"
            print(f"resume from {kind} (2,2) -> ({dp},{mp}): max |w - w_ref| = {diff:.2e}")
            assert diff <= TOL, (dp, mp, tag, diff)
            assert report[f"{dp}{mp}{tag}"] == {"global_step": 20, "lr": pytest.approx(ref_lr, rel=1e-12)}
    # On one device, without this package: the consolidated file, and the converted sharded folder.
    convert(str(run / "s.ckpt"), str(run / "converted.ckpt"))
    for name in ("c.ckpt", "converted.ckpt"):
        final, lr = _resume_single(run / name)
        diff = _max_diff(final, ref)
        print(f"resume {name} on a single device (plain Lightning): max |w - w_ref| = {diff:.2e}")
        assert diff <= TOL and lr == pytest.approx(ref_lr, rel=1e-12)


@pytest.mark.slow
def test_sharded_folder_converts_to_the_consolidated_file(run, tmp_path):
    assert is_sharded_checkpoint(run / "s.ckpt")
    proc = run_script(["-m", "lightning_dpmp.convert", str(run / "s.ckpt"), str(tmp_path / "out.ckpt")], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "18 tensors" in proc.stdout
    converted = torch.load(tmp_path / "out.ckpt", weights_only=True)
    consolidated = torch.load(run / "c.ckpt", weights_only=True)
    ResMLP().double().load_state_dict(converted["state_dict"], strict=True)  # the plain model, strict
    for key, value in consolidated["state_dict"].items():
        assert torch.equal(converted["state_dict"][key], value), key
    ours, theirs = converted["optimizer_states"][0], consolidated["optimizer_states"][0]
    assert ours["param_groups"] == theirs["param_groups"] and ours["state"].keys() == theirs["state"].keys()
    for idx, per in theirs["state"].items():
        for key, value in per.items():
            assert torch.equal(ours["state"][idx][key], value), (idx, key)
    for key in ("loops", "lr_schedulers", "callbacks", "global_step", "epoch", "hyper_parameters"):
        assert converted[key] == consolidated[key], key
    assert consolidated["dpmp"]["dp"] == 2 and len(consolidated["dpmp"]["rng_states"]) == 4


@pytest.mark.slow
def test_model_checkpoint_top_k_and_last_with_both_formats(run):
    # Sharded, every 3 steps, top 2 by step, save_last: step 3's folder was removed by remove_checkpoint.
    sharded = sorted(os.listdir(run / "mc_sharded"))
    assert sharded == ["epoch=0-step=6.ckpt", "epoch=0-step=9.ckpt", "last.ckpt"], sharded
    assert all(is_sharded_checkpoint(run / "mc_sharded" / name) for name in sharded)
    last = convert(str(run / "mc_sharded" / "last.ckpt"), str(run / "mc_last.ckpt"))
    assert last["tensors"] == 18 and torch.load(run / "mc_last.ckpt", weights_only=True)["global_step"] == 9
    # Consolidated, on the resumed (1, 4) run: every 4 steps (12, 16, 20), top 1.
    assert sorted(os.listdir(run / "mc_consolidated")) == ["epoch=1-step=20.ckpt", "last.ckpt"]
    ResMLP().double().load_state_dict(
        torch.load(run / "mc_consolidated" / "last.ckpt", weights_only=True)["state_dict"], strict=True
    )
    # Atomic writes leave no temporary or displaced entries behind when nothing crashed.
    leftovers = [n for _, dirs, files in os.walk(run) for n in dirs + files if ".tmp-" in n or ".old-" in n]
    assert not leftovers, leftovers


@pytest.mark.slow
def test_mismatched_checkpoint_names_the_first_difference(run):
    proc = run_ranks(2, [WORKER, "mismatch", str(run)], timeout=300)
    assert proc.returncode != 0
    assert (
        "Checkpoint does not match the model: 'blocks.0.fc1.weight' has shape (32, 16) in the checkpoint"
        " but (48, 16) in the model." in proc.stderr
    ), proc.stderr[-4000:]


@pytest.mark.slow
def test_spawn_launcher_returns_a_dense_model_with_sharded_saves(tmp_path):
    proc = run_script([WORKER, "spawn", str(tmp_path)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    report = json.loads((tmp_path / "spawn.json").read_text())
    assert report == {"dense_in_main_process": True, "trained": True}
    # The parent (no process group) can still write the sharded format; it converts to the same weights.
    assert is_sharded_checkpoint(tmp_path / "spawn.ckpt")
    convert(str(tmp_path / "spawn.ckpt"), str(tmp_path / "spawn_consolidated.ckpt"))
    state = torch.load(tmp_path / "spawn_consolidated.ckpt", weights_only=True)["state_dict"]
    parent = torch.load(tmp_path / "spawn_parent_state.pt", weights_only=True)
    plain = ResMLP().double()
    plain.load_state_dict(state, strict=True)
    assert all(torch.equal(state[k], parent[k]) for k in parent)
