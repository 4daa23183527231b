"""Sharded (DCP) checkpoints of fused projections (q|k|v in one weight, split block by block).

Six layouts of fused blocks: FusedLM's q|k|v Linear (blocks along dim 0), GPT-2's ``Conv1D`` c_attn (weight
stored (in, out): blocks along dim 1), the experts' stacked gate|up (E, 2I, H) (blocks along dim 1),
``nn.MultiheadAttention``'s packed ``in_proj_weight`` (blocks along dim 0), and a vocabulary no mp divides (61
rows, padded per layout: one block of dense size 61, stored without its padding), and q|k|v blocks of unequal
sizes (32 | 16 | 16). Each model
trains 10 steps at (1, 2) (float64, AdamW + LR warm-up, norm clipping) and saves sharded and consolidated in
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
from tests.conftest import run_ranks
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


MODELS = {  # model -> (a fused DCP key, its (blocks, dim))
    "fused": ("model/net.blocks.0.qkv.weight", (3, 0)),
    "hf_gpt2": ("model/net.transformer.h.0.attn.c_attn.weight", (3, 1)),
    "moe": ("model/net.blocks.0.moe.experts.gate_up", (2, 1)),
    "torch_encoder": ("model/encoder.layers.0.self_attn.in_proj_weight", (3, 0)),
    # a vocabulary of 61: padded to 62 rows at mp=2 and to 64 at mp=4; stored with its 61 dense rows
    "torch_encoder_vocab61": ("model/embed.weight", ([61], 0)),
    # q|k|v of unequal sizes (8 query, 4 key/value heads of 4): blocks 32 | 16 | 16
    "sized_qkv_split": ("model/net.blocks.0.attn.qkv.weight", ([32, 16, 16], 0)),
}


def _resume_single(path, name: str) -> dict:
    L.seed_everything(W.SEED)
    model, data = build(name)
    model = model.double()
    _single(2 * W.STEPS).fit(model, reference_loader(data, W.GLOBAL_BATCH, W.SEED), ckpt_path=str(path))
    return model.state_dict()


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in b)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """All four models in one launch per layout (a launch costs seconds; the fits inside it do not)."""
    out = tmp_path_factory.mktemp("fused_ckpt")
    for dp, mp in [W.FUSED_SAVE_LAYOUT] + LAYOUTS:
        proc = run_ranks(dp * mp, [WORKER, "fused", str(out), str(dp), str(mp), ",".join(sorted(MODELS))], timeout=900)
        assert proc.returncode == 0, proc.stderr[-6000:]
    return out


@pytest.fixture(scope="module", params=sorted(MODELS))
def run(request, runs):
    return request.param, runs


@pytest.fixture(scope="module")
def reference(run):
    name, out = run
    L.seed_everything(W.SEED)
    model, data = build(name)
    model = model.double()
    _single(W.STEPS, [W.SaveAtTrainEnd([(False, str(out / "ref10.ckpt"))])]).fit(
        model, reference_loader(data, W.GLOBAL_BATCH, W.SEED)
    )
    return _resume_single(out / "ref10.ckpt", name)


@pytest.mark.slow
def test_fused_sharded_checkpoint_resumes_at_any_layout(run, reference):
    name, out = run
    assert is_sharded_checkpoint(out / f"{name}_s.ckpt")
    fused = torch.load(out / f"{name}_s.ckpt" / META_FILE, weights_only=True)["dpmp_sharded"]["fused"]
    key, layout = MODELS[name]
    assert tuple(fused[key]) == layout, fused
    opt_key = key.replace("model/", "optim0/", 1) + "/exp_avg"
    assert tuple(fused[opt_key]) == layout, fused
    L.seed_everything(W.SEED)
    init = build(name)[0].double().state_dict()
    assert _max_diff(reference, init) > 1e-2, "training did not move the weights: the comparison would prove nothing"
    for dp, mp in LAYOUTS:
        final = {tag: torch.load(out / f"{name}_final_{dp}{mp}_{tag}.pt", weights_only=True) for tag in ("c", "s")}
        for tag, state in final.items():
            diff = _max_diff(state, reference)
            print(f"{name} resume from {'sharded' if tag == 's' else 'consolidated'} (1,2) -> ({dp},{mp}): {diff:.2e}")
            assert diff <= TOL, (name, dp, mp, tag, diff)
        assert _max_diff(final["s"], final["c"]) <= TOL
    convert(str(out / f"{name}_s.ckpt"), str(out / f"{name}_converted.ckpt"))
    converted = torch.load(out / f"{name}_converted.ckpt", weights_only=True)
    consolidated = torch.load(out / f"{name}_c.ckpt", weights_only=True)
    for k, value in consolidated["state_dict"].items():  # the folder holds exactly the consolidated tensors
        assert torch.equal(converted["state_dict"][k], value), k
    for idx, per in consolidated["optimizer_states"][0]["state"].items():
        for k, value in per.items():
            assert torch.equal(converted["optimizer_states"][0]["state"][idx][k], value), (idx, k)
    diff = _max_diff(_resume_single(out / f"{name}_converted.ckpt", name), reference)
    print(f"{name} resume of the converted folder on one device (plain Lightning): {diff:.2e}")
    assert diff <= TOL
