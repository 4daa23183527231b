"""Fine-tuning with frozen parameters: frozen layers are still split, stay bitwise frozen, and the rest trains to
the single-process weights.

GPT (untied) with every attention parameter (q/k/v/out) ``requires_grad=False``, 20 AdamW steps with global-norm
clipping in float64, at (1, 2) and (2, 2); with and without the plan's verification; ZeRO-1 at (2, 2).
"""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch

from tests.conftest import run_ranks
from tests.distributed import parity_worker as W
from tests.support.models import build
from tests.support.reference import max_weight_diff, reference_run

LAYOUTS = [(1, 2), (2, 2)]
N_LAYERS = 2


def _models(dp: int) -> tuple[str, ...]:
    return ("gpt_frozen", "gpt_frozen+noverify") + (("gpt_frozen+zero",) if dp > 1 else ())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_run("gpt_frozen", "64-true", tmp_path_factory.mktemp("frozen_ref") / "ref.ckpt")


@pytest.fixture(scope="module")
def initial():
    L.seed_everything(W.SEED, workers=True)
    model, _ = build("gpt_frozen")
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    return {k: v.double() for k, v in model.state_dict().items()}, frozen


@pytest.fixture(scope="module", params=LAYOUTS, ids=lambda layout: f"dp{layout[0]}_mp{layout[1]}")
def run(request, tmp_path_factory):
    dp, mp = request.param
    out = tmp_path_factory.mktemp(f"frozen_dp{dp}_mp{mp}")
    proc = run_ranks(dp * mp, ["tests/distributed/parity_worker.py", str(dp), str(mp), str(out),
                                  ",".join(_models(dp))], timeout=600, env={"PRECISIONS": "64-true"})
    assert proc.returncode == 0, proc.stderr[-5000:]
    return dp, mp, out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(dp * mp)]


@pytest.mark.slow
def test_frozen_attention_matches_single_process_stays_frozen_and_split(run, reference, initial):
    dp, mp, out, ranks = run
    init, frozen = initial
    assert len(frozen) == 8 * N_LAYERS  # q/k/v/out weight + bias per block
    assert max(reference["state_dict"][k].sub(init[k]).abs().max().item() for k in init if k not in frozen) > 1e-2
    for model in _models(dp):
        ckpt = torch.load(out / f"{model}_64.ckpt", weights_only=True)
        worst = max_weight_diff(ckpt, reference)
        print(f"frozen attention {model} dp={dp} mp={mp}: max |w - w_ref| = {worst:.2e}")
        assert worst <= 1e-8, (model, worst)
        for key in frozen:  # not one bit moved: no gradient, no weight decay, no optimizer state
            assert torch.equal(ckpt["state_dict"][key], init[key]), (model, key)
        for rank, res in enumerate(ranks):
            r = res[f"{model}_64"]
            assert r["verified"] is (None if model.endswith("noverify") else True), (model, rank, r["plan_text"])
            assert r["frozen_after_fit"] == sorted(frozen), "teardown must hand back frozen parameters frozen"
            assert r["consistent"] == {"dp_replicas_bitwise_equal": True, "mp_replicated_bitwise_equal": True}
            for key in frozen:  # the frozen layers are split all the same: 1/mp of q/k/v (and out's weight) per rank
                numel, split, _ = r["local_params"][key]
                dense = init[key].numel()
                row_bias = key.endswith("out_proj.bias")
                assert (numel, split) == ((dense, False) if row_bias else (dense // mp, True)), (key, numel)
            # Frozen q/k/v still need their input gradient (earlier layers train): the same collectives as an
            # unfrozen GPT, 2 + 2 per block, + embedding, vocab loss (2), LM head input gradient, clipping norm.
            counts = {k: v for k, v in r["counts"].items() if k.startswith("mp/")}
            assert counts == {"mp/all_reduce": N_LAYERS * 4 + 1 + 2 + 1 + 1}, (model, counts)
