"""Experts found by what they compute: stacked 3-D expert weights in column -> row pairs, summed into the output.

Planning (no processes): the layouts found for transformers' and our own experts code, in every implementation
transformers 5 ships (per-expert loop, batched ``bmm``), with the weights stored either way round; the reasons
printed for experts that must stay whole. Numerics (no processes either): each rank's forward with its shards,
summed, is the dense output, and the summed gradients are the dense ones, so the two all-reduces are all it takes.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_dpmp.parallel.sharding import shard_tensor
from lightning_dpmp.planner.experts_detect import analyse_experts
from lightning_dpmp.planner.plan import make_plan
from lightning_dpmp.planner.trace import trace_step
from tests.support.real_models import _Experts, _MoE


def _plan(model: nn.Module, x: torch.Tensor, mp: int = 2):
    trace = trace_step(model, lambda: model(x).sum())
    return make_plan(model, mp, trace), trace


def _x(n: int = 6, width: int = 32) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(2, n, width)


def test_own_moe_is_planned_as_experts_with_replicated_router():
    torch.manual_seed(0)
    moe = _MoE(32)
    plan, _ = _plan(moe, _x())
    assert plan.layers["experts"].style == "experts" and plan.layers["experts"].kind == "experts"
    lay = plan.experts["experts"]
    assert lay.shards == {"gate_up": (1, 2), "down": (2, 1)}  # (E, 2I, H) block by block; (E, H, I) along I
    assert lay.entries == (0, 2) and lay.activations == (0,)  # activation and routing weights; not the index
    assert lay.needs_grad and (lay.hidden, lay.intermediate) == (32, 64)
    assert plan.layers["router"].style == "replicate" and plan.layers["router"].note.startswith("router of experts")
    assert plan.comm_per_step() == {
        "forward": {"all_reduce": 1, "all_gather": 0}, "backward": {"all_reduce": 1, "all_gather": 0}
    }
    local, total = plan.param_counts(moe)
    assert total - local == sum(p.numel() for p in moe.experts.parameters()) // 2


@pytest.mark.parametrize("impl", ["eager", "batched_mm"])
def test_transformers_mixtral_experts(impl):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=16,
    )
    cfg._experts_implementation = impl
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg)
    ids = torch.randint(0, 64, (2, 16))
    trace = trace_step(model, lambda: model(input_ids=ids).logits.sum())
    for mp in (2, 4):
        plan = make_plan(model, mp, trace)
        lay = plan.experts["model.layers.0.mlp.experts"]
        assert lay.shards == {"gate_up_proj": (1, 2), "down_proj": (2, 1)}, impl
        assert lay.activations == (0,) and 2 in lay.entries


class TransposedExperts(nn.Module):
    """Weights stored (E, H, 2I) / (E, I, H) and used as ``x @ W[e]``; routing applied after the down matmul."""

    def __init__(self, e: int = 4, h: int = 8, i: int = 12) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(e, h, 2 * i) / h**0.5)
        self.w2 = nn.Parameter(torch.randn(e, i, h) / i**0.5)

    def forward(self, x, weights):  # x (N, H), weights (N, E): dense routing
        out = torch.zeros_like(x)
        for e in range(self.w1.shape[0]):
            a, b = (x @ self.w1[e]).chunk(2, dim=-1)
            out = out + (F.gelu(a) * b) @ self.w2[e] * weights[:, e:e + 1]
        return out


class Wrap(nn.Module):
    def __init__(self, experts: nn.Module, e: int = 4, h: int = 8) -> None:
        super().__init__()
        self.router, self.experts = nn.Linear(h, e), experts

    def forward(self, x):
        return self.experts(x, F.softmax(self.router(x), dim=-1))


def test_transposed_layout_and_dense_routing():
    torch.manual_seed(0)
    model = Wrap(TransposedExperts())
    plan, _ = _plan(model, torch.randn(10, 8))
    assert plan.experts["experts"].shards == {"w1": (2, 2), "w2": (1, 1)}
    assert plan.layers["router"].style == "replicate"


def test_indivisible_intermediate_stays_whole_with_the_numbers():
    torch.manual_seed(0)
    model = Wrap(TransposedExperts(i=6))
    plan, _ = _plan(model, torch.randn(10, 8), mp=4)
    lp = plan.layers["experts"]
    assert lp.style == "replicate" and "w1 has 12 along dim 2 in 2 fused blocks, not divisible by mp=4" in lp.note
    assert plan.layers["router"].style == "column_gather"  # not a router of split experts: the default applies


class RouterInside(nn.Module):
    """The router's weight lives in the experts module: its gradient would be a partial sum, so it stays whole."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.randn(4, 8))
        self.w1 = nn.Parameter(torch.randn(4, 16, 8))
        self.w2 = nn.Parameter(torch.randn(4, 8, 16))

    def forward(self, x):
        probs = F.softmax(F.linear(x, self.gate), dim=-1)
        out = torch.zeros_like(x)
        for e in range(4):
            out = out + F.linear(F.relu(F.linear(x, self.w1[e])), self.w2[e]) * probs[:, e:e + 1]
        return out


class NonlinearAfterSum(TransposedExperts):
    def forward(self, x, weights):
        return torch.tanh(super().forward(x, weights))


class NonZeroBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(4, 16, 8))
        self.w2 = nn.Parameter(torch.randn(4, 8, 16))

    def forward(self, x, weights):
        out = x.clone()  # accumulating into the input: the residual would be counted mp times
        idx = torch.arange(x.shape[0])
        for e in range(4):
            out.index_add_(0, idx, F.linear(F.relu(F.linear(x, self.w1[e])), self.w2[e]) * weights[:, e:e + 1])
        return out


