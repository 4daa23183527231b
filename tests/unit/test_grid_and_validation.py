"""Topology arithmetic and configuration errors that must fail before any process or collective starts."""

from __future__ import annotations

import time
from datetime import timedelta

import lightning as L
import pytest
from lightning.pytorch.strategies import StrategyRegistry

import lightning_dpmp
from lightning_dpmp import DPMPStrategy
from lightning_dpmp.parallel.topology import Topology


@pytest.mark.parametrize("dp,mp", [(1, 4), (2, 2), (4, 1), (2, 4), (3, 5)])
def test_mp_is_innermost(dp, mp):
    topology = Topology(dp=dp, mp=mp)
    mp_groups, dp_groups = topology.mp_groups(), topology.dp_groups()
    assert mp_groups == [list(range(d * mp, (d + 1) * mp)) for d in range(dp)]
    assert dp_groups == [list(range(m, dp * mp, mp)) for m in range(mp)]
    for rank in range(dp * mp):
        d, s, m = topology.coords(rank)
        assert rank == d * mp + m and s == 0
        assert rank in mp_groups[d] and rank in dp_groups[m]


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True, False, None, 2.0])
@pytest.mark.parametrize("which", ["dp", "mp"])
def test_sizes_must_be_positive_ints(which, bad):
    kwargs = {"dp": 1, "mp": 1, which: bad}
    with pytest.raises(ValueError, match=rf"`{which}` must be a positive integer.*got {bad!r}"):
        DPMPStrategy(**kwargs)


def test_auto_is_accepted_but_other_strings_are_not():
    DPMPStrategy(dp="auto", mp="auto")
    with pytest.raises(ValueError, match="`mp` must be a positive integer or \"auto\""):
        DPMPStrategy(dp=1, mp="four")


@pytest.mark.parametrize(
    "devices,num_nodes,dp,mp",
    [(3, 1, 2, 2), (4, 1, 2, 4), (2, 2, 2, 1), (8, 1, 3, 2)],
)
def test_devices_mismatch_fails_when_the_trainer_is_built(devices, num_nodes, dp, mp):
    start = time.monotonic()
    with pytest.raises(ValueError) as err:
        L.Trainer(
            accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=DPMPStrategy(dp=dp, mp=mp), logger=False
        )
    msg = str(err.value)
    for part in (f"dp={dp}", f"mp={mp}", f"dp*mp = {dp * mp}", f"devices={devices}", f"num_nodes={num_nodes}"):
        assert part in msg, (part, msg)
    assert time.monotonic() - start < 5


def test_world_size_recheck_message():
    with pytest.raises(ValueError, match=r"needs dp\*mp = 4 processes, but the process group has world size 3"):
        Topology(dp=2, mp=2).check_world(3)


def test_grid_before_setup_is_a_clear_error():
    with pytest.raises(RuntimeError, match="built in setup_environment"):
        _ = DPMPStrategy(dp=1, mp=2).grid


def test_registry_names_and_auto_sizes():
    assert "dpmp" in StrategyRegistry and "dpmp_spawn" in StrategyRegistry
    DPMPStrategy.register_strategies(StrategyRegistry)  # a second registration is harmless
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="dpmp", logger=False)
    assert isinstance(trainer.strategy, DPMPStrategy)
    # "dpmp" is DPMPStrategy(dp="auto", mp="auto"): the split of the world is chosen at setup (issue 16), no longer
    # dp = nodes x mp = devices per node; reading it earlier is a clear error (tests/unit/test_autolayout.py).
    assert trainer.strategy.layout_pending
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DPMPStrategy(dp=1), logger=False)
    assert (trainer.strategy.dp, trainer.strategy.mp) == (1, 2)
    assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=DPMPStrategy(dp=2), logger=False)
    assert (trainer.strategy.dp, trainer.strategy.mp) == (2, 2)
    assert lightning_dpmp.__version__


def test_sampler_shards_over_dp_only():
    strategy = DPMPStrategy(dp=2, mp=2)
    L.Trainer(accelerator="cpu", devices=4, strategy=strategy, logger=False)
    for rank, expect in [(0, 0), (1, 0), (2, 1), (3, 1)]:
        strategy.cluster_environment.set_global_rank(rank)
        assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": expect}


def test_unsupported_options_are_refused():
    with pytest.raises(ValueError, match="process_group"):
        DPMPStrategy(dp=1, mp=2, process_group=object())
    with pytest.raises(ValueError, match="`timeout` must be a positive datetime.timedelta"):
        DPMPStrategy(dp=1, mp=2, timeout=timedelta(seconds=0))
