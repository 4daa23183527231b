"""What the trace says about steps that may leave parameters out, and which modules become ZeRO units (issue 22)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_dpmp.parallel.zero_engine import find_units
from lightning_dpmp.planner.trace import trace_step
from tests.support.models import LayerDropMLP, MoEMLP, ResMLP


def _trace(model: nn.Module, x: torch.Tensor, step=None):
    return trace_step(model, step or (lambda: model(x).sum()))


def test_routing_by_nonzero_is_data_dependent_inside_its_block():
    torch.manual_seed(0)
    model = MoEMLP()
    trace = _trace(model, torch.randn(4, 12))
    assert {m for _, m in trace.data_dependent} == {"blocks.0", "blocks.1"}
    assert {op for op, _ in trace.data_dependent} == {"nonzero"}


def test_a_branch_in_the_models_own_forward_is_data_dependent_at_the_root():
    model = LayerDropMLP(n_blocks=4).train()
    trace = _trace(model, torch.randn(4, 12))
    assert ("__bool__", "") in trace.data_dependent


def test_boolean_masks_are_data_dependent_and_item_outside_forward_is_not():
    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x[x[:, 0] > 0])

    model = Masked()
    x = torch.randn(6, 4)
    assert _trace(model, x).data_dependent == [("__getitem__", "")]
    plain = ResMLP()

    def step():
        loss = plain(torch.randn(4, 12)).sum()
        print(loss.item())  # logging in training_step, outside forward: no branch of the model
        return loss

    assert _trace(plain, None, step).data_dependent == []


def test_no_units_under_a_forward_that_branches_on_the_data():
    model = LayerDropMLP(n_blocks=4)
    assert [n for n, _ in find_units(model)] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert find_units(model, branches=("",)) == []  # the root's forward may skip any block
    moe = MoEMLP()
    # routing inside each block: the blocks stay units (the experts inside them are never units)
    assert [n for n, _ in find_units(moe, branches=("blocks.0", "blocks.1"))] == ["blocks.0", "blocks.1"]
