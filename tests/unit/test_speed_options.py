"""compile= and async_grad_allreduce= without processes: argument checks, which blocks get compiled (names
unchanged), when the dropout RNG switch is skipped, and the fused async linear's gradients with mp=1 semantics."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dpmp import DPMPStrategy
from lightning_dpmp.parallel.compiled import (
    compile_blocks,
    exact_backend,
    narrowing_modules,
    repeated_blocks,
    uncompile_blocks,
)
from lightning_dpmp.parallel.rng import RNGTracker, has_dropout


@pytest.mark.parametrize("kwargs", [{"compile": "yes"}, {"compile": None}, {"async_grad_allreduce": 1},
                                    {"async_grad_allreduce": "auto"}])
def test_flags_are_refused_unless_bool(kwargs):
    with pytest.raises(TypeError, match=next(iter(kwargs))):
        DPMPStrategy(dp=1, mp=2, **kwargs)


def test_flags_accepted():
    DPMPStrategy(dp=1, mp=2, compile=True, async_grad_allreduce=False)
    DPMPStrategy(dp=1, mp=2, async_grad_allreduce=None)


class _Attn(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.attention_dropout = p  # a rate given to functional dropout, as transformers' attention modules do
        self.proj = nn.Linear(4, 4)


@pytest.mark.parametrize("module,expected", [
    (nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.0)), False),
    (nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1)), True),
    (_Attn(0.0), False),
    (_Attn(0.1), True),
    (nn.MultiheadAttention(8, 2, dropout=0.0), False),
    (nn.MultiheadAttention(8, 2, dropout=0.2), True),
])
def test_has_dropout(module, expected):
    assert has_dropout(module) is expected


def test_rng_switch_skipped_without_dropout_or_in_eval():
    inactive = RNGTracker(seed=0, mp_rank=1, device=torch.device("cpu"), active=False)
    inactive.enter_for(True)
    assert not inactive.inside
    active = RNGTracker(seed=0, mp_rank=1, device=torch.device("cpu"))
    active.enter_for(False)
    assert not active.inside
    active.enter_for(True)
    assert active.inside
    active.exit()


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.ModuleList([nn.Linear(8, 8)])),
                                     nn.Sequential(nn.Linear(8, 8), nn.ModuleList([nn.Linear(8, 8)])),
                                     nn.Identity()])


def test_repeated_blocks_are_the_outermost_lists_children_with_parameters():
    net = _Net()
    assert [n for n, _ in repeated_blocks(net)] == ["blocks.0", "blocks.1"]  # not Identity, not the nested lists
    assert repeated_blocks(nn.Sequential(nn.Linear(2, 2))) == []


def test_compile_blocks_in_place_keeps_names_and_uncompile_undoes_it():
    net = _Net()
    keys = list(net.state_dict())
    assert compile_blocks(net) == ["blocks.0", "blocks.1"]
    # forward compiled, __call__ (and so the module's hooks) eager
    assert "forward" in net.blocks[0].__dict__ and "forward" not in net.emb.__dict__
    assert net.blocks[0]._compiled_call_impl is None
    assert list(net.state_dict()) == keys  # checkpoints see the same names
    uncompile_blocks(net)
    assert all("forward" not in m.__dict__ for m in net.modules())
    whole = nn.Sequential(nn.Linear(2, 2))
    assert compile_blocks(whole) == [""] and "forward" in whole.__dict__


class _Float32Norm(nn.Module):
    """transformers' LlamaRMSNorm pattern: computes in float32 whatever the input dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_narrowing_modules_names_float32_islands_of_float64_graphs_only(dtype):
    block = nn.Sequential(nn.Linear(8, 8), _Float32Norm()).to(dtype)  # compiled like a block: its forward
    seen: list[list[str]] = []

    def backend(gm, example_inputs):
        seen.append(narrowing_modules(gm))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(block.forward, backend=backend)(torch.randn(2, 8, dtype=dtype))
    assert seen == [["_Float32Norm"] if dtype == torch.float64 else []]


def test_exact_backend_keeps_eager_numbers_of_a_float32_island_and_warns():
    """Inductor's fused float32 kernel rounds differently from eager's: the float64 graph takes aot_eager."""
    norm = _Float32Norm().double()
    x = torch.randn(4, 64, 8, dtype=torch.float64, requires_grad=True)
    eager = norm(x)
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match="'aot_eager' backend instead"):
        compiled = torch.compile(norm.forward, backend=exact_backend)(x)
    assert torch.equal(compiled, eager)
    (g_c,), (g_e,) = torch.autograd.grad(compiled.sum(), x), torch.autograd.grad(eager.sum(), x)
    assert torch.equal(g_c, g_e)
