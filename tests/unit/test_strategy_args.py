"""DPMPStrategy's constructor names and aliases, and the (dp, mp) layout resolved once (no processes)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from lightning_dpmp import DPMPStrategy
from lightning_dpmp.integration.strategy_checkpoint import StrategyCheckpointer
from lightning_dpmp.parallel.topology import Topology


def test_plan_overrides_property_and_removed_aliases() -> None:
    assert DPMPStrategy(dp=1, mp=2, plan_overrides={"a": "row"}).plan_overrides == {"a": "row"}
    assert DPMPStrategy(dp=1, mp=2).plan_overrides is None
    with pytest.raises(TypeError, match=r"no argument `plan`: use `plan_overrides=`"):
        DPMPStrategy(dp=1, mp=2, plan={"a": "row"})
    with pytest.raises(TypeError, match=r"no argument `timeout_s`: use `timeout=timedelta\(seconds=\.\.\.\)`"):
        DPMPStrategy(dp=1, mp=2, timeout_s=30)
    assert not hasattr(DPMPStrategy, "plan")  # the deprecated alias of applied_plan is gone


def test_plan_overrides_are_parsed_once_at_construction(monkeypatch) -> None:
    """Every later check (before launch, at setup, planning, each ``mp="auto"`` candidate) takes the parsed object
    and never parses again: with the parser broken after construction, they all still run."""
    from torch import nn

    from lightning_dpmp.planner import user_plan
    from lightning_dpmp.planner.plan import make_plan

    rules = {"0": "column", "2": "row"}
    s = DPMPStrategy(dp=1, mp=2, plan_overrides=rules)
    parsed = s.parsed_plan_overrides
    assert isinstance(parsed, user_plan.PlanOverrides) and parsed.rules == (("0", "column"), ("2", "row"))

    def parse_again(_plan):
        raise AssertionError("plan_overrides parsed a second time")

    monkeypatch.setattr(user_plan, "check_styles", parse_again)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
    user_plan.check_plan_on_model(model, parsed, 2)
    for mp in (2, 4):  # mp="auto" costs each candidate with the same object
        plan = make_plan(model, mp, None, parsed)
        assert (plan.layers["0"].style, plan.layers["2"].style) == ("column", "row")
    with pytest.raises(AssertionError, match="parsed a second time"):  # a raw mapping is parsed (the check is live)
        make_plan(model, 2, None, rules)


def test_applied_plan_before_setup() -> None:
    assert DPMPStrategy(dp=1, mp=2).applied_plan is None


def test_timeout_is_a_timedelta_as_in_ddp() -> None:
    assert DPMPStrategy(timeout=timedelta(seconds=30)).timeout == timedelta(seconds=30)
    assert DPMPStrategy().timeout == timedelta(seconds=600)  # not torch's 30 minutes
    with pytest.raises(ValueError, match=r"got 30: pass timeout=timedelta\(seconds=30\)"):
        DPMPStrategy(timeout=30)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive datetime.timedelta"):
        DPMPStrategy(timeout=timedelta(0))


def test_layout_is_resolved_when_devices_are_known() -> None:
    s = DPMPStrategy(dp="auto", mp=2)
    with pytest.raises(RuntimeError, match="resolved when the Trainer sets devices"):
        _ = s.dp
    assert Topology.resolve("auto", 2, 4) == Topology(dp=2, mp=2)
    assert Topology.resolve(2, "auto", 8, num_nodes=2) == Topology(dp=2, mp=4)
    assert Topology.resolve("auto", "auto", 16, num_nodes=2) == Topology(dp=2, mp=8)
    assert Topology.resolve("auto", 2, 8, pp=2, zero=3) == Topology(dp=2, mp=2, pp=2, zero=3)
    with pytest.raises(ValueError, match="not divisible by mp=3"):
        Topology.resolve("auto", 3, 4)


def test_checkpointing_is_a_collaborator_not_a_base_class() -> None:
    s = DPMPStrategy(dp=1, mp=2, save_distributed_checkpoint=True)
    assert isinstance(s.checkpointer, StrategyCheckpointer) and s.checkpointer.strategy is s
    assert s.checkpointer.distributed is True
    assert not any(c.__name__ == "CheckpointMixin" for c in type(s).__mro__)


def test_every_lightning_hook_the_strategy_overrides_is_written_out_and_marked() -> None:
    """No generated overrides: each Lightning ``Strategy`` method that DPMPStrategy (or its grid base) replaces is
    a method of its own class body, marked ``@override`` (so a renamed Lightning hook fails mypy and this test)."""
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_dpmp.integration.grid_strategy import GridStrategy

    lightning_names = {n for n in dir(DDPStrategy) if not n.startswith("__") and callable(getattr(DDPStrategy, n, None))
                       or isinstance(getattr(DDPStrategy, n, None), property)} - {"_abc_impl"}
    for cls in (DPMPStrategy, GridStrategy):
        for name, attr in vars(cls).items():
            if name not in lightning_names:
                continue
            func = attr.fget if isinstance(attr, property) else getattr(attr, "__func__", attr)
            func = getattr(func, "__wrapped__", func)  # @contextmanager
            assert getattr(func, "__override__", False), f"{cls.__name__}.{name} overrides Lightning without @override"
            assert func.__qualname__ == f"{cls.__name__}.{name}", f"{cls.__name__}.{name} is generated elsewhere"


def test_mixed_precision_is_refused_where_the_zero_engine_would_ignore_it():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    DPMPStrategy(dp=2, mp=2, zero=3, mixed_precision=bf16)  # accepted
    for kwargs in ({"zero": 1}, {"zero": 0}, {"zero": 3, "dp": 1}):
        with pytest.raises(ValueError, match=r"ZeRO-2/3 engine.*got zero=\d and dp=\S+"):
            DPMPStrategy(**{"dp": 2, "mp": 2, **kwargs, "mixed_precision": bf16})
    with pytest.raises(TypeError, match="param_dtype must be a floating-point"):
        DPMPStrategy(dp=2, mp=2, zero=3, mixed_precision=MixedPrecisionPolicy(param_dtype=torch.int8))
    with pytest.raises(ValueError, match="output_dtype is not supported"):
        DPMPStrategy(dp=2, mp=2, zero=3, mixed_precision=MixedPrecisionPolicy(output_dtype=torch.float32))
