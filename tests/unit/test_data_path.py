"""The data path's pieces without processes: batch layouts and checksums, the byte-buffer round trip, worker seeds,
prediction-writer muting, our advice in DDP's message, the averaging-callback checks (issue 27)."""

from __future__ import annotations

import os
from collections import namedtuple

import pytest
import torch
from lightning.pytorch.callbacks import BasePredictionWriter, StochasticWeightAveraging
from lightning.pytorch.callbacks.weight_averaging import EMAWeightAveraging
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dpmp import DPMPStrategy, compat
from lightning_dpmp.integration import averaging
from lightning_dpmp.integration import mp_batch as B
from lightning_dpmp.integration.data_path import (
    check_even_batches,
    mute_prediction_writers,
    seed_workers_by_dp_rank,
)
from lightning_dpmp.integration.guard import batch_checksum
from lightning_dpmp.integration.validate import advise_our_arguments, check_averaging_callbacks

Pair = namedtuple("Pair", "x y")


def _batch():
    return {"ids": torch.arange(6).view(2, 3), "mask": torch.tensor([True, False]),
            "c": torch.ones(2, dtype=torch.cfloat),
            "pair": Pair(torch.randn(2, 2, dtype=torch.float64), torch.tensor(3.5, dtype=torch.bfloat16)), "tag": "a"}


def test_signature_follows_layout_not_values():
    a, b = _batch(), _batch()
    b["ids"] = b["ids"] + 7
    assert B.batch_signature(a) == B.batch_signature(b)
    for change in ({"ids": torch.arange(8).view(2, 4)}, {"ids": torch.arange(6).view(2, 3).int()}, {"tag": "b"},
                   {"extra": 1}):
        assert B.batch_signature({**a, **change}) != B.batch_signature(a), change
    assert 0 <= B.batch_signature(a) < 2**63


def test_check_checksum_sees_any_changed_bit_and_leaf_order():
    a = _batch()
    cpu = torch.device("cpu")

    def checksum(batch):  # what check_batch compares, beside the signature
        return batch_checksum(B._tensors(batch), cpu)

    assert torch.equal(checksum(a), checksum(_batch() | {"pair": a["pair"]}))
    flipped = {**a, "mask": torch.tensor([False, True])}
    assert not torch.equal(checksum(a), checksum(flipped))
    assert not torch.equal(checksum((torch.ones(2), torch.zeros(2))), checksum((torch.zeros(2), torch.ones(2))))


def test_byte_buffer_round_trip_keeps_every_dtype_and_shape():
    a = _batch()
    tensors = B._tensors(a)
    buffer = B._pack(tensors, torch.device("cpu"))
    assert buffer.numel() == 48 + 8 + 16 + 32 + 8  # each leaf padded to 8 bytes: int64 ids, bool, cfloat, f64, bf16
    for t, back in zip(tensors, B._split_like(buffer, tensors)):
        assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)


def test_one_member_group_is_free():
    a = _batch()
    assert B.broadcast_batch(a, None, 0) == (a, True)
    B.check_batch(a, None, torch.device("cpu"))  # no group: nothing to compare, no collective


def test_workers_seeded_by_dp_rank_only_where_lightning_would_seed(monkeypatch):
    loader = DataLoader(TensorDataset(torch.ones(4)), num_workers=0)
    monkeypatch.delenv("PL_SEED_WORKERS", raising=False)
    assert not seed_workers_by_dp_rank(loader, 1)
    monkeypatch.setenv("PL_SEED_WORKERS", "1")
    assert seed_workers_by_dp_rank(loader, 1) and loader.worker_init_fn.keywords == {"rank": 1}
    mine = DataLoader(TensorDataset(torch.ones(4)), worker_init_fn=print)
    assert not seed_workers_by_dp_rank(mine, 1) and mine.worker_init_fn is print  # the user's own is kept
    assert os.environ["PL_SEED_WORKERS"] == "1"


def test_even_batches_outside_a_world_checks_nothing():
    check_even_batches([3, float("inf")], "validation", grid=None, device=torch.device("cpu"))


class _Writer(BasePredictionWriter):
    def __init__(self):
        super().__init__("batch")
        self.written = 0

    def write_on_batch_end(self, *args, **kwargs):
        self.written += 1


def test_prediction_writers_muted_on_mp_ranks_after_the_first_and_restored():
    w = _Writer()
    undo = mute_prediction_writers([w, object()], mp_rank=1)
    w.write_on_batch_end(None)
    assert w.written == 0
    undo()
    w.write_on_batch_end(None)
    assert w.written == 1
    mute_prediction_writers([w], mp_rank=0)()
    w.write_on_batch_end(None)
    assert w.written == 2


def test_ddp_advice_names_our_argument_and_leaves_other_errors_alone():
    e = RuntimeError("... `strategy='ddp_find_unused_parameters_true'` or ...")
    assert advise_our_arguments(e, 2, 4, 1)
    assert "DPMPStrategy(dp=2, mp=4, find_unused_parameters=True)" in str(e) and "ddp_find" not in str(e)
    other = ValueError("shape mismatch")
    assert not advise_our_arguments(other, 2, 2, 0) and str(other) == "shape mismatch"


def test_mp_batch_values_checked_at_construction():
    with pytest.raises(ValueError, match="`mp_batch` must be 'broadcast'.*got 'gather'"):
        DPMPStrategy(dp=1, mp=2, mp_batch="gather")
    assert DPMPStrategy(dp=1, mp=2, mp_batch="check")._mp_batch == "check"


def test_averaging_callbacks_refused_only_where_inexact():
    swa, ema = StochasticWeightAveraging(swa_lrs=1e-2), EMAWeightAveraging()
    check_averaging_callbacks([swa, ema], mp=4, zero=2, stage="fit")  # averaged on the shards
    check_averaging_callbacks([swa], mp=1, zero=3, stage="validate")  # not fitting: it copies nothing
    with pytest.raises(ValueError, match="StochasticWeightAveraging .* zero=3 frees"):
        check_averaging_callbacks([swa], mp=1, zero=3, stage="fit")
    with pytest.raises(ValueError, match="EMAWeightAveraging .* sharded checkpoints"):
        check_averaging_callbacks([ema], mp=2, zero=0, stage="fit", distributed=True)
    assert averaging.averaging_callbacks([swa, object(), ema]) == [swa, ema]


def test_averaged_copy_found_and_paired_by_name():
    swa = StochasticWeightAveraging(swa_lrs=1e-2)
    assert compat.averaged_copy(swa) is None
    model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
    swa._average_model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
    assert compat.averaged_copy(swa) is swa._average_model
    ema = EMAWeightAveraging()
    ema._average_model = torch.optim.swa_utils.AveragedModel(model)
    assert compat.averaged_copy(ema) is ema._average_model.module
    averaging._take_shards(swa._average_model, model)
    assert all(torch.equal(a, b) and a is not b for a, b in zip(swa._average_model.parameters(), model.parameters()))
    with pytest.raises(ValueError, match="parameters differ from the split model's from position 0"):
        averaging._take_shards(nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.LayerNorm(2)}), model)
