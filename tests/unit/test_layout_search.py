"""The setup-time layout search of ``DPMPStrategy(dp="auto", mp="auto", pp="auto", zero="auto")`` (issue 44 item 3)
in one process: the candidates a world and the given sizes allow, the ranking and the zero rule on a synthetic
profile and a fake device, the refusal's wording, and the strategy's arguments (pending until setup, refusals)."""

from __future__ import annotations

from dataclasses import replace

import lightning as L
import pytest
import torch

from lightning_dpmp import DPMPStrategy
from lightning_dpmp.integration.autolayout import link_figures
from lightning_dpmp.parallel.topology import Topology
from lightning_dpmp.planner.estimate import LayoutSpec, predict
from lightning_dpmp.planner.gpt_shape import GPTShape
from lightning_dpmp.planner.layout_search import (
    CPU_MICRO_OVERHEAD_S,
    ZERO_MARGIN,
    candidates,
    format_ranking,
    measured_device,
    rank,
    refusal,
)
from lightning_dpmp.planner.profile import ModelProfile

PROF = ModelProfile.from_gpt(GPTShape(layers=4, hidden=256, heads=4, vocab=512, seq=64, batch=8))


def device(memory_gib: float = 4.0, **kw) -> object:
    figures = dict(intra_bw=1e9, intra_latency=1e-5, flops=1e10, mem_bw=1e10)
    figures.update(kw)
    return measured_device(**figures, devices_per_node=4, memory_bytes=memory_gib * 2**30, cpu=True)


def test_candidates_follow_the_given_sizes_and_the_model():
    specs, out = candidates(PROF, 4, per_rank_batch=4)
    grid = {(s.dp, s.pp, s.mp) for s in specs}
    assert grid == {(4, 1, 1), (2, 2, 1), (1, 4, 1), (2, 1, 2), (1, 2, 2), (1, 1, 4)} and not out
    assert {s.zero for s in specs if s.dp == 1} == {0} and {s.zero for s in specs if s.dp == 4} == {0, 1, 2, 3}
    assert all(s.microbatches == s.pp and s.schedule == ("none" if s.pp == 1 else "1f1b") for s in specs)
    # a given size fixes its axis; the others stay free
    fixed, _ = candidates(PROF, 4, 4, dp=2, zero=1)
    assert {(s.dp, s.pp, s.mp, s.zero) for s in fixed} == {(2, 2, 1, 1), (2, 1, 2, 1)}
    given, _ = candidates(PROF, 4, 4, mp=1, zero=1)  # a given level stays, also where dp=1 has nothing to shard
    assert {(s.dp, s.pp, s.zero) for s in given} == {(4, 1, 1), (2, 2, 1), (1, 4, 1)}
    # what the model and the batch allow: blocks, heads (and the planner's own verdict), micro-batches
    two_blocks = replace(PROF, layers=2, heads=2)
    specs, out = candidates(two_blocks, 4, per_rank_batch=2, allowed_mp=[1, 2], microbatches=-1)
    assert {(s.dp, s.pp, s.mp) for s in specs} == {(4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 2, 2)}
    assert any("pp=4 x 1 stages per rank > the 2 repeated blocks" in o for o in out)
    assert any("the planner cannot split this model 4 ways" in o for o in out)
    _, out = candidates(PROF, 4, per_rank_batch=3)
    assert any("2 micro-batches do not divide the per-rank batch of 3" in o for o in out)
    _, out = candidates(replace(PROF, heads=6, kv_heads=6), 4, 4, allowed_mp=None)
    assert any("mp=4 does not divide the heads 6" in o for o in out)


def test_ranking_is_by_tokens_per_second_fitting_first():
    specs, _ = candidates(PROF, 4, 4, zero=0)
    ranking = rank(PROF, device(), specs, 4, 4, "32-true")
    tps = [e.tokens_per_s for e in ranking.rows if e.fits]
    assert tps == sorted(tps, reverse=True) and ranking.chosen is ranking.rows[0] and ranking.chosen.chosen
    # each row is the estimator's prediction at the global batch its dp implies
    e = ranking.rows[0]
    again = predict(PROF, device(), 4, e.dp * 4, e.spec, "32-true")
    assert again.step_s == pytest.approx(e.step_s) and e.tokens_per_s == pytest.approx(e.dp * 4 * 64 / e.step_s)
    # slow per message: no MP; slow per byte: not the gradient all-reduce of dp=4
    latency = rank(PROF, device(intra_latency=1e-1, intra_bw=1e13), specs, 4, 4, "32-true").chosen
    assert (latency.dp, latency.mp) == (4, 1)
    bandwidth = rank(PROF, device(intra_latency=1e-9, intra_bw=1e5), specs, 4, 4, "32-true").chosen
    assert bandwidth.dp < 4
    text = format_ranking(rank(PROF, device(), specs, 4, 4, "32-true"))
    assert text.splitlines()[1].startswith("->") and text.count("->") == 1


