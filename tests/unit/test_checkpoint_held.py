"""Held tensors, the streamed consolidated writer and the sharded format's chunks (issue 22 item 3), one process."""

from __future__ import annotations

import os
import random
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_dpmp.checkpoint.held import Gathered, Held, collect_held, flat_boxes, held, held_of, resolve_held
from lightning_dpmp.checkpoint.sharded import _chunk_map
from lightning_dpmp.checkpoint.streamed import stream_save
from lightning_dpmp.parallel.sharding import shard_tensor


@pytest.mark.parametrize("shape", [(), (7,), (3, 5), (2, 3, 4), (2, 1, 3, 2)])
def test_flat_boxes_cover_the_range_once(shape):
    n = max(1, torch.Size(shape).numel())
    rng = random.Random(0)
    for _ in range(40):
        lo = rng.randrange(n)
        hi = rng.randrange(lo, n + 1)
        mark = torch.zeros(shape, dtype=torch.int64)
        boxes = flat_boxes(shape, lo, hi)
        assert len(boxes) <= max(1, 2 * len(shape) - 1)
        for offsets, sizes, start in boxes:
            region = mark[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
            region += 1
            # the box's elements are contiguous in flat order, starting at `start`
            index = torch.arange(n).view(shape)[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
            assert index.reshape(-1).tolist() == list(range(start, start + region.numel()))
        expect = torch.zeros(n, dtype=torch.int64)
        expect[lo:hi] = 1
        assert torch.equal(mark.reshape(-1), expect), (shape, lo, hi)


def test_stream_save_writes_what_torch_save_writes_and_fetches_each_bucket_once(tmp_path):
    a, b = torch.randn(3, 4, dtype=torch.float64), torch.randn(5)
    opened = []
    gathered = Gathered(lambda: opened.append(1) or torch.cat([a.reshape(-1), torch.zeros(4, dtype=a.dtype)]))

    def part(i: int):
        return lambda: gathered.full[4 * i : 4 * i + 4].clone()  # type: ignore[index]

    rows = [held((4,), a.dtype, Held(fetch=part(i), gathered=gathered)) for i in range(3)]
    tied = held((5,), b.dtype, Held(fetch=lambda: b.clone()))
    ckpt = {"state_dict": {"r0": rows[0], "x": torch.arange(3), "r1": rows[1], "b": tied, "b_alias": tied},
            "optimizer_states": [{"state": {0: {"step": torch.tensor(2.0), "m": rows[2]}}}], "epoch": 4}
    assert collect_held(ckpt) == [rows[0], rows[1], tied, rows[2]]
    path = str(tmp_path / "last.ckpt")
    stream_save(ckpt, path, write=True)
    assert opened == [1]  # the three rows share one gather
    for mmap in (False, True):
        got = torch.load(path, weights_only=True, mmap=mmap)
        for i in range(2):
            assert torch.equal(got["state_dict"][f"r{i}"], a[i])
        assert torch.equal(got["optimizer_states"][0]["state"][0]["m"], a[2])
        assert torch.equal(got["state_dict"]["b"], b) and got["state_dict"]["b_alias"] is got["state_dict"]["b"]
        assert torch.equal(got["state_dict"]["x"], torch.arange(3)) and got["epoch"] == 4
    assert [n for n in os.listdir(tmp_path)] == ["last.ckpt"]  # no temporary file left
    whole = resolve_held(ckpt)  # for other writers: every held tensor fetched
    assert torch.equal(whole["state_dict"]["r1"], a[1]) and held_of(whole["state_dict"]["r1"]) is None


def test_a_failed_streamed_write_leaves_the_previous_file(tmp_path):
    path = str(tmp_path / "last.ckpt")
    torch.save({"v": 1}, path)
    bad = held((2,), torch.float32, Held(fetch=lambda: torch.ones(3)))  # the wrong shape: refused while writing
    with pytest.raises(RuntimeError, match=r"held \(2,\) torch.float32 tensor was fetched as \(3,\)"):
        stream_save({"w": bad}, path, write=True)
    assert torch.load(path, weights_only=True) == {"v": 1} and os.listdir(tmp_path) == ["last.ckpt"]


@pytest.mark.parametrize(("dim", "blocks", "dense"), [(0, 1, (8, 6)), (1, 1, (4, 12)), (0, 3, (12, 5)),
                                                     (1, 3, (4, 12)), (0, (7,), (7, 4)), (0, (6, 3, 3), (12, 2))])
def test_chunks_of_flat_slices_round_trip_through_dcp(tmp_path, dim, blocks, dense):
    """Two "MP ranks" each holding their shard as two flat "DP" slices write one folder; a load into other slices
    gives back the dense tensor's pieces."""
    torch.manual_seed(0)
    full = torch.randn(dense, dtype=torch.float64)
    mp = 2
    flat: dict = {}
    for rank in range(mp):
        local = shard_tensor(full, dim, mp, rank, blocks).contiguous()
        n = local.numel()
        pieces = [(0, n // 3, local.view(-1)[: n // 3]), (n // 3, n, local.view(-1)[n // 3 :])]
        for key, chunks in _chunk_map("w", tuple(local.shape), local.dtype, pieces, dim, blocks, mp, rank,
                                      torch.device("cpu")).items():
            if key in flat:  # the same stored tensor from another "rank": merge the chunk lists
                flat[key].chunks += chunks.chunks
            else:
                flat[key] = chunks
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(flat, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    for rank in range(mp):
        local = shard_tensor(full, dim, mp, rank, blocks).contiguous()
        into = torch.zeros_like(local)
        n = local.numel()
        pieces = [(0, n - 5, into.view(-1)[: n - 5]), (n - 5, n, into.view(-1)[n - 5 :])]
        targets = _chunk_map("w", tuple(local.shape), local.dtype, pieces, dim, blocks, mp, rank, torch.device("cpu"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(targets, storage_reader=dcp.FileSystemReader(str(tmp_path)), no_dist=True)
        assert torch.equal(into, local), (rank, dim, blocks)
