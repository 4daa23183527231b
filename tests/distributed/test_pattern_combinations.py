"""The planner's newer layouts with the strategy's other options, at dp=2 x mp=2 in one launch: a padded vocabulary
(61 tokens, tied table and head) at zero=3 and under ``compile=True``, and q|k|v blocks of unequal sizes (read per
rank through ``FusedOutput``) at zero=3, whose blocks are ``nn.ModuleDict``s (ZeRO's units are then their called
members). Each against single-process training: float64 within 1e-8, replicas bitwise equal."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_parity_worker
from tests.support.reference import max_weight_diff, reference_run

pytest.importorskip("transformers")

CASES = ("gpt_vocab61+zero3", "gpt_vocab61+compile", "sized_qkv_split+zero3")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("combinations")
    return out, run_parity_worker(2, 2, out, CASES, timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_weights_match_single_process(run, case, tmp_path):
    out, ranks = run
    ref = reference_run(case.split("+")[0], "64-true", tmp_path / "ref.ckpt")
    for suffix in ("_64.ckpt", "_64_split.ckpt"):  # consolidated at teardown, and saved while split
        worst = max_weight_diff(torch.load(out / f"{case}{suffix}", weights_only=True), ref)
        print(f"{case}{suffix}: max |w - w_ref| = {worst:.2e}")
        assert worst <= 1e-8, (case, suffix, worst)
    for r in ranks:
        assert r[f"{case}_64"]["verified"] is True
        assert r[f"{case}_64"]["consistent"] == {"dp_replicas_bitwise_equal": True, "mp_replicated_bitwise_equal": True}