def test_a_pipeline_micro_batch_costs_its_schedule_work_on_a_shared_cpu():
    # one micro-batch's schedule work per stage, forward and backward, CPU seconds stretched by the ranks per core
    spec = LayoutSpec(1, 4, 1, microbatches=4, schedule="1f1b")
    shared = measured_device(1e9, 1e-5, 1e10, 1e10, 4, 2**32, cpu=True, processes_per_core=2)
    base = predict(PROF, replace(shared, micro_overhead_s=0.0), 4, 4, spec, "32-true")
    assert shared.micro_overhead_s == pytest.approx(2 * CPU_MICRO_OVERHEAD_S)
    slow = predict(PROF, shared, 4, 4, spec, "32-true")
    assert slow.step_s - base.step_s == pytest.approx(4 * 2 * CPU_MICRO_OVERHEAD_S)  # 4 micro-batches, no bubble
    assert slow.time["pp"] - base.time["pp"] == pytest.approx(4 * 2 * CPU_MICRO_OVERHEAD_S)
    flat = LayoutSpec(4, 1, 1)
    assert predict(PROF, shared, 4, 16, flat, "32-true").step_s == pytest.approx(
        predict(PROF, replace(shared, micro_overhead_s=0.0), 4, 16, flat, "32-true").step_s)  # no pipeline
    # a GPU's launches hide it; an oversubscribed count below one core per rank never shrinks it
    assert measured_device(1e9, 1e-5, 1e10, 1e10, 4, 2**32, cpu=False, processes_per_core=2).micro_overhead_s == 0
    assert measured_device(1e9, 1e-5, 1e10, 1e10, 4, 2**32, cpu=True, processes_per_core=0.25).micro_overhead_s \
        == pytest.approx(CPU_MICRO_OVERHEAD_S)


def test_link_figures_stay_finite_when_noise_hides_the_transfer():
    bw, lat = link_figures(6e-3, 18e-3, 4)  # 6 ring steps of 1 ms; 12 ms more for 4 MiB
    assert lat == pytest.approx(1e-3) and bw == pytest.approx(1.5 * (4 * 2**20 - 4096) / 12e-3)
    # the large all-reduce measured no slower than the small one (seen on a loaded CPU: 6e6 GB/s came out)
    bw, _ = link_figures(7.7e-3, 7.6e-3, 4)
    assert bw == pytest.approx(1.5 * (4 * 2**20 - 4096) / 0.76e-3)


def test_zero_auto_takes_the_lowest_level_that_fits_unless_a_higher_one_is_clearly_faster():
    specs, _ = candidates(PROF, 4, 4, dp=4)
    roomy = rank(PROF, device(), specs, 4, 4, "32-true")
    assert roomy.chosen.zero == 0  # every level fits and none is ZERO_MARGIN faster
    zero0 = next(e for e in roomy.rows + roomy.others if e.zero == 0)
    assert all(e.tokens_per_s <= zero0.tokens_per_s * (1 + ZERO_MARGIN) for e in roomy.others)
    peaks = {e.zero: e.peak_mem_gib for e in roomy.rows + roomy.others}
    tight = rank(PROF, device(memory_gib=(peaks[0] + peaks[1]) / 2), specs, 4, 4, "32-true")
    assert tight.chosen.zero == 1  # zero=0 no longer fits; 1 is the lowest that does
    slow_memory = rank(PROF, device(mem_bw=1e6), specs, 4, 4, "32-true")  # the AdamW step dominates
    assert slow_memory.chosen.zero >= 1  # sharding it over dp is far more than ZERO_MARGIN faster
    nothing = rank(PROF, device(memory_gib=1e-6), specs, 4, 4, "32-true")
    assert nothing.chosen is None and not any(e.fits for e in nothing.rows)


def test_the_refusal_names_the_numbers_and_what_would_fit():
    spec = LayoutSpec(4, 1, 1, 0)
    assert refusal(PROF, device(), spec, 4, 4, "32-true", "test") is None
    peaks = {z: predict(PROF, device(), 4, 16, replace(spec, zero=z), "32-true").peak_mem_gib for z in (0, 3)}
    limit = (peaks[0] + peaks[3]) / 2
    msg = refusal(PROF, device(memory_gib=limit), spec, 4, 4, "32-true", "DPMP_DEVICE_MEMORY_GIB=x")
    assert msg.startswith("DPMPStrategy(dp=4, pp=1, mp=1, zero=0) will not fit: the estimator predicts a peak of "
                          f"{peaks[0] * 1024:.1f} MiB per rank, over the {limit * 1024:.1f} MiB of device memory per"
                          " rank (DPMP_DEVICE_MEMORY_GIB=x). Largest: "), msg
    assert "predicted to fit: " in msg and "zero=3: " in msg and "DPMP_MEMORY_CHECK=0" in msg
    hopeless = refusal(PROF, device(memory_gib=1e-6), spec, 4, 4, "32-true", "x")
    assert "use more devices" in hopeless


