"""The selection logic of ``mp="auto"`` in one process: candidates, the plan-based cost of a traced model, the
ranking, and the strategy's pending layout (nothing may read dp/mp before the choice).

Issue 44 item 3 replaced the plan-based ranking (``planner.cost``) at setup by the layout estimator
(``planner.layout_search``): the two-figures test ranks with the estimator now, the precision test checks the
estimator's names, and the fallback test's stand-in trace returns the (trace, profile) pair ``_trace`` returns."""

from __future__ import annotations

import lightning as L
import pytest

from lightning_dpmp import DPMPStrategy
from lightning_dpmp.integration.autolayout import candidate_layouts
from lightning_dpmp.integration.firststep import estimator_profile
from lightning_dpmp.parallel.topology import Topology
from lightning_dpmp.planner.cost import LayoutCost, Links, model_cost, predict_layout, rank_layouts, ring_s
from lightning_dpmp.planner.layout_search import candidates, estimator_precision, measured_device, rank
from lightning_dpmp.planner.plan import make_plan
from lightning_dpmp.planner.trace import trace_step
from lightning_dpmp.planner.user_plan import PlanOverrides
from tests.support.models import build

SLOW_MESSAGES = Links(intra_bw=1e12, intra_latency=1e-2, flops=1e12, mem_bw=1e12)
SLOW_BYTES = Links(intra_bw=1e5, intra_latency=1e-9, flops=1e12, mem_bw=1e12)


@pytest.fixture(scope="module")
def costs():
    model, ds = build("resmlp")
    x, y = ds[0:2]
    trace = trace_step(model, lambda: model.training_step((x, y), 0))
    return {lay.mp: model_cost(model, make_plan(model, lay.mp, trace), trace, 4) for lay in candidate_layouts(4)}


def test_candidates():
    assert candidate_layouts(6) == [Topology(dp=d, mp=6 // d) for d in (6, 3, 2, 1)]
    assert candidate_layouts(4, mp_one_only=True) == [Topology(dp=4, mp=1)]
    assert candidate_layouts(1) == [Topology()]


def test_model_cost_follows_the_plan(costs):
    one, two = costs[1], costs[2]
    assert one.split_params == 0 and one.mp_collectives == []
    assert two.tokens == 2 and two.split_params + two.replicated_params == one.replicated_params
    # fc1/fc2 of 2 blocks are a column -> row pair each: 2 backward + 2 forward all-reduces, plus the input
    # layer's gather pair (the 3-output head stays whole)
    ops = sorted((p, o) for p, o, _ in two.mp_collectives)
    assert ops.count(("forward", "all_reduce")) == 2 and ops.count(("backward", "all_reduce")) == 2


def test_two_figures_two_choices():
    model, ds = build("resmlp")
    batch = ds[0:2]
    prof, per_rank = estimator_profile(model, lambda: model.training_step(batch, 0), batch)
    specs, _ = candidates(prof, 4, per_rank, pp=1, zero=0)
    rows = {}
    for name, links in (("latency", SLOW_MESSAGES), ("bandwidth", SLOW_BYTES)):
        dev = measured_device(links.intra_bw, links.intra_latency, links.flops, links.mem_bw, 4, 2**30, cpu=True)
        rows[name] = rank(prof, dev, specs, 4, per_rank, "32-true").rows
    assert (rows["latency"][0].dp, rows["latency"][0].mp) == (4, 1)
    assert rows["bandwidth"][0].mp > 1
    tps = [r.tokens_per_s for r in rows["latency"]]
    assert tps == sorted(tps, reverse=True)


def test_ranking_prefers_fitting_then_throughput_then_small_mp():
    def row(dp, mp, tps, fits=True):
        return LayoutCost(dp, mp, 0, 0, 0, 0, 1, tps, 0, 0, 0, fits)

    ranked = rank_layouts([row(1, 4, 10.0), row(2, 2, 10.0 * (1 + 1e-12)), row(4, 1, 99.0, fits=False)])
    assert [(r.dp, r.mp) for r in ranked] == [(2, 2), (1, 4), (4, 1)]


def test_prediction_arithmetic(costs):
    r = predict_layout(costs[2], SLOW_BYTES, 2, 2, devices_per_node=4, elem_bytes=4)
    expected_mp = sum(ring_s(b, 2, SLOW_BYTES.intra_bw, SLOW_BYTES.intra_latency, op)
                      for _, op, b in costs[2].mp_collectives)
    assert r.mp_comm_s == pytest.approx(expected_mp)
    assert r.tokens_per_s == pytest.approx(2 * costs[2].tokens / r.step_s)
    spans = predict_layout(costs[4], SLOW_BYTES, 1, 4, devices_per_node=2, elem_bytes=4)
    assert "MP group spans nodes" in spans.notes


def test_pending_layout_before_setup():
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=DPMPStrategy(), logger=False)
    strategy = trainer.strategy
    assert strategy.chooses_layout and strategy.layout_pending
    with pytest.raises(RuntimeError, match="chooses dp and mp at setup"):
        _ = strategy.dp
    assert strategy.layout_report == ""
    # an integer keeps today's behaviour exactly
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=DPMPStrategy(mp=2), logger=False)
    assert not trainer.strategy.layout_pending and (trainer.strategy.dp, trainer.strategy.mp) == (2, 2)
    # a kept (measured) choice is reused by later runs of the same strategy
    strategy._chosen = Topology(dp=2, mp=2)
    strategy.set_world_ranks()
    assert not strategy.layout_pending and (strategy.dp, strategy.mp) == (2, 2)
    assert "kept from this strategy's earlier mp='auto' choice" in strategy.layout_report


def test_element_bytes_by_precision():
    assert [estimator_precision(p) for p in ("64-true", "32-true", "bf16-mixed", "bf16-true")] == [
        "64-true", "32-true", "bf16-mixed", "bf16-true"]


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_transformer_costs_count_the_blocks_collectives(name):
    model, ds = build(name)
    ids, targets = ds[0:2]
    trace = trace_step(model, lambda: model.training_step((ids, targets), 0))
    cost = model_cost(model, make_plan(model, 2, trace), trace, 4)
    assert cost.tokens == ids.numel()  # rows per Linear call: batch x sequence
    # 2 blocks x (2 forward + 2 backward all-reduces), the vocab embedding's forward all-reduce and the
    # vocab-parallel loss's two; nothing gathered
    ops = [(p, o) for p, o, _ in cost.mp_collectives]
    assert ops.count(("backward", "all_reduce")) >= 4 and ("forward", "all_gather") not in ops
    assert cost.split_params > 0 and cost.split_matmul > cost.replicated_matmul


def test_no_trace_falls_back_to_todays_rule(monkeypatch):
    import lightning_dpmp.integration.autolayout as autolayout

    monkeypatch.setattr(autolayout, "_trace", lambda *a: (None, None))
    choice = autolayout.choose_layout(object(), num_processes=4, num_nodes=1,
                                      plan_overrides=PlanOverrides())
    assert choice.layout == Topology(dp=1, mp=4) and not choice.measured
    assert "fell back to dp = nodes, mp = devices per node" in choice.text
    one = autolayout.choose_layout(None, 1, 1, None)
    assert one.layout == Topology()
