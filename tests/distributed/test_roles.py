"""One role per layer, and fallback notes that name the layer and the reason.

One 2-process launch (dp=1, mp=2, float64): MLP chains of 2..5 Linears (each layer could be the row end of one
pair and the start of the next), one of them without verification, a head-wise MLP whose value depends on the
local width (verification must fall back, with a PlanFallbackWarning, and the note must say where and why, without
calling it attention), and two models whose token table is shared by several modules, one of them never called
itself (a small one of ours and transformers' T5): planned per weight, split by vocabulary under every name, every
alias key kept in checkpoints.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_parity_worker
from tests.support.reference import max_weight_diff, reference_run

CHAINS = ("chain2", "chain3", "chain4", "chain5", "chain4+noverify")
MODELS = CHAINS + ("headscaled", "aliased", "t5")
ALIASES = {  # every name of the one token table, and the LM head tied to it
    "aliased": ("net.shared", "net.enc.embed_tokens", "net.dec.embed_tokens", "net.head"),
    "t5": ("net.shared", "net.encoder.embed_tokens", "net.decoder.embed_tokens", "net.lm_head"),
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("roles")
    return out, run_parity_worker(1, 2, out, MODELS)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("roles_ref")
    return {m: reference_run(m, "64-true", tmp / f"{m}.ckpt") for m in {m.split("+")[0] for m in MODELS}}


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_matches_single_process(run, reference, model):
    out, _ = run
    worst = max_weight_diff(torch.load(out / f"{model}_64.ckpt", weights_only=True), reference[model.split("+")[0]])
    print(f"{model} dp=1 mp=2: max |w - w_ref| = {worst:.2e}")
    assert worst <= 1e-8, (model, worst)


@pytest.mark.slow
@pytest.mark.parametrize("model", CHAINS)
def test_chain_pairs_greedily_in_call_order_without_fallback(run, model):
    _, ranks = run
    n = int(model.split("+")[0][len("chain"):])
    expected = {f"layers.{i}": ("column" if i % 2 == 0 else "row") for i in range(n - n % 2)}
    if n % 2:  # the odd last layer, a 4-class head on a 16-wide input, is not worth a vocab split (issue 12)
        expected[f"layers.{n - 1}"] = "replicate"
    for res in ranks:
        r = res[f"{model}_64"]
        assert r["styles"] == expected, r["plan_text"]
        assert r["verified"] is (None if model.endswith("noverify") else True)
        assert "verification failed" not in r["plan_text"], r["plan_text"]
        assert "PlanFallbackWarning" not in r["warnings"], r["warnings"]
        # one forward all-reduce per row; one backward per pair entry past the first (the first reads data); + 1 for
        # the clipping norm (a whole head costs nothing)
        rows = n // 2
        expected_ar = rows + (rows - 1) + 1
        assert r["counts"] == {"mp/all_reduce": expected_ar}, (model, r["counts"])


@pytest.mark.slow
def test_fallback_note_names_the_layer_and_the_kind_of_region(run):
    _, ranks = run
    assert ranks[0]["headscaled_64"]["warnings"] == ["PlanFallbackWarning"]  # rank 0 warns: not only a printout note
    for res in ranks:
        r = res["headscaled_64"]
        text = r["plan_text"]
        assert r["verified"] is True, text
        # 12 -> 4: whole
        assert r["styles"] == {"fc1": "column_gather", "fc2": "column_gather", "head": "replicate"}, text
        assert "verification failed at level 0 (relative error" in text and "largest at fc" in text, text
        assert ("fell back to pairs through reshapes or attention self-contained: fc1 column -> column_gather"
                " (paired region (reshapes/transposes) disabled after a failed verification)") in text, text
        assert "attention" not in text.replace("reshapes or attention", ""), text


@pytest.mark.slow
@pytest.mark.parametrize("model", sorted(ALIASES))
def test_shared_token_table_is_split_under_every_name(run, model):
    out, ranks = run
    names = ALIASES[model]
    state = torch.load(out / f"{model}_64.ckpt", weights_only=True)["state_dict"]
    split_state = torch.load(out / f"{model}_64_split.ckpt", weights_only=True)["state_dict"]
    for name in names:  # every alias key is in both checkpoints, dense, and one tensor
        assert state[f"{name}.weight"].shape == (64, 32), name
        assert torch.equal(state[f"{name}.weight"], state[f"{names[0]}.weight"]), name
        assert torch.equal(split_state[f"{name}.weight"], state[f"{name}.weight"]), name
    for res in ranks:
        r = res[f"{model}_64"]
        assert r["verified"] is True, r["plan_text"]
        assert r["consistent"] == {"dp_replicas_bitwise_equal": True, "mp_replicated_bitwise_equal": True}
        for name in names:
            if name in r["styles"]:  # a second name of the same module object is not a layer of its own
                assert r["styles"][name] == "vocab", (name, r["plan_text"])
        assert r["local_params"][f"{names[0]}.weight"][:2] == [32 * 32, True]  # 1/mp of the vocabulary rows
        print(r["plan_text"])
