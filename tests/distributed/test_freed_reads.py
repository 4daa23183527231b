"""A parameter read outside the layers at zero=3 or under a pipeline gives its values and never crashes (issue 41):
a weight-norm callback in ``on_train_batch_end`` (gradients enabled) and ``on_validation_epoch_end``, and the model
after fit, in float64 against one process (``tests/distributed/freed_reads_worker.py``). Before, such a read of a
freed ZeRO-3 view, or of another stage's parameter, died of SIGSEGV. At mp=1, and at mp=2 with and without a
pipeline (DTensor parameters), the values are one process's on every rank."""

from __future__ import annotations

import json

import pytest

from tests.distributed.freed_reads_worker import STEPS, fit_layout

LAYOUTS = ("4,1,1,3", "2,1,2,3", "2,2,1,0", "2,2,1,3", "1,2,2,1")  # dp, pp, mp, zero


@pytest.fixture(scope="module")
def reference() -> dict:
    return json.loads(json.dumps(fit_layout("1,1,1,0")))  # JSON's keys, as the ranks' files have them


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    from tests.conftest import run_ranks

    out = tmp_path_factory.mktemp("freed_reads")
    proc = run_ranks(4, ["tests/distributed/freed_reads_worker.py", str(out), ";".join(LAYOUTS)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["4,1,1,3", "2,2,1,0", "2,2,1,3"])
def test_reads_at_mp1_equal_one_process(ranks: list[dict], reference: dict, layout: str) -> None:
    assert len(reference["train"]) == STEPS and len(reference["val"]) == 2
    for rank in ranks:  # under a pipeline: another stage's parameters too, on every rank
        got = rank[layout]
        assert got["train"].keys() == reference["train"].keys()
        assert max(abs(got["train"][s] - v) for s, v in reference["train"].items()) < 1e-8
        assert max(abs(a - b) for a, b in zip(got["val"], reference["val"], strict=True)) < 1e-8
    assert abs(ranks[0][layout]["after"] - reference["after"]) < 1e-8


@pytest.mark.slow
def test_zero3_reads_at_mp2_equal_one_process(ranks, reference):
    # the parameters are DTensors at zero=3 too: each rank reads the dense model, gathered over DP for the read
    test_reads_at_mp1_equal_one_process(ranks, reference, "2,1,2,3")


@pytest.mark.slow
def test_pipeline_zero_reads_at_mp2_equal_one_process(ranks, reference):
    # under a pipeline with ZeRO the parameters are DTensors too: every rank reads the dense model, the other
    # stage's parameters brought from the stage that owns them (they were each rank's MP shards before)
    test_reads_at_mp1_equal_one_process(ranks, reference, "1,2,2,1")
