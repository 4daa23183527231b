"""GPT-2 Conv1D column/row layers and head-parallel nn.MultiheadAttention against their dense modules on 4 gloo
processes (mp = 2 and 4), float64: values, gradients, collectives, and the dense module given back."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_ranks

pytest.importorskip("transformers")

TOL = 1e-12  # float64: only summation order differs
pytestmark = pytest.mark.slow  # one 4-process launch for the module


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("linear_like") / "linear_like.json"
    proc = run_ranks(4, ["tests/distributed/linear_like_worker.py", str(out)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [
        (rank, case, r) for rank, per_rank in enumerate(json.loads(out.read_text())) for case, r in per_rank.items()
    ]


def test_every_case_ran(results):
    cases = {f"mp{m}_{k}" for m in (2, 4) for k in ("conv1d_blocks1", "conv1d_blocks3", "mha_bf1", "mha_bf0")}
    assert {case for _, case, _ in results} == cases and len(results) == 4 * len(cases)


def test_conv1d_pair_matches_dense_in_its_own_layout(results):
    for rank, case, r in results:
        if "conv1d" not in case:
            continue
        mp, blocks = int(case[2]), int(case[-1])
        errs = {k: v for k, v in r.items() if k.endswith("_err")}
        assert len(errs) == 4 and max(errs.values()) <= TOL, (rank, case, errs)
        # weights stay (in, out): the column layer holds columns, the row layer rows
        assert r["local_shapes"] == [[8, blocks * 16 // mp], [16 // mp, 8]], (rank, case)
        assert r["counts"] == {"mp/all_reduce": 2}, (rank, case)  # 1 forward (row output) + 1 backward (entry)
        assert r["state_equal"] and r["to_dense_equal"] and r["to_dense_class"] == ["Conv1D", "Conv1D"], (rank, case)


def test_head_parallel_attention_matches_nn_multihead_attention(results):
    for rank, case, r in results:
        if "mha" not in case:
            continue
        assert len(r["errs"]) == 8 and max(r["errs"].values()) <= TOL, (rank, case, r["errs"])
        assert r["local_heads"] == 4 // r["mp"]
        for name, counts in r["counts"].items():
            # 1 all-reduce forward (out_proj), 1 backward (the entry); need_weights adds 1 all-gather forward
            expected = {"mp/all_reduce": 2, **({"mp/all_gather": 1} if name.endswith("_w1") else {})}
            assert counts == expected, (rank, case, name, counts)
        assert r["state_equal"] and r["to_dense_equal"], (rank, case)
        assert r["to_dense_class"] == ["MultiheadAttention", "NonDynamicallyQuantizableLinear"], (rank, case)
