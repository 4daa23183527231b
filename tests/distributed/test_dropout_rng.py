"""Dropout under MP: different masks across MP ranks inside split regions, equal masks outside, reproducible."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_ranks


@pytest.fixture(scope="module")
def masks(tmp_path_factory):
    out = tmp_path_factory.mktemp("dropout")
    proc = run_ranks(2, ["tests/distributed/dropout_worker.py", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(out / f"masks_rank{r}.pt", weights_only=True) for r in (0, 1)]


@pytest.mark.slow
def test_split_region_masks_differ_across_mp_ranks(masks):
    r0, r1 = masks
    assert bool(r0["a"]["fc1_column"]) and bool(r1["a"]["fc1_column"])  # the dropout sits inside a column->row pair
    inner0, inner1 = r0["a"]["inner"], r1["a"]["inner"]
    assert inner0.shape == inner1.shape == (16, 32)  # each rank's half of the 64 hidden units
    assert 0.3 < inner0.float().mean() < 0.7  # p = 0.5
    assert not torch.equal(inner0, inner1)


@pytest.mark.slow
def test_replicated_region_masks_are_equal_across_mp_ranks(masks):
    r0, r1 = masks
    assert torch.equal(r0["a"]["outer"], r1["a"]["outer"])
    assert 0.3 < r0["a"]["outer"].float().mean() < 0.7


@pytest.mark.slow
def test_masks_are_reproducible_for_a_seed_and_change_with_it(masks):
    for r in masks:
        for region in ("inner", "outer"):
            assert torch.equal(r["a"][region], r["b"][region])
            assert not torch.equal(r["a"][region], r["c"][region])
