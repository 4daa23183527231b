"""Column/Row parallel layers against dense nn.Linear on 4 gloo processes (mp = 2 and 4, bias on and off)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_ranks

TOL = 1e-12  # float64: only summation order differs
COUNTED = "counted_calls"  # the worker's CommCounter check, beside the layer cases
pytestmark = pytest.mark.slow  # one 4-process launch for the module


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("layers") / "layers.json"
    proc = run_ranks(4, ["tests/distributed/layers_worker.py", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def results(per_rank):
    return [(rank, case, r) for rank, cases in enumerate(per_rank) for case, r in cases.items() if case != COUNTED]


def test_every_case_ran(results):
    assert {case for _, case, _ in results} == {"mp2_bias1", "mp2_bias0", "mp4_bias1", "mp4_bias0"}
    assert len(results) == 16  # 4 ranks x 4 cases


def test_comm_counter_names_every_collective_and_point_to_point_call(per_rank):
    # each torch.distributed call once on the labelled group "g"; the functional all_reduce, all_gather and
    # reduce_scatter add one each; the last all_reduce is on the default group, which no label names
    expected = {
        "g/all_reduce": 2, "g/all_gather": 3, "g/reduce_scatter": 2, "g/broadcast": 1, "g/reduce": 1, "g/gather": 1,
        "g/scatter": 1, "g/all_to_all": 1, "g/barrier": 1, "g/send": 1, "g/recv": 1, "other/all_reduce": 1,
    }
    counted = [cases[COUNTED] for cases in per_rank]
    assert counted == [expected] * 4, counted


def test_outputs_and_gradients_equal_dense(results):
    for rank, case, r in results:
        errs = {k: v for k, v in r.items() if k.endswith("_err")}
        assert len(errs) >= (14 if case.endswith("bias1") else 13), errs
        bad = {k: v for k, v in errs.items() if v > TOL}
        assert not bad, f"rank {rank} {case}: {bad}"
        assert r["to_dense_equal"], f"rank {rank} {case}: to_dense() is not the original weight"
        assert r["fused_state_equal"], f"rank {rank} {case}: a fused layer's consolidated state is not the dense one"
        assert r["scaled_emb_class"] == ["VocabParallel_Scaled", "_Scaled", True], (rank, case)
        assert r["scaled_emb_to_dense_equal"], (rank, case)
        # a vocabulary of 5 padded to a multiple of mp: ceil(5/mp) rows per rank, the padding zero and inert
        each = -(-5 // int(case[2]))
        assert r["padded_shapes"] == [[each, 8], [each, 6]], (rank, case)
        assert r["padded_rows_zero"] and r["padded_state_equal"], (rank, case)
        assert r["padded_ce_counts"] == {"mp/all_reduce": 2}, (rank, case)


def test_collective_counts(results):
    for rank, case, r in results:
        # col -> row pair: one all-reduce forward (row output), one backward (column input gradient)
        assert r["pair_counts_torch"] == {"c10d.allreduce_": 2}, (rank, case)
        assert r["pair_counts_ours"] == {"mp/all_reduce": 2}, (rank, case)
        # self-contained column: all-gather forward, all-reduce of the input gradient backward
        assert r["gather_counts"] == {"mp/all_gather": 1, "mp/all_reduce": 1}, (rank, case)
        # row on a replicated input: all-reduce forward, all-gather of the input gradient backward
        assert r["scatter_row_counts"] == {"mp/all_reduce": 1, "mp/all_gather": 1}, (rank, case)
        # two column layers on one input + row: still one all-reduce each way
        assert r["fanout_counts"] == {"mp/all_reduce": 2}, (rank, case)
        # a vocab-split lookup (a scaled subclass): one all-reduce forward, nothing backward
        assert r["scaled_emb_counts"] == {"mp/all_reduce": 1}, (rank, case)


def test_vocab_parallel_cross_entropy_matches_f_cross_entropy(results):
    for rank, case, r in results:
        # values and gradients for mean/sum/none reductions, with and without label smoothing, with ignore_index
        assert r["vocab_ce_err"] <= TOL, (rank, case, r["vocab_ce_err"])
        # the full logits are never gathered: two all-reduces forward (max, then the sums), none backward
        assert r["vocab_ce_counts"] == [{"mp/all_reduce": 2}], (rank, case)
