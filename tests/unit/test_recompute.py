"""Activation checkpointing (issue 44 item 4) in one process: the estimator's k-of-N recomputation, ``"auto"``'s
choice under a fake memory limit, the refusals at construction, and the block wrapper (the MP dropout stream
replayed, evaluation untouched, the previous forward restored, the modes of user code off during the recompute)."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_dpmp import DPMPStrategy, FabricDPMPStrategy
from lightning_dpmp.integration.activations import NO_LIMIT, layout_spec, recompute_count
from lightning_dpmp.parallel.freed_reads import GatherOnRead, outermost_forward_hooks
from lightning_dpmp.parallel.recompute import (
    checkpoint_blocks,
    checkpointed_blocks,
    first_blocks,
    uncheckpoint_blocks,
)
from lightning_dpmp.parallel.rng import RNGTracker
from lightning_dpmp.parallel.topology import Topology
from lightning_dpmp.parallel.zero_engine import find_units
from lightning_dpmp.tools.costmodel import GPTShape
from lightning_dpmp.tools.estimate import DEVICES, LayoutSpec, fewest_recomputed, predict
from lightning_dpmp.tools.profile import ModelProfile

PROF = ModelProfile.from_gpt(GPTShape(layers=8, hidden=256, heads=8, vocab=512, seq=256, batch=8))


def _row(spec: LayoutSpec, k=None, recompute=True):
    return predict(PROF, DEVICES["h100"], spec.dp * spec.pp * spec.mp, 8,
                   replace(spec, recompute=recompute, recompute_blocks=k), "32-true")


@pytest.mark.parametrize("spec", [LayoutSpec(1, 1, 2), LayoutSpec(1, 2, 2, microbatches=4, schedule="1f1b")],
                         ids=["pp1", "pp2"])
def test_the_estimator_recomputes_k_of_n_blocks(spec: LayoutSpec) -> None:
    n = 8 // spec.pp
    rows = [_row(spec, k) for k in range(n + 1)]
    assert rows[0].memory == _row(spec, recompute=False).memory and rows[0].step_s == _row(spec, recompute=False).step_s
    assert rows[n].memory == _row(spec, None).memory and rows[n].step_s == _row(spec, None).step_s  # all of them
    acts = [r.memory["activations"] for r in rows]
    # each recomputed block keeps its input instead of its activations (the first k recompute late in the
    # backward, once the later blocks' activations are gone); with all of them, one block's are live again
    steps = [acts[k] - acts[k + 1] for k in range(n - 1)]
    assert all(s > 0 for s in steps) and max(steps) - min(steps) < 1e-6 * acts[0]
    assert acts[n] < acts[0] / 2
    times = [r.step_s for r in rows]
    assert all(a < b for a, b in zip(times, times[1:]))  # every recomputed block costs one more forward
    assert max(rows[k].time["mp"] - rows[k - 1].time["mp"] for k in range(1, n + 1)) > 0  # and its MP collectives


def test_fewest_recomputed_under_a_fake_memory_limit() -> None:
    spec = LayoutSpec(1, 1, 2)
    peaks = [_row(spec, k).peak_mem_gib * 2**30 for k in range(9)]
    assert all(a > b for a, b in zip(peaks[:8], peaks[1:8]))  # (the 8th recomputed block saves nothing more)
    for k in (1, 3, 7):
        chosen, row = fewest_recomputed(PROF, spec, 8, (peaks[k] + peaks[k - 1]) / 2, "32-true")
        assert (chosen, row.fits, row.recompute_blocks) == (k, True, k)
    assert fewest_recomputed(PROF, spec, 8, peaks[0] * 1.01, "32-true")[0] == 0
    chosen, row = fewest_recomputed(PROF, spec, 8, min(peaks) * 0.5, "32-true")
    assert (chosen, row.fits) == (8, False)  # nothing fits: every block, the least memory, and it says so


def test_auto_chooses_the_fewest_blocks_per_stage_and_says_so() -> None:
    topology = Topology(dp=1, pp=2, mp=2, microbatches=4)
    spec = layout_spec(topology, False)
    peaks = [_row(spec, k).peak_mem_gib * 2**30 for k in range(5)]
    k, line = recompute_count(PROF, topology, False, 8, "32-true", (peaks[2] + peaks[1]) / 2)
    assert k == 2 and line.startswith('activation checkpointing "auto": 2 of 4 blocks per stage recomputed') and (
        "fits the" in line)
    k, line = recompute_count(PROF, topology, False, 8, "32-true", min(peaks) / 2)
    assert k == 4 and "does NOT fit even so" in line
    assert "no device memory limit" in NO_LIMIT


@pytest.mark.parametrize("value", ["all", "Blocks", True, 1])
def test_a_bad_setting_is_refused_at_construction(value) -> None:
    with pytest.raises(ValueError, match=r'`activation_checkpointing` must be None, "blocks" or "auto", got'):
        DPMPStrategy(dp=2, mp=2, activation_checkpointing=value)


def test_settings_refused_in_combination() -> None:
    with pytest.raises(ValueError, match="with compile=True is not supported yet"):
        DPMPStrategy(dp=2, mp=2, activation_checkpointing="blocks", compile=True)
    with pytest.raises(ValueError, match='"auto" profiles a training_step, which Fabric has none of'):
        FabricDPMPStrategy(dp=2, mp=2, activation_checkpointing="auto")
    for value in (None, "blocks", "auto"):
        assert DPMPStrategy(dp=2, mp=2, activation_checkpointing=value)._config.activation_checkpointing == value
    FabricDPMPStrategy(dp=2, mp=2, activation_checkpointing="blocks")


class _SplitRegion(nn.Module):
    """A block whose middle draws dropout from the MP-rank stream, as a column -> row region does."""

    def __init__(self, tracker: RNGTracker) -> None:
        super().__init__()
        self.up, self.down, self.tracker = nn.Linear(6, 12), nn.Linear(12, 6), tracker

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(torch.tanh(x), 0.3)  # the replicated stream
        self.tracker.enter()
        h = F.dropout(torch.relu(self.up(h)), 0.5)  # the sharded stream
        self.tracker.exit()
        return x + self.down(h)


def _grads(replay: bool, wrap: bool = True) -> tuple[list[torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    tracker = RNGTracker(seed=7, mp_rank=1, device=torch.device("cpu"))
    net = nn.Sequential(_SplitRegion(tracker), _SplitRegion(tracker))
    if wrap:
        assert checkpoint_blocks(find_units(net), tracker if replay else None) == ["0", "1"]
    x = torch.randn(4, 6, requires_grad=True)
    net(x).pow(2).sum().backward()
    after = torch.rand(3)  # the replicated stream after the step: the recompute restores it
    return [p.grad for p in net.parameters()] + [x.grad], torch.cat([after, tracker.snapshot()[:8].double()])


def test_the_recompute_draws_the_masks_of_the_forward() -> None:
    kept, state = _grads(replay=False, wrap=False)
    ours, ours_state = _grads(replay=True)
    assert all(torch.equal(a, b) for a, b in zip(kept, ours)) and torch.equal(state, ours_state)
    lost, _ = _grads(replay=False)  # without the tracker's replay the split region's masks differ
    assert not all(torch.equal(a, b) for a, b in zip(kept, lost))


class _Scaled(nn.Module):
    """A block reading its own parameter outside any layer call, after one (the forward hooks' depth back at 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.scale, self.runs = nn.Linear(3, 3), nn.Parameter(torch.linspace(0.5, 1.5, 3)), 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.runs += 1
        return self.fc(x) * self.scale


@pytest.mark.parametrize("backward", ["Tensor.backward", "autograd.grad"])
def test_the_recompute_runs_outside_the_modes_of_user_code(backward: str) -> None:
    """A reader of user code refusing every read of the net's parameters (as a pipeline's does inside its schedule)
    is stepped aside by the forward hooks, which the recompute does not pass; it runs outside the reader all the same,
    since the way into the backward is a torch function the reader intercepts and runs with the mode stack popped."""
    torch.manual_seed(0)
    plain = nn.Sequential(_Scaled(), _Scaled())
    net = nn.Sequential(_Scaled(), _Scaled())
    net.load_state_dict(plain.state_dict())
    reader = GatherOnRead({id(p) for p in net.parameters()}, lambda t: True, lambda ps: nullcontext(),
                          lambda ps: "refused here")
    outermost_forward_hooks(net, reader.step_aside, reader.step_back)
    checkpoint_blocks(find_units(net))
    x = torch.randn(4, 3)
    with reader:
        with pytest.raises(RuntimeError, match="refused here"):
            net[0].scale * 2  # user code's own read
        xs = x.clone().requires_grad_()
        loss = net(xs).pow(2).sum()
        if backward == "Tensor.backward":
            loss.backward()
            grads = [p.grad for p in net.parameters()]
        else:
            grads = list(torch.autograd.grad(loss, [xs]))
    assert [b.runs for b in net] == [2, 2]  # each block recomputed once
    ref_x = x.clone().requires_grad_()
    plain(ref_x).pow(2).sum().backward()
    ref = [p.grad for p in plain.parameters()] if backward == "Tensor.backward" else [ref_x.grad]
    assert all(torch.equal(a, b) for a, b in zip(grads, ref)) and len(grads) == len(ref)


def test_wrapping_is_undone_and_evaluation_runs_the_plain_forward() -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    own = net[2].forward
    net[2].forward = own  # an instance forward already there (a compiled block's, a pipeline's stand-in)
    checkpoint_blocks(find_units(net))
    assert checkpointed_blocks(net) == ["0", "2"]
    with pytest.raises(ValueError, match="checkpointed already"):
        checkpoint_blocks([("0", net[0])])
    with torch.no_grad():
        assert torch.equal(net(torch.ones(1, 2)), net[2](net[1](net[0].__class__.forward(net[0], torch.ones(1, 2)))))
    uncheckpoint_blocks(net)
    assert checkpointed_blocks(net) == [] and "forward" not in vars(net[0]) and vars(net[2])["forward"] == own


def test_first_blocks_of_each_stage() -> None:
    blocks = [(str(i), nn.Linear(1, 1)) for i in range(6)]
    assert [n for n, _ in first_blocks(blocks, 2, [(0, 2), (2, 4), (4, 6)])] == ["0", "1", "2", "3", "4", "5"]
    assert [n for n, _ in first_blocks(blocks, 0)] == []
    with pytest.raises(ValueError, match="counted from 0"):
        first_blocks(blocks, -1)
