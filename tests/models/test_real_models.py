"""Real architectures (transformers' Llama and friends, torch's own layers) under DPMPStrategy: the Megatron layout
found with no plan written, checked against single-process training.

For every model of ``tests.support.real_models.REAL_MODELS`` at mp=2 and mp=4 (where its heads allow):
- weights within 1e-8 of single-process training in float64 (20 AdamW steps, norm clipping; a model that computes
  part of the step in float32 whatever the precision says so with its own ``float64_tol``);
- every Linear-like layer of every block is ``column`` or ``row`` (head-parallel attention, split MLP),
  ``experts`` (stacked expert weights split along the intermediate dim, its router kept replicated), or
  ``heads`` (an ``nn.MultiheadAttention``, its out_proj ``row``);
- per-rank parameters exactly split/mp + replicated, counted from the tensors;
- exactly 2 MP all-reduces forward + 2 backward per block (3 + 3 with cross-attention), no all-gather in a block,
  and the counted collectives of a whole step equal to the plan's figures.

One launch per layout trains every model (float64 only: the float32 tolerance is covered by the other suites).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import run_ranks
from tests.support.real_models import REAL_MODELS
from tests.support.reference import max_weight_diff, reference_run

pytest.importorskip("transformers")

LAYOUTS = [(1, 2), (1, 4), (2, 2)]
MODELS = sorted(REAL_MODELS)


def _models_for(mp: int) -> list[str]:
    return [m for m in MODELS if REAL_MODELS[m].max_mp >= mp]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("real_reference")
    return {m: reference_run(m, "64-true", tmp / f"{m}.ckpt") for m in MODELS}


@pytest.fixture(scope="module", params=LAYOUTS, ids=lambda layout: f"dp{layout[0]}_mp{layout[1]}")
def run(request, tmp_path_factory):
    dp, mp = request.param
    out = tmp_path_factory.mktemp(f"real_dp{dp}_mp{mp}")
    models = _models_for(mp)
    proc = run_ranks(
        dp * mp, ["tests/distributed/parity_worker.py", str(dp), str(mp), str(out), ",".join(models)], timeout=900,
        env={"PRECISIONS": "64-true"},
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(dp * mp)]
    return dp, mp, out, ranks


def _skip_unless_run(model: str, mp: int) -> None:
    if REAL_MODELS[model].max_mp < mp:
        pytest.skip(f"{model}: its heads do not divide by mp={mp}")


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_weights_match_single_process(run, reference, model):
    dp, mp, out, _ = run
    _skip_unless_run(model, mp)
    worst = max_weight_diff(torch.load(out / f"{model}_64.ckpt", weights_only=True), reference[model])
    print(f"real-model parity {model} dp={dp} mp={mp} float64: max |w - w_ref| = {worst:.2e}")
    tol = REAL_MODELS[model].float64_tol
    assert worst <= tol, f"{model} dp={dp} mp={mp}: {worst:.3e} > {tol:.0e}"


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_megatron_layout_and_collectives(run, reference, model):
    dp, mp, _, ranks = run
    _skip_unless_run(model, mp)
    spec = REAL_MODELS[model]
    dense = {k: v.numel() for k, v in reference[model]["state_dict"].items()}
    for rank, res in enumerate(ranks):
        r = res[f"{model}_64"]
        assert r["verified"] is True, (rank, model)
        assert r["consistent"] == {"dp_replicas_bitwise_equal": True, "mp_replicated_bitwise_equal": True}
        styles, notes = r["styles"], r["notes"]
        assert {n: styles[n] for n in spec.vocab} == {n: "vocab" for n in spec.vocab}, (model, notes)
        blocks = r["per_block"]  # the plan's blocks: module paths up to their first numeric index
        assert len(blocks) == spec.n_blocks, sorted(blocks)
        for _name, b in blocks.items():
            layout = {n: styles[n] for n in b["layers"]}
            # split: column/row pairs, experts, and "heads": an nn.MultiheadAttention as one entry
            # (F.multi_head_attention_forward reads its in_proj and out_proj.weight without calling a Linear, so
            # the attention module is the layer that is split; its out_proj is listed as "row"). Whole: only the
            # routers of experts (Megatron's layout).
            ok = {
                n: s in ("column", "row", "experts", "heads")
                or (s == "replicate" and notes[n].startswith("router of "))
                for n, s in layout.items()
            }
            assert layout and all(ok.values()), (model, layout)
        # parameters held: exactly 1/mp of every split one (a vocabulary mp does not divide: ceil(V/mp) rows, the
        # padding), all of every replicated one
        shapes = {k: v.shape for k, v in reference[model]["state_dict"].items()}
        expected = sum(dense[n] // shapes[n][dim] * -(-shapes[n][dim] // mp) if split else dense[n]
                       for n, (_, split, dim) in r["local_params"].items())
        assert sum(n for n, _, _ in r["local_params"].values()) == expected
        # collectives: exactly one all-reduce per sublayer each way (2 + 2 for attention + MLP), no all-gather,
        # and head-parallel attention
        for name, b in blocks.items():
            fwd, bwd = spec.per_block(name)
            assert b["forward"] == {"all_reduce": fwd, "all_gather": 0}, (model, name, b)
            assert b["backward"] == {"all_reduce": bwd, "all_gather": 0}, (model, name, b)
            assert b["head_parallel"] is spec.attention, (model, name, b)
        # and the whole step issues exactly what the plan says (+1 all-reduce: the global clipping norm; +1: the
        # sum of the partial gradients, where whole parameters are read inside split regions, Qwen3's q/k norms)
        analytic = r["analytic"]
        counted = {k: v for k, v in r["counts"].items() if k.startswith("mp/")}
        summed = 1 if r["partial"] else 0
        expected = {"mp/all_reduce": analytic["forward"]["all_reduce"] + analytic["backward"]["all_reduce"] + 1
                    + summed}
        gathers = analytic["forward"]["all_gather"] + analytic["backward"]["all_gather"]
        if gathers:  # outside the blocks only (e.g. BERT's MLM transform, read by a LayerNorm)
            expected["mp/all_gather"] = gathers
        assert counted == expected, (rank, model, counted, expected)


@pytest.mark.slow
def test_a_vocabulary_no_mp_divides_is_padded_and_leaves_no_trace(run, reference):
    """GPT-2's real vocabulary (50,257, prime to every mp): the tied wte/lm_head is padded to a multiple of mp and
    split, so each rank holds about 1/mp of the model; the consolidated checkpoint has the 50,257 rows and loads,
    strict, into the plain transformers model (the parity test above checks its values)."""
    from tests.support.real_models import GPT2_VOCAB, build_real

    dp, mp, out, ranks = run
    model = "hf_gpt2_vocab50257"
    dense = sum(v.numel() for v in reference[model]["state_dict"].values())
    for r in ranks:
        held = sum(n for n, _, _ in r[f"{model}_64"]["local_params"].values())
        print(f"{model} mp={mp}: {held:,} of {dense:,} parameters per rank ({held / dense:.1%})")
        assert held / dense <= 1 / mp + 0.02, (mp, held, dense)
    state = torch.load(out / f"{model}_64.ckpt", weights_only=True)["state_dict"]
    assert state["net.lm_head.weight"].shape == (GPT2_VOCAB, 32)
    plain, _ = build_real(model)
    plain.load_state_dict(state, strict=True)
    assert plain.net.lm_head.weight.shape[0] == plain.net.config.vocab_size == GPT2_VOCAB
