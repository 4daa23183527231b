"""Planning a step that runs the model several times (generation: one forward per new token) from its first pass."""

from __future__ import annotations

import torch
from torch import nn

from lightning_dpmp.planner.trace import LinearCall, first_pass, trace_step


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class Looping(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = MLP()

    def forward(self, x, passes: int):
        for _ in range(passes):
            x = self.net(x)
        return x


def _linear_names(trace):
    return [e.name for e in trace.events if isinstance(e, LinearCall)]


def test_three_identical_passes_are_cut_to_the_first():
    model = Looping()
    trace = trace_step(model, lambda: model(torch.randn(2, 4), 3))
    assert _linear_names(trace) == ["net.up", "net.down"] * 3
    cut, name = first_pass(trace)
    assert name == "net" and _linear_names(cut) == ["net.up", "net.down"]
    assert all(c.end <= len(cut.events) for c in cut.calls)


def test_one_pass_or_different_passes_stay_whole():
    model = Looping()
    trace = trace_step(model, lambda: model(torch.randn(2, 4), 1))
    assert first_pass(trace) == (trace, "")
    uneven = trace_step(model, lambda: model.net.down(model.net(model.net(torch.randn(2, 4))).repeat(1, 2)))
    assert first_pass(uneven)[1] == ""  # down called 3 times, up twice: not passes of one module


def test_meta_step_reads_defaults_until_a_pass_then_stops():
    model = Looping().to("meta")

    def generate():
        x = torch.randn(2, 4, device="meta")
        if (x > 0).any():  # a check before the model runs: on meta, taken as False
            x = x + 1
        while True:  # a loop that only a value stops: stopped after the first whole pass
            x = model.net(x)
            if bool((x > 0).all()):
                break
        return x

    trace = trace_step(model, generate, keep_partial=True)
    assert trace.defaulted == ["__bool__"] and trace.error.startswith("PassComplete")
    cut, name = first_pass(trace)
    assert name == "net" and _linear_names(cut) == ["net.up", "net.down"]
