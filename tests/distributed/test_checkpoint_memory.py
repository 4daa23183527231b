"""Checkpoints with bounded memory at zero=3 (issue 22 item 3): one launch of ``checkpoint_memory_worker.py``.

A 16-layer GPT (12.6 M parameters, float64, AdamW) at dp=2 x mp=2, zero=3: each rank holds 76.8 MB of shards
(parameters and both AdamW moments); gathering the model and its optimizer state whole, as saves did before, takes
153.6 MB on every rank (and the dense copy on rank 0). Saving and loading, in both formats, must hold no more than
one unit's gathered copy (3.2 MB: the largest bucket) and one dense tensor (2.1 MB) beyond the shards, and give
back exactly the shards that were saved.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_ranks

WORKER = "tests/distributed/checkpoint_memory_worker.py"
SLACK = 16 * 2**20  # allocator granularity, pickling, DCP's plans and metadata, Python objects


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt_memory")
    proc = run_ranks(4, [WORKER, str(out)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.slow
@pytest.mark.parametrize("what", ["save_consolidated", "save_sharded", "load_sharded", "load_consolidated"])
def test_checkpoints_hold_at_most_one_unit_beyond_the_shards(ranks, what):
    for rank, r in enumerate(ranks):
        peak, anon = r[what]
        bound = 2 * r["unit"] + 2 * r["dense_max"] + SLACK  # a gathered bucket, a dense tensor and its MP parts
        print(f"rank {rank} {what}: peak RSS +{peak / 2**20:.1f} MiB (anonymous +{anon / 2**20:.1f} MiB); holds "
              f"{r['held'] / 2**20:.1f} MiB, bound {bound / 2**20:.1f} MiB, whole {r['whole'] / 2**20:.1f} MiB")
        assert anon <= bound, (rank, what, anon, bound)
        if what != "load_consolidated":  # (a consolidated load maps the file: its pages count in RSS, not anon)
            assert peak <= bound, (rank, what, peak, bound)
        assert bound < r["whole"] / 4  # the bound is far below what gathering everything takes


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["consolidated", "sharded"])
def test_loads_give_back_exactly_the_saved_shards(ranks, fmt):
    assert all(r[f"roundtrip_{fmt}"] for r in ranks)


@pytest.mark.slow
def test_another_checkpoint_io_gets_the_same_tensors(ranks):
    assert ranks[0]["io_equal"] is True


@pytest.mark.slow
def test_a_consolidated_save_gathers_each_bucket_once_per_flat_tensor_and_a_sharded_one_never(ranks):
    for rank, r in enumerate(ranks):
        # 33 buckets: their parameters, then each AdamW moment: 99 DP all-gathers, on every rank
        assert r["counts_consolidated"]["dp/all_gather"] == r["expected_dp_gathers"], r["counts_consolidated"]
        assert "dp/all_gather" not in r["counts_sharded"], r["counts_sharded"]
        # 192 MP-split parameters, each with two moments: 576 gathers onto rank 0, by the MP group of DP rank 0 only
        mp_gathers = r["expected_mp_gathers"] if rank // 2 == 0 else None
        assert r["counts_consolidated"].get("mp/gather") == mp_gathers, (rank, r["counts_consolidated"])
        assert "mp/gather" not in r["counts_sharded"], r["counts_sharded"]
