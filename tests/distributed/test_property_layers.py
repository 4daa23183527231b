"""Property tests (hypothesis): parallel layers and the planner equal the dense float64 reference, or raise the
documented error, for random sizes, mp in {1, 2, 4}, bias on/off, gather on/off and random small MLP graphs.

mp=1 runs in this process (no process group). mp=2 and 4 run on a pool of 4 gloo ranks started once for the module
(property_worker.serve); hypothesis draws and shrinks here and sends each example to every rank, so all ranks
issue the same collectives. A case that hangs fails after 90 s instead of blocking the suite.
"""

from __future__ import annotations

import multiprocessing as mp_
import queue
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.distributed.property_worker import run_case, serve

TOL = 1e-12  # float64: only the summation order differs
WORLD = 4
SETTINGS = settings(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


class Pool:
    """Four gloo ranks answering cases; ``run(case)`` returns the four results in rank order."""

    def __init__(self, tmp: str) -> None:
        ctx = mp_.get_context("spawn")
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(WORLD)]
        self.procs = [
            ctx.Process(target=serve, args=(r, WORLD, f"{tmp}/init", self.inboxes[r], self.outbox), daemon=True)
            for r in range(WORLD)
        ]
        for p in self.procs:
            p.start()
        assert sorted(self._collect(120)) == [(r, "ready") for r in range(WORLD)]

    def _collect(self, timeout: float) -> list[tuple[int, Any]]:
        try:
            return [self.outbox.get(timeout=timeout) for _ in range(WORLD)]
        except queue.Empty:
            pytest.fail(f"the rank pool did not answer within {timeout} s (a hang in a collective?)")

    def run(self, case: dict) -> list[dict]:
        for q in self.inboxes:
            q.put(case)
        results = [r for _, r in sorted(self._collect(90), key=lambda x: x[0])]
        crashes = [r["crash"] for r in results if "crash" in r]
        assert not crashes, crashes[0]
        return results

    def close(self) -> None:
        for q in self.inboxes:
            q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


@pytest.fixture(scope="module")
def pool(tmp_path_factory) -> Iterator[Pool]:
    p = Pool(str(tmp_path_factory.mktemp("pool")))
    yield p
    p.close()


sizes = st.integers(min_value=1, max_value=24)
layer_cases = st.fixed_dictionaries(
    {
        "kind": st.just("layer"),
        "style": st.sampled_from(["column", "row"]),
        "d_in": sizes,
        "d_out": sizes,
        "lead": st.lists(st.integers(1, 4), min_size=1, max_size=2),
        "bias": st.booleans(),
        "gather": st.booleans(),
        "seed": st.integers(0, 2**16),
    }
)


def _expected_error(case: dict, mp: int) -> str | None:
    """The documented refusal: the split dimension must be divisible by mp (sharding.divide); a column layer that
    gathers its output pads it instead (zero rows, stripped by the gather, as a vocabulary is)."""
    if case["style"] == "column" and case["gather"]:
        return None
    dim, size = ("out_features", case["d_out"]) if case["style"] == "column" else ("in_features", case["d_in"])
    return None if size % mp == 0 else f"{dim} of size {size} cannot be split evenly across mp={mp} ranks."


def _check(results: list[dict], expected_error: str | None) -> None:
    for rank, r in enumerate(results):
        if expected_error is not None:
            assert r.get("error") == expected_error, (rank, r)
        else:
            assert "error" not in r, (rank, r)
            assert r["max_err"] <= TOL, (rank, r["errs"])


@SETTINGS
@given(case=layer_cases)
def test_layers_at_mp1_equal_dense_in_process(case):
    _check([run_case(case)], None)


@pytest.mark.slow
@settings(SETTINGS, max_examples=60)
@given(case=layer_cases, mp=st.sampled_from([2, 4]))
def test_layers_equal_dense_or_refuse_clearly(pool, case, mp):
    _check(pool.run({**case, "mp": mp}), _expected_error(case, mp))


widths = st.sampled_from([2, 3, 4, 6, 8, 12, 16])  # some not divisible by 4 (or 2): those stay replicated
mlp_cases = st.fixed_dictionaries(
    {
        "kind": st.just("mlp"),
        "d_in": widths,
        "d_out": widths,
        "batch": st.integers(1, 5),
        "blocks": st.lists(
            st.tuples(
                st.sampled_from(["linear", "residual", "gated"]), widths, st.sampled_from(["relu", "gelu", "tanh"])
            ),
            min_size=1,
            max_size=3,
        ),
        "seed": st.integers(0, 2**16),
    }
)


@pytest.mark.slow
@settings(SETTINGS, max_examples=30)
@given(case=mlp_cases, mp=st.sampled_from([1, 2, 4]))
def test_planned_random_mlps_equal_dense(pool, case, mp):
    results = pool.run({**case, "mp": mp})
    _check(results, None)
    assert len({tuple(r["styles"]) for r in results}) == 1  # every rank applied the same plan
    event(f"styles: {' '.join(results[0]['styles'])}")  # pytest --hypothesis-show-statistics: pairs are exercised
