"""Sharded (DCP) checkpoints of fused projections (q|k|v in one weight, split block by block).

FusedLM trains 10 steps at (1, 2) (float64, AdamW + LR warm-up, norm clipping) and saves sharded and consolidated in
``on_train_end``; both resume to 20 steps at (1, 4) (the same blocks, split 4 ways), (2, 1) (nothing split: the
blocks are read dense) and on one device with plain Lightning (the converted folder). The oracle is the same
interrupted run done by single-process Lightning; the sharded folder must also give exactly what the consolidated
file gives.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_dpmp.checkpoint.convert import convert
from lightning_dpmp.checkpoint.sharded import META_FILE, is_sharded_checkpoint
from tests.conftest import run_script
from tests.distributed import checkpoint_worker as W
from tests.support.models import build, reference_loader

WORKER = "tests/distributed/checkpoint_worker.py"
LAYOUTS = [(1, 4), (2, 1)]
TOL = 1e-8


def _single(steps: int, callbacks=()) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=1, precision="64-true", max_steps=steps, gradient_clip_val=W.CLIP,
        gradient_clip_algorithm="norm", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=list(callbacks),
    )


def _resume_single(path) -> dict:
    L.seed_everything(W.SEED)
    model, data = build("fused")
    model = model.double()
    _single(2 * W.STEPS).fit(model, reference_loader(data, W.GLOBAL_BATCH, W.SEED), ckpt_path=str(path))
    return model.state_dict()


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in b)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fused_ckpt")
    for dp, mp in [W.FUSED_SAVE_LAYOUT] + LAYOUTS:
        proc = run_script([WORKER, "fused", str(out), str(dp), str(mp)], timeout=600)
        assert proc.returncode == 0, proc.stderr[-6000:]
    return out


@pytest.fixture(scope="module")
def reference(run):
    L.seed_everything(W.SEED)
    model, data = build("fused")
    model = model.double()
    _single(W.STEPS, [W.SaveAtTrainEnd([(False, str(run / "ref10.ckpt"))])]).fit(
        model, reference_loader(data, W.GLOBAL_BATCH, W.SEED)
    )
    return _resume_single(run / "ref10.ckpt")


@pytest.mark.slow
def test_fused_sharded_checkpoint_resumes_at_any_layout(run, reference):
    assert is_sharded_checkpoint(run / "fused_s.ckpt")
    fused = torch.load(run / "fused_s.ckpt" / META_FILE, weights_only=True)["dpmp_sharded"]["fused"]
    assert fused["model/net.blocks.0.qkv.weight"] == 3 and fused["optim0/net.blocks.1.qkv.weight/exp_avg"] == 3, fused
    L.seed_everything(W.SEED)
    init = build("fused")[0].double().state_dict()
    assert _max_diff(reference, init) > 1e-2, "training did not move the weights: the comparison would prove nothing"
    for dp, mp in LAYOUTS:
        final = {tag: torch.load(run / f"fused_final_{dp}{mp}_{tag}.pt", weights_only=True) for tag in ("c", "s")}
        for tag, state in final.items():
            diff = _max_diff(state, reference)
            print(f"fused resume from {'sharded' if tag == 's' else 'consolidated'} (1,2) -> ({dp},{mp}): {diff:.2e}")
            assert diff <= TOL, (dp, mp, tag, diff)
        assert _max_diff(final["s"], final["c"]) <= TOL
    convert(str(run / "fused_s.ckpt"), str(run / "fused_converted.ckpt"))
    converted = torch.load(run / "fused_converted.ckpt", weights_only=True)
    consolidated = torch.load(run / "fused_c.ckpt", weights_only=True)
    for key, value in consolidated["state_dict"].items():  # the folder holds exactly the consolidated tensors
        assert torch.equal(converted["state_dict"][key], value), key
    for idx, per in consolidated["optimizer_states"][0]["state"].items():
        for key, value in per.items():
            assert torch.equal(converted["optimizer_states"][0]["state"][idx][key], value), (idx, key)
    diff = _max_diff(_resume_single(run / "fused_converted.ckpt"), reference)
    print(f"fused resume of the converted folder on one device (plain Lightning): {diff:.2e}")
    assert diff <= TOL
