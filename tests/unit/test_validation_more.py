"""More bad input rejected before any process starts, and the consistency guard's arithmetic (no processes).

Cases already covered elsewhere (not repeated here): dp/mp types and dp*mp vs devices*num_nodes in
test_grid_and_validation.py, plan patterns and forced non-divisible splits in test_plan.py, the world size under
torchrun in tests/integration/test_launchers.py.
"""

from __future__ import annotations

import time
import warnings

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from lightning_dpmp import DPMPStrategy
from lightning_dpmp.integration.guard import ConsistencyGuard, batch_checksum, first_divergence, tensor_checksum
from lightning_dpmp.integration.validate import DataShardingWarning, warn_if_data_not_sharded


def _trainer(**kwargs):
    return L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, **kwargs)


def test_nccl_on_cpu_is_refused_when_the_trainer_is_built():
    start = time.monotonic()
    with pytest.raises(ValueError) as err:
        _trainer(devices=4, strategy=DPMPStrategy(dp=2, mp=2, process_group_backend="nccl"))
    msg = str(err.value)
    assert "process_group_backend='nccl' needs CUDA devices" in msg and "4 cpu device(s)" in msg
    assert "process_group_backend='gloo'" in msg  # the fix
    assert time.monotonic() - start < 5


def test_sync_batchnorm_with_mp_is_refused_when_the_trainer_is_built():
    expected = r"sync_batchnorm=True is not supported with mp=2.*count 2 times.*sync_batchnorm=False"
    with pytest.raises(ValueError, match=expected):
        _trainer(devices=4, sync_batchnorm=True, strategy=DPMPStrategy(dp=2, mp=2))
    _trainer(devices=2, sync_batchnorm=True, strategy=DPMPStrategy(dp=2, mp=1))  # mp=1: plain DDP semantics, allowed


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True])
def test_consistency_interval_must_be_a_non_negative_int(bad):
    with pytest.raises(ValueError, match=rf"`check_consistency_every_n_steps` must be a non-negative int.*{bad!r}"):
        DPMPStrategy(dp=1, mp=2, check_consistency_every_n_steps=bad)


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(8))


def test_unsharded_data_warns_and_names_dp_rank_and_dp_size():
    expected = r"dp=2, mp=2\): the training data is an IterableDataset \(_Stream\)"
    with pytest.warns(DataShardingWarning, match=expected) as rec:
        warn_if_data_not_sharded(DataLoader(_Stream()), True, dp=2, mp=2)
    assert "trainer.strategy.dp_rank" in str(rec[0].message) and "trainer.strategy.dp_size" in str(rec[0].message)
    with pytest.warns(DataShardingWarning, match=r"use_distributed_sampler=False"):
        warn_if_data_not_sharded({"a": DataLoader(range(8))}, False, dp=2, mp=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_if_data_not_sharded(DataLoader(range(8)), True, dp=2, mp=2) is None  # Lightning shards it
        # one replica: nothing to shard
        assert warn_if_data_not_sharded(DataLoader(_Stream()), False, dp=1, mp=4) is None


def test_strategy_exposes_dp_rank_and_dp_size():
    strategy = DPMPStrategy(dp=2, mp=2)
    _trainer(devices=4, strategy=strategy)
    strategy.cluster_environment.set_global_rank(3)
    assert (strategy.dp_rank, strategy.dp_size, strategy.mp_rank) == (1, 2, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool])
def test_checksum_is_exact_and_sees_one_bit_and_a_swap(dtype):
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(37, 5, generator=g) * 10).to(dtype)
    assert torch.equal(tensor_checksum(t), tensor_checksum(t.clone()))
    assert torch.equal(tensor_checksum(t.t().contiguous().t()), tensor_checksum(t))  # layout does not matter
    flipped = t.clone().reshape(-1)
    flipped.view(torch.uint8)[3] ^= 1  # one bit
    assert not torch.equal(tensor_checksum(flipped), tensor_checksum(t.reshape(-1)))
    if dtype != torch.bool:
        swapped = t.clone().reshape(-1)
        swapped[[0, 1]] = swapped[[1, 0]]
        if not torch.equal(swapped, t.reshape(-1)):
            assert not torch.equal(tensor_checksum(swapped), tensor_checksum(t))


def test_batch_checksum_covers_every_leaf_and_its_order():
    cpu = torch.device("cpu")
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 2, 0])
    assert torch.equal(batch_checksum((x, y), cpu), batch_checksum((x.clone(), y.clone()), cpu))
    assert not torch.equal(batch_checksum((x, y), cpu), batch_checksum((x, y + 1), cpu))
    assert not torch.equal(batch_checksum({"a": 1, "b": 2}, cpu), batch_checksum({"a": 2, "b": 1}, cpu))


def _table(world: int, n_params: int) -> torch.Tensor:
    return torch.arange(3 * (n_params + 1)).reshape(1, n_params + 1, 3).repeat(world, 1, 1)


def test_first_divergence_names_the_parameter_the_ranks_and_the_kind():
    names, sharded = ["inp.weight", "blocks.0.fc1.weight", "norm.weight"], [False, True, False]
    ok = _table(4, 3)
    ok[1, 1] += 5  # a shard: MP ranks hold different slices, which is expected
    ok[3, 1] += 5  # ... and its DP replica (rank 3 = dp_rank 1, mp_rank 1) holds the same
    assert first_divergence(ok, names, sharded, mp=2) is None
    bad = ok.clone()
    bad[2, 1, 2] += 1  # rank 2's shard differs from its DP replica, rank 0
    bad[3, 2, 0] += 1  # a later parameter also differs: the first one is named
    msg = first_divergence(bad, names, sharded, mp=2)
    assert msg == (
        "parameter 'blocks.0.fc1.weight' (sharded over MP; DP replicas) on rank 2 (dp_rank 1, mp_rank 0)"
        " differs from rank 0 (dp_rank 0, mp_rank 0)"
    )
    rep = ok.clone()
    rep[1, 2, 1] += 1  # an MP-replicated LayerNorm weight differs inside MP group 0
    expected = "parameter 'norm.weight' (replicated over MP) on rank 1 (dp_rank 0, mp_rank 1)"
    assert expected in first_divergence(rep, names, sharded, 2)


def test_first_divergence_names_the_batch_of_an_mp_group():
    t = _table(4, 1)
    t[2:, -1] += 9  # DP rank 1 reads other data: expected
    assert first_divergence(t, ["w"], [False], mp=2) is None
    t[3, -1] += 1  # but its two MP ranks disagree
    msg = first_divergence(t, ["w"], [False], mp=2)
    assert msg.startswith(
        "the batch on rank 3 (dp_rank 1, mp_rank 1) differs from the batch on rank 2 (dp_rank 1, mp_rank 0)"
    )
    assert "strategy.dp_rank" in msg


def test_guard_is_a_no_op_when_off_or_between_checks():
    ConsistencyGuard(0).maybe_check(0, torch.nn.Linear(2, 2), None, object(), torch.device("cpu"))
    guard = ConsistencyGuard(3)
    guard.maybe_check(4, torch.nn.Linear(2, 2), None, object(), torch.device("cpu"))  # 4 % 3: no collective issued
    guard.maybe_check(3, torch.nn.Linear(2, 2), None, None, torch.device("cpu"))  # no grid yet: nothing to compare