class ResidualInside(NonZeroBuffer):
    def forward(self, x, weights):
        out = torch.zeros_like(x)
        idx = torch.arange(x.shape[0])
        for e in range(4):
            out.index_add_(0, idx, F.linear(F.relu(F.linear(x, self.w1[e])), self.w2[e]) * weights[:, e:e + 1])
        return out.index_add_(0, idx, x)  # a replicated residual summed into the partial output


class Interleaved(nn.Module):
    """gate/up interleaved (gpt-oss style ``[..., ::2]``): not followed, so left whole."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(4, 32, 8))
        self.w2 = nn.Parameter(torch.randn(4, 8, 16))

    def forward(self, x, weights):
        out = torch.zeros_like(x)
        for e in range(4):
            h = F.linear(x, self.w1[e])
            out = out + F.linear(F.silu(h[..., ::2]) * h[..., 1::2], self.w2[e]) * weights[:, e:e + 1]
        return out


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda: nn.ModuleDict({"moe": RouterInside()}), "the replicated moe.gate feeds the split region"),
        (lambda: Wrap(NonlinearAfterSum()), "a partial sum is read by 'tanh'"),
        (lambda: Wrap(NonZeroBuffer(), h=8), "accumulates partial sums into a tensor not known to be zero"),
        (lambda: Wrap(ResidualInside(), h=8), "'index_add_' accumulates a replicated tensor (it would count 2 times)"),
        (lambda: Wrap(Interleaved()), "indexing touches the split dim"),
    ],
    ids=["router_inside", "nonlinear_after_sum", "non_zero_buffer", "residual_inside", "interleaved"],
)
def test_experts_left_whole_say_why(make, reason):
    torch.manual_seed(0)
    model = make()
    if isinstance(model, nn.ModuleDict):
        model.forward = lambda x: model["moe"](x)
    plan, _ = _plan(model, torch.randn(10, 8))
    whole = {n: lp for n, lp in plan.layers.items() if lp.kind == "experts"}
    assert len(whole) == 1 and not plan.experts
    (lp,) = whole.values()
    assert lp.style == "replicate" and reason in lp.note, lp.note
    assert plan.comm_per_step()["forward"]["all_reduce"] == 0


def test_convolutions_are_not_experts():
    model = nn.Sequential(nn.Conv1d(3, 4, 3), nn.Flatten(), nn.Linear(8, 2))
    trace = trace_step(model, lambda: model(torch.randn(2, 3, 4)).sum())
    assert analyse_experts(model, trace, 2) == ({}, {})


@pytest.mark.parametrize("mp", [2, 4])
def test_summed_shards_are_the_dense_experts(mp):
    """Each rank runs the unchanged module code on its shards: the partial outputs sum to the dense output, the
    partial input and routing-weight gradients sum to the dense ones, and each shard's gradient is the dense
    gradient's shard. That is exactly what the output all-reduce and the one fused backward all-reduce restore."""
    torch.manual_seed(0)
    dense = _Experts(4, 32, 64).double()
    x = torch.randn(20, 32, dtype=torch.float64, requires_grad=True)
    index = torch.topk(torch.randn(20, 4), 2, dim=-1).indices
    w = torch.rand(20, 2, dtype=torch.float64, requires_grad=True)
    g = torch.randn(20, 32, dtype=torch.float64)
    (dense(x, index, w) * g).sum().backward()
    ref = {"out": dense(x, index, w).detach(), "x": x.grad.clone(), "w": w.grad.clone()}
    dense_grads = {n: p.grad.clone() for n, p in dense.named_parameters()}
    shards = {"gate_up": (1, 2), "down": (2, 1)}
    total = {k: torch.zeros_like(v) for k, v in ref.items()}
    for rank in range(mp):
        local = copy.deepcopy(dense)
        for n, (dim, blocks) in shards.items():
            setattr(local, n, nn.Parameter(shard_tensor(getattr(dense, n).detach(), dim, mp, rank, blocks).clone()))
        xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        out = local(xr, index, wr)
        (out * g).sum().backward()
        for k, v in (("out", out.detach()), ("x", xr.grad), ("w", wr.grad)):
            total[k] += v
        for n, (dim, blocks) in shards.items():
            want = shard_tensor(dense_grads[n], dim, mp, rank, blocks)
            torch.testing.assert_close(getattr(local, n).grad, want, rtol=1e-12, atol=1e-12)
    for k in ref:
        torch.testing.assert_close(total[k], ref[k], rtol=1e-12, atol=1e-12)


def test_user_plan_keeps_experts_whole_or_insists():
    torch.manual_seed(0)
    moe = _MoE(32)
    trace = trace_step(moe, lambda: moe(_x()).sum())
    plan = make_plan(moe, 2, trace, user_plan={"exp*": "replicate"})
    assert plan.layers["experts"].style == "replicate" and plan.layers["experts"].note == "user plan"
    assert not plan.experts and plan.layers["router"].style == "column_gather"
    assert make_plan(moe, 2, trace, user_plan={"experts": "experts"}).layers["experts"].style == "experts"
    with pytest.raises(ValueError, match="matches no module holding stacked"):
        make_plan(moe, 2, trace, user_plan={"router": "experts"})
    model = Wrap(TransposedExperts(i=6))
    trace = trace_step(model, lambda: model(torch.randn(10, 8)).sum())
    expected = "plan forces 'experts' to 'experts', but it cannot be split: experts.w1 has 12 along dim 2"
    with pytest.raises(ValueError, match=expected):
        make_plan(model, 4, trace, user_plan={"experts": "experts"})
