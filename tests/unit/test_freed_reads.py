"""GatherOnRead (lightning_dpmp/parallel/freed_reads.py) in one process: a freed parameter read by an op is made
current for that op only, nothing returned points at freed storage, metadata reads gather nothing, writes and a
backward through such a read are refused, and the outermost-forward hooks step aside once per outermost call."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import nn

from lightning_dpmp.parallel.freed_reads import GatherOnRead, outermost_forward_hooks


class _Freed:
    """A parameter viewing a flat buffer whose storage is freed, as ZeRO-3 leaves it; ``current`` refills it."""

    def __init__(self) -> None:
        self.full = torch.zeros(6, dtype=torch.float64)
        self.param = nn.Parameter(self.full[:4].view(2, 2))
        self.gathers = 0
        self.free()

    def free(self) -> None:
        self.full.untyped_storage().resize_(0)

    @contextmanager
    def current(self, params: list) -> Iterator[None]:
        assert params == [self.param]
        self.gathers += 1
        self.full.untyped_storage().resize_(6 * 8)
        with torch.no_grad():
            self.full.copy_(torch.arange(6.0, dtype=torch.float64))
        yield
        self.free()

    def mode(self) -> GatherOnRead:
        return GatherOnRead({id(self.param)}, lambda t: t.untyped_storage().nbytes() == 0, self.current)


def test_a_read_gets_the_values_and_keeps_no_view_of_freed_storage() -> None:
    f = _Freed()
    with f.mode():
        kept = f.param.detach()  # a view, were it not copied
        norm = f.param.pow(2).sum()
        shape, n = f.param.shape, f.param.numel()  # metadata: no gather
        f.param.untyped_storage()
    assert f.gathers == 2 and shape == (2, 2) and n == 4
    assert kept.tolist() == [[0.0, 1.0], [2.0, 3.0]] and norm.item() == 14.0
    assert f.param.untyped_storage().nbytes() == 0  # freed again


def test_a_write_and_a_backward_through_a_freed_read_are_refused() -> None:
    f = _Freed()
    with f.mode():
        with pytest.raises(RuntimeError, match="'mul_' writes into a parameter whose storage is freed"):
            f.param.mul_(2)
        l2 = f.param.pow(2).sum()  # with gradients enabled: a copy that refuses its backward
    assert l2.requires_grad
    with pytest.raises(RuntimeError, match="Use the optimizer's weight_decay"):
        l2.backward()


def test_outermost_forward_hooks_fire_once_per_outermost_call_and_after_an_error() -> None:
    calls: list[str] = []
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
    handles = outermost_forward_hooks(model, lambda: calls.append("enter"), lambda: calls.append("exit"))
    model(torch.ones(1, 2))
    model[1](torch.ones(1, 2))  # a submodule called on its own is outermost too
    with pytest.raises(RuntimeError):
        model(torch.ones(1, 3))
    assert calls == ["enter", "exit"] * 3
    for h in handles:
        h.remove()
    model(torch.ones(1, 2))
    assert len(calls) == 6


def test_values_given_by_make_current_are_read_and_a_refusal_is_raised_before_any_collective() -> None:
    """A pipeline's reader: the values come from elsewhere (the owning stage's broadcast), the parameter keeps no
    storage; inside the schedule the read is refused before make_current runs (no collective)."""
    param = nn.Parameter(torch.empty(2, 2, dtype=torch.float64))
    param.untyped_storage().resize_(0)  # another stage's: freed here
    fetched: list[int] = []
    refusal: list[str] = []

    @contextmanager
    def values_of(params: list) -> Iterator[list]:
        fetched.append(len(params))
        yield [torch.full((2, 2), 3.0, dtype=torch.float64) for _ in params]

    mode = GatherOnRead({id(param)}, lambda t: True, values_of, lambda ps: refusal[0] if refusal else None)
    with mode:
        total = (param * param).sum()  # one parameter read twice by one op: fetched once
        refusal.append("that another pipeline stage owns, inside the pipelined step")
        with pytest.raises(RuntimeError, match="'sum' reads a parameter that another pipeline stage owns"):
            param.sum()
    assert total.item() == 36.0 and fetched == [1]
    assert param.untyped_storage().nbytes() == 0
