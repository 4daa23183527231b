"""ZeRO-2/3 with torch's ``MixedPrecisionPolicy`` (issue 22 item 4), GPT at dp=2 x mp=2, 20 AdamW steps, one launch:

- ``param_dtype=float32`` under ``precision="64-true"`` (reduce in float64): the step computes in float32 and the
  optimizer steps float64 masters, so the weights end within float32's rounding of single-process float64
  training (not equal to it), and the checkpoint holds float64;
- ``param_dtype=bfloat16, reduce_dtype=float32`` under ``"32-true"``: within bfloat16's rounding of single-process
  float32 training, float32 checkpoint; also with the attention frozen at zero=2 (frozen parameters stay outside
  the buckets and compute in float32 between bfloat16 layers);
- either way the DP all-gather moves half the bytes of the same run without a policy, the reduce-scatter the same
  bytes (the reduce dtype), and replicas stay bitwise equal.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_parity_worker
from tests.support.reference import max_weight_diff, reference_run

# gpt_frozen: its attention frozen, which zero=2 leaves outside the buckets (it computes in its own dtype)
CASES = ("gpt+zero3", "gpt+zero3_fp32", "gpt+zero2_fp32", "gpt+zero3_bf16", "gpt_frozen+zero2_bf16")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero_mixed")
    return out, run_parity_worker(2, 2, out, CASES, precisions="64-true,32-true", timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize(("case", "bits", "low", "high"), [
    ("gpt+zero3", "64", 0.0, 1e-8),
    ("gpt+zero3_fp32", "64", 1e-9, 1e-4),  # float32 compute: off by its rounding, never by more
    ("gpt+zero2_fp32", "64", 1e-9, 1e-4),
    ("gpt+zero3_bf16", "32", 1e-5, 5e-2),  # bfloat16 compute
    ("gpt_frozen+zero2_bf16", "32", 1e-5, 5e-2),
])
def test_weights_follow_the_compute_dtype_and_masters_keep_theirs(run, case, bits, low, high, tmp_path):
    out, ranks = run
    ckpt = torch.load(out / f"{case}_{bits}.ckpt", weights_only=True)
    ref = reference_run(case.split("+")[0], f"{bits}-true", tmp_path / "ref.ckpt")
    worst = max_weight_diff(ckpt, ref)
    print(f"{case} float{bits}: max |w - w_ref| = {worst:.2e}")
    assert low <= worst <= high, (case, worst)
    assert {v.dtype for v in ckpt["state_dict"].values()} == {torch.float64 if bits == "64" else torch.float32}
    for r in ranks:
        assert r[f"{case}_{bits}"]["consistent"] == {"dp_replicas_bitwise_equal": True,
                                                     "mp_replicated_bitwise_equal": True}


@pytest.mark.slow
@pytest.mark.parametrize(("case", "bits"), [("gpt+zero3_fp32", "64"), ("gpt+zero3_bf16", "32")])
def test_the_gathers_move_the_compute_dtype_and_the_reduction_the_reduce_dtype(run, case, bits):
    _, ranks = run
    for r in ranks:
        plain, mixed = r[f"gpt+zero3_{bits}"]["bytes"], r[f"{case}_{bits}"]["bytes"]
        assert mixed["dp/all_gather"] * 2 == plain["dp/all_gather"], (plain, mixed)
        assert mixed["dp/reduce_scatter"] == plain["dp/reduce_scatter"], (plain, mixed)