def test_auto_pp_and_zero_wait_for_setup_and_bad_combinations_are_refused():
    s = DPMPStrategy(dp="auto", mp="auto", pp="auto", zero="auto")
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=s, logger=False)
    assert s.chooses_layout and s.layout_pending
    with pytest.raises(RuntimeError, match=r"DPMPStrategy\(dp='auto', mp='auto', pp='auto', zero='auto'\) chooses"
                                           r" the layout \(dp, pp, mp, zero\) at setup"):
        _ = s.pp
    with pytest.raises(RuntimeError, match="chooses the layout"):
        _ = s.zero
    del trainer
    # zero="auto" with integer sizes is chosen at setup too; pp given keeps its value
    fixed = L.Trainer(accelerator="cpu", devices=4, strategy=DPMPStrategy(dp=2, mp=2, zero="auto"), logger=False)
    assert fixed.strategy.layout_pending
    given = L.Trainer(accelerator="cpu", devices=4, strategy=DPMPStrategy(dp=2, mp=1, pp=2), logger=False)
    assert not given.strategy.layout_pending and given.strategy.topology == Topology(dp=2, pp=2)
    # a candidate takes the pipeline's settings as given
    s = DPMPStrategy(pp="auto", pp_schedule="gpipe", pp_microbatches=4)
    assert s.layout_of(1, 1, pp=4, zero=0) == Topology(pp=4, microbatches=4, schedule="gpipe")
    assert s.layout_of(4, 1, pp=1, zero=2) == Topology(dp=4, zero=2)
    with pytest.raises(ValueError, match=r"`zero` must be 0 .* or \"auto\""):
        DPMPStrategy(zero="two")
    with pytest.raises(ValueError, match="`pp` must be a positive integer"):
        DPMPStrategy(pp="two")
    with pytest.raises(ValueError, match="zero='auto' may not choose: give zero=2 or zero=3"):
        DPMPStrategy(zero="auto", mixed_precision=object())
    with pytest.raises(ValueError, match=r"zero='auto' may choose ZeRO.*\['static_graph'\]"):
        DPMPStrategy(zero="auto", static_graph=True)


def test_without_a_trace_auto_sizes_fall_back(monkeypatch):
    import lightning_dpmp.integration.autolayout as autolayout

    monkeypatch.setattr(autolayout, "_trace", lambda *a: (None, None))
    req = autolayout.Request(dp="auto", mp="auto", pp="auto", zero="auto")
    choice = autolayout.choose_layout(object(), num_processes=4, num_nodes=1,
                                      plan_overrides=None, request=req)
    assert choice.layout == Topology(dp=1, mp=4) and not choice.measured
    req = autolayout.Request(dp=2, mp="auto", pp=2, zero="auto", schedule="gpipe")
    choice = autolayout.choose_layout(object(), 4, 1, None, request=req)
    assert choice.layout == Topology(dp=2, pp=2, schedule="gpipe")


def test_device_memory_on_cpu_is_the_hosts_available_share(monkeypatch):
    from lightning_dpmp.integration.autolayout import device_memory

    monkeypatch.delenv("DPMP_DEVICE_MEMORY_GIB", raising=False)
    one, where = device_memory(torch.device("cpu"), 1)
    four, _ = device_memory(torch.device("cpu"), 4)
    assert one > 0 and four == pytest.approx(one / 4, rel=0.2) and "available" in where
    monkeypatch.setenv("DPMP_DEVICE_MEMORY_GIB", "0.5")
    assert device_memory(torch.device("cpu"), 4) == (0.5 * 2**30, "DPMP_DEVICE_MEMORY_GIB=0.5")


def test_the_memory_checks_lower_bound_counts_states_only():
    from lightning_dpmp.integration.autolayout import PROFILE_ABOVE, states_bytes

    net = torch.nn.Linear(100, 10)  # 1,010 parameters
    assert states_bytes(net, Topology(dp=2, mp=2), "64-true") == 1010 / 2 * (8 + 8 + 16)
    assert states_bytes(net, Topology(dp=2, mp=1, pp=2, zero=1), "32-true") == 1010 / 2 * (4 + 4 / 2 + 8 / 2)
    assert states_bytes(net, Topology(dp=4, zero=3), "bf16-mixed") == 1010 * (4 + 4 + 8) / 4
    assert 0 < PROFILE_ABOVE < 1
