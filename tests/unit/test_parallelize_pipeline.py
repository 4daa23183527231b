"""The parallelize pipeline's order (issue 25, item 1): one call, its steps in the written order, per stage and zero.

Each step function of :mod:`lightning_dpmp.integration.parallelize` is replaced by a recorder, so the test sees
which steps :func:`parallelize` runs, in which order, with what; the steps themselves are covered by the parity,
ZeRO and compile tests, which run through this same pipeline.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

import lightning_dpmp.integration.parallelize as pipeline
from lightning_dpmp.integration.parallelize import ParallelConfig, Parallelized
from lightning_dpmp.integration.split import Split
from lightning_dpmp.parallel.topology import Topology
from lightning_dpmp.planner.user_plan import PlanOverrides


class _Engine:
    def __init__(self, split_shard: nn.Parameter, level: int) -> None:
        self.split_shard = split_shard
        self.level = level
        self.calls: list[str] = []
        self.buckets: list[Any] = []

    def gathered(self, params: Any = None) -> Any:  # (what a user's read of a freed zero=3 parameter gathers)
        raise AssertionError("no parameter is read here")

    def shard_params(self, kind: str) -> list[nn.Parameter]:
        return [self.split_shard] if kind == "split" else []

    def after_step(self) -> None:
        self.calls.append("after_step")


def _run(monkeypatch: pytest.MonkeyPatch, dp: int, mp: int, zero: int, fn: TrainerFn, conditional: tuple = ()
         ) -> tuple[list[str], Parallelized, Any]:
    calls: list[str] = []
    module = nn.Linear(2, 2)
    shard = nn.Parameter(torch.zeros(1))
    plan = SimpleNamespace(conditional=conditional, text="plan")
    split = Split(applied_plan=plan, rng=None, partial_grads=[], split_params={id(module.weight)})  # type: ignore
    engine = _Engine(shard, zero)
    grid = SimpleNamespace(dp=dp, mp=mp, pp=1, rank=0, dp_group="dp", mp_group="mp",
                           topology=Topology(dp=dp, mp=mp, zero=zero))
    optimizers: list[Any] = []

    def setup_optimizers() -> tuple[list[Any], list[Any]]:
        calls.append("setup_optimizers")
        return optimizers, []

    def record(name: str, result: Any = None) -> Any:
        def step(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return result
        return step

    monkeypatch.setattr(pipeline, "plan_and_split", record("plan_and_split", split))
    monkeypatch.setattr(pipeline, "route_metrics", record("route_metrics"))
    monkeypatch.setattr(pipeline, "overlap_grad_allreduce", record("overlap_grad_allreduce"))
    monkeypatch.setattr(pipeline, "compile_model", lambda m, enabled: calls.append("compile_model") or enabled)
    monkeypatch.setattr(pipeline, "wrap_dp", lambda configure, kwargs, grid, cond: calls.append(
        f"wrap_dp(conditional={cond})"))
    monkeypatch.setattr(pipeline, "shard_dp", record("shard_dp", (optimizers, engine)))
    monkeypatch.setattr(pipeline, "install_step_hooks",
                        lambda plugin, parallel, dp_group, pp_group=None: calls.append(
                            f"install_step_hooks(dp_group={dp_group})"))
    config = ParallelConfig(PlanOverrides(), compile=True)
    trainer = SimpleNamespace(state=SimpleNamespace(fn=fn))
    parallel = pipeline.parallelize(trainer, module, module, grid, torch.device("cpu"), "plugin", config, meta=False,
                                    mesh=lambda: None, ddp_kwargs={}, configure_ddp=lambda kwargs: None,
                                    setup_optimizers=setup_optimizers)
    return calls, parallel, shard


MODEL_STEPS = ["plan_and_split", "route_metrics", "overlap_grad_allreduce", "compile_model"]


def test_fitting_at_zero0_wraps_in_ddp_before_the_optimizers(monkeypatch: pytest.MonkeyPatch) -> None:
    calls, parallel, _ = _run(monkeypatch, dp=2, mp=2, zero=0, fn=TrainerFn.FITTING)
    assert calls == MODEL_STEPS + ["wrap_dp(conditional=False)", "setup_optimizers",
                                   "install_step_hooks(dp_group=None)"]
    assert parallel.engine is None and parallel.compiled and parallel.plan.text == "plan"


def test_a_conditional_trace_asks_ddp_to_find_unused_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    calls, _, _ = _run(monkeypatch, dp=2, mp=1, zero=0, fn=TrainerFn.FITTING, conditional=("experts",))
    assert "wrap_dp(conditional=True)" in calls


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_fitting_under_zero_shards_after_the_optimizers_and_counts_its_split_shards(
        monkeypatch: pytest.MonkeyPatch, zero: int) -> None:
    calls, parallel, shard = _run(monkeypatch, dp=2, mp=2, zero=zero, fn=TrainerFn.FITTING)
    assert calls == MODEL_STEPS + ["setup_optimizers", "shard_dp", "install_step_hooks(dp_group=dp)"]
    assert parallel.engine is not None
    assert id(shard) in parallel.split_params  # the clip sums the engine's flat MP shards over MP too
    closure = parallel.step_closure(lambda: "loss", [])
    assert closure is not None
    parallel.after_step()
    assert parallel.engine.calls == ["after_step"]  # type: ignore[attr-defined]
    # user code runs under a mode that reads the engine's gradients on demand (at zero=3 its freed parameters too)
    assert parallel.reader is not None and parallel.grads is not None
    assert parallel.reader.sink is not None  # (an L2 term's gradient goes into the engine's accumulator)
    parallel.leave_reader()
    assert parallel.reader is None


def test_one_dp_rank_neither_wraps_nor_shards(monkeypatch: pytest.MonkeyPatch) -> None:
    calls, parallel, _ = _run(monkeypatch, dp=1, mp=2, zero=3, fn=TrainerFn.FITTING)
    assert calls == MODEL_STEPS + ["setup_optimizers", "install_step_hooks(dp_group=None)"]
    assert parallel.engine is None


@pytest.mark.parametrize("fn", [TrainerFn.VALIDATING, TrainerFn.TESTING, TrainerFn.PREDICTING])
def test_outside_fitting_only_the_model_steps_run(monkeypatch: pytest.MonkeyPatch, fn: TrainerFn) -> None:
    calls, parallel, _ = _run(monkeypatch, dp=2, mp=2, zero=2, fn=fn)
    assert calls == MODEL_STEPS + ["install_step_hooks(dp_group=None)"]
    assert parallel.engine is None


def test_mp1_without_zero_installs_no_step_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    calls, _, _ = _run(monkeypatch, dp=2, mp=1, zero=0, fn=TrainerFn.FITTING)
    assert calls == MODEL_STEPS + ["wrap_dp(conditional=False)", "setup_optimizers"]


def test_step_closure_sums_only_the_stepped_partial_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    sums: list[list[nn.Parameter]] = []
    monkeypatch.setattr(pipeline, "sync_partial_grads", lambda params, group: sums.append(list(params)))
    a, b = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
    parallel = Parallelized(SimpleNamespace(), None, frozenset(), [a, b], "mp")  # type: ignore[arg-type]
    parallel.step_closure(lambda: None, [b])()  # (the sum runs after the closure)
    assert sums == [[b]]
    assert parallel.step_closure(lambda: 1, [])() == 1  # nothing partial stepped: the closure as it is
    assert sums == [[b]]


def test_wrap_dp_gives_ddp_this_runs_options_on_a_copy() -> None:
    """DDP gets the DP group and, for a step that branched, ``find_unused_parameters=True``; the user's options are
    never mutated, so a later fit (another layout, a plan without branches) does not inherit them."""
    seen: list[dict[str, Any]] = []
    user = {"bucket_cap_mb": 50}
    grid = SimpleNamespace(mp=2, dp_group="dp")
    pipeline.wrap_dp(seen.append, user, grid, conditional=True)
    pipeline.wrap_dp(seen.append, user, grid, conditional=False)
    assert seen == [{"bucket_cap_mb": 50, "process_group": "dp", "find_unused_parameters": True},
                    {"bucket_cap_mb": 50, "process_group": "dp"}]
    assert user == {"bucket_cap_mb": 50} and all(s is not user for s in seen)


def test_the_strategy_builds_ddp_with_the_runs_options_and_puts_the_users_back() -> None:
    """``DPMPStrategy._configure_ddp_with`` (what :func:`wrap_dp` is given): ``configure_ddp`` sees this run's
    options, and the strategy holds the user's own dict again afterwards."""
    from lightning_dpmp import DPMPStrategy
    from lightning_dpmp.compat import ddp_kwargs

    strategy = DPMPStrategy(dp=2, mp=1, bucket_cap_mb=50)
    user = ddp_kwargs(strategy)
    seen: list[dict[str, Any]] = []
    strategy.configure_ddp = lambda: seen.append(dict(ddp_kwargs(strategy)))  # type: ignore[method-assign]
    strategy._configure_ddp_with({**user, "find_unused_parameters": True})
    assert seen == [{**user, "find_unused_parameters": True}]
    assert ddp_kwargs(strategy) is user and "find_unused_parameters" not in user
