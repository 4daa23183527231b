"""Linear-like layers (found by what they compute) and nn.MultiheadAttention in the planner, without processes.

Detection must follow the traced op, not class or parameter names; the parallel layers must keep the dense
module's class, parameter names and storage layout (checked here at mp=1, where they hold the whole weight; the
split itself is checked against dense on 4 processes in tests/distributed/test_linear_like.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_dpmp.parallel.attention_layer import HeadParallelMultiheadAttention
from lightning_dpmp.parallel.layers import ColumnParallelLinear, RowParallelLinear
from lightning_dpmp.planner.plan import make_plan
from lightning_dpmp.planner.trace import LinearCall, trace_step

transformers = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402


class MatmulLinear(nn.Module):
    """A user's own Linear: ``x @ W + b`` with W stored (in, out), parameters under other names."""

    def __init__(self, d_in: int, d_out: int, names: tuple[str, str] = ("weight", "bias")) -> None:
        super().__init__()
        self.names = names
        setattr(self, names[0], nn.Parameter(torch.randn(d_in, d_out)))
        setattr(self, names[1], nn.Parameter(torch.randn(d_out)))

    def forward(self, x):
        return x @ getattr(self, self.names[0]) + getattr(self, self.names[1])


class NotLinear(nn.Module):
    """Shaped like a Linear, but computes something else (each variant breaks one condition)."""

    def __init__(self, d: int, how: str) -> None:
        super().__init__()
        self.how = how
        self.weight = nn.Parameter(torch.randn(d, d))
        self.bias = nn.Parameter(torch.randn(d))

    def forward(self, x):
        if self.how == "scaled":
            return torch.addmm(self.bias, x.view(-1, x.shape[-1]), self.weight).view(x.shape) * 2
        if self.how == "transposed_scaled":
            return x @ (self.weight.t() * 2) + self.bias
        if self.how == "twice":
            return (x @ self.weight) @ self.weight + self.bias
        if self.how == "alpha":
            return torch.addmm(self.bias, x.view(-1, x.shape[-1]), self.weight, alpha=2).view(x.shape)
        raise ValueError(self.how)


class Mlp(nn.Module):
    def __init__(self, fc1: nn.Module, fc2: nn.Module) -> None:
        super().__init__()
        self.fc1, self.fc2 = fc1, fc2

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def _plan(model: nn.Module, x: torch.Tensor, mp: int = 2, user_plan=None):
    trace = trace_step(model, lambda: model(x).sum())
    return trace, make_plan(model, mp, trace, user_plan)


@pytest.mark.parametrize("kind", ["conv1d", "matmul"])
def test_transposed_weight_layers_are_detected_with_their_orientation_and_paired(kind):
    make = (lambda i, o: Conv1D(o, i)) if kind == "conv1d" else MatmulLinear
    model = Mlp(make(8, 16), make(16, 8))
    trace, plan = _plan(model, torch.randn(2, 3, 8))
    assert [e.name for e in trace.events if isinstance(e, LinearCall)] == ["fc1", "fc2"]
    assert {n: (f.in_features, f.out_features, f.out_dim) for n, f in trace.linear_forms.items()} == {
        "fc1": (8, 16, 1), "fc2": (16, 8, 1)}
    assert {n: lp.style for n, lp in plan.layers.items()} == {"fc1": "column", "fc2": "row"}
    # shapes are printed in the stored (in, out) layout: fc1's columns are split, fc2's rows
    assert plan.layers["fc1"].full_shape() == (8, 16) and plan.layers["fc1"].local_shape(2) == (8, 8)
    assert plan.layers["fc2"].local_shape(2) == (8, 8) and plan.layers["fc2"].full_shape() == (16, 8)
    assert plan.param_counts(model) == (8 * 8 + 8 + 8 * 8 + 8, sum(p.numel() for p in model.parameters()))


def test_f_linear_layout_of_a_custom_module_is_out_in():
    class MyLinear(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight, self.bias = nn.Parameter(torch.randn(16, 8)), nn.Parameter(torch.randn(16))

        def forward(self, x):
            return F.linear(x, self.weight, self.bias)

    trace, plan = _plan(Mlp(MyLinear(), nn.Linear(16, 8)), torch.randn(4, 8))
    assert trace.linear_forms["fc1"].out_dim == 0
    assert plan.layers["fc1"].style == "column" and plan.layers["fc1"].local_shape(2) == (8, 8)


class TransposedLinear(nn.Module):
    """``x @ W.T + b`` (transformers' ``FalconLinear``) or ``addmm(b, x, W.t())``: W stored (out, in)."""

    def __init__(self, d_in: int, d_out: int, how: str) -> None:
        super().__init__()
        self.how = how
        self.weight, self.bias = nn.Parameter(torch.randn(d_out, d_in)), nn.Parameter(torch.randn(d_out))

    def forward(self, x):
        if self.how == "addmm":
            return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight.t()).view(*x.shape[:-1], -1)
        return x @ self.weight.transpose(0, 1) + self.bias


@pytest.mark.parametrize("how", ["falcon", "matmul_transpose", "addmm"])
def test_a_matmul_with_the_transposed_weight_is_linear_like_out_in(how):
    from transformers.models.falcon.modeling_falcon import FalconLinear

    make = (lambda i, o: FalconLinear(i, o)) if how == "falcon" else (lambda i, o: TransposedLinear(i, o, how))
    trace, plan = _plan(Mlp(make(8, 16), make(16, 8)), torch.randn(2, 3, 8))
    assert {n: (f.in_features, f.out_features, f.out_dim) for n, f in trace.linear_forms.items()} == {
        "fc1": (8, 16, 0), "fc2": (16, 8, 0)}
    assert {n: lp.style for n, lp in plan.layers.items()} == {"fc1": "column", "fc2": "row"}


@pytest.mark.parametrize("how", ["scaled", "transposed_scaled", "twice", "alpha"])
def test_modules_computing_something_else_are_not_linear_like(how):
    model = Mlp(nn.Linear(8, 8), NotLinear(8, how))
    trace, plan = _plan(model, torch.randn(4, 8))
    assert "fc2" not in trace.linear_forms and "fc2" not in plan.layers
    assert not any(isinstance(e, LinearCall) and e.name == "fc2" for e in trace.events)
    assert plan.layers["fc1"].style == "column_gather"  # its output reaches ops that are not a row layer
    assert "left whole: fc2 (NotLinear: weight (8, 8)): its traced forward is not one matmul" in plan.describe(model)


def test_linear_like_with_other_parameter_names_stays_whole_and_says_why():
    model = Mlp(MatmulLinear(8, 16, ("w", "b")), nn.Linear(16, 8))
    trace, plan = _plan(model, torch.randn(4, 8))
    assert trace.linear_forms["fc1"].weight == "w"
    assert plan.layers["fc1"].style == "replicate" and "named 'w'/'b'" in plan.layers["fc1"].note
    assert plan.layers["fc2"].style == "column_gather"  # no column partner: split on its own


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_gpt2_block_conv1d_layers_pair_head_parallel_and_adjust_split_size(attn):
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    cfg = GPT2Config(n_embd=32, n_head=4, n_positions=16, resid_pdrop=0.0, attn_pdrop=0.0, embd_pdrop=0.0,
                     attn_implementation=attn)
    block = GPT2Block(cfg, layer_idx=0)
    x = torch.randn(2, 16, 32, requires_grad=True)
    trace = trace_step(block, lambda: block(x)[0].sum())
    for mp in (2, 4):
        plan = make_plan(block, mp, trace)
        styles = {n: lp.style for n, lp in plan.layers.items()}
        assert styles == {"attn.c_attn": "column", "attn.c_proj": "row", "mlp.c_fc": "column", "mlp.c_proj": "row"}
        assert plan.layers["attn.c_attn"].blocks == 3 and plan.layers["attn.c_attn"].out_dim == 1
        assert plan.adjust["attn"]["split_size"] == (32, 32 // mp)
        assert plan.comm_per_step() == {"forward": {"all_reduce": 2, "all_gather": 0},
                                        "backward": {"all_reduce": 2, "all_gather": 0}}


def test_conv1d_parallel_layers_keep_layout_names_and_class_at_mp1():
    torch.manual_seed(0)
    conv = Conv1D(12, 8).double()
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    for cls in (ColumnParallelLinear, RowParallelLinear):
        layer = cls.from_dense(conv, None, out_dim=1)
        assert layer.weight.shape == conv.weight.shape == (8, 12)
        assert [n for n, _ in layer.named_parameters()] == ["weight", "bias"]
        torch.testing.assert_close(layer(x), conv(x), rtol=0, atol=1e-14)
        dense = layer.to_dense()
        assert type(dense) is Conv1D and (dense.nf, dense.nx) == (12, 8)
        assert dense.weight.equal(conv.weight) and dense.bias.equal(conv.bias)
        Conv1D(12, 8).double().load_state_dict(dense.state_dict(), strict=True)


def test_frozen_parameters_stay_frozen_in_parallel_layers():
    conv = Conv1D(12, 8)
    conv.weight.requires_grad_(False)
    layer = ColumnParallelLinear.from_dense(conv, None, out_dim=1)
    assert not layer.weight.requires_grad and layer.bias.requires_grad
    assert not layer.to_dense().weight.requires_grad


class Encoder(nn.Module):
    def __init__(self, norm_first: bool) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, norm_first=norm_first)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x):
        return self.enc(x)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("mp", [2, 4])
def test_transformer_encoder_attention_is_head_parallel_and_mlp_paired(norm_first, mp):
    model = Encoder(norm_first)
    x = torch.randn(2, 5, 32, requires_grad=True)
    _, plan = _plan(model, x, mp)
    for i in range(2):
        p = f"enc.layers.{i}."
        assert plan.layers[p + "self_attn"].style == "heads" and plan.layers[p + "self_attn"].blocks == 3
        assert plan.layers[p + "self_attn.out_proj"].style == "row"
        assert plan.layers[p + "linear1"].style == "column" and plan.layers[p + "linear2"].style == "row"
        assert plan.layers[p + "self_attn"].local_shape(mp) == (96 // mp, 32)
    assert list(plan.layers)[:2] == ["enc.layers.0.self_attn", "enc.layers.0.self_attn.out_proj"]
    # 1 + 1 per attention (entry copy, out_proj reduce), 1 + 1 per MLP
    assert plan.comm_per_step() == {
        "forward": {"all_reduce": 4, "all_gather": 0}, "backward": {"all_reduce": 4, "all_gather": 0}
    }
    local, total = plan.param_counts(model)
    split = sum(p.numel() for n, p in model.named_parameters()
                if "in_proj" in n or "out_proj.weight" in n or "linear1" in n or "linear2.weight" in n)
    assert total - local == split - split // mp
    assert f"{4 // mp} of 4 heads per rank" in plan.describe(model)


@pytest.mark.parametrize(
    "make,reason",
    [
        (lambda: nn.MultiheadAttention(30, 3, batch_first=True), "num_heads=3 not divisible by mp=2"),
        (lambda: nn.MultiheadAttention(32, 4, kdim=16, vdim=16, batch_first=True), "separate q/k/v projection weights"),
        (lambda: nn.MultiheadAttention(32, 4, add_bias_kv=True, batch_first=True), "add_bias_kv"),
    ],
)
def test_attention_that_cannot_be_head_parallel_stays_whole_with_the_reason(make, reason):
    mha = make()
    e = mha.embed_dim
    x = torch.randn(2, 5, e, requires_grad=True)
    kv = torch.randn(2, 5, mha.kdim) if mha.kdim != e else x

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = mha

        def forward(self, x):
            return self.attn(x, kv, kv, need_weights=False)[0]

    model = M()
    _, plan = _plan(model, x)
    assert plan.layers["attn"].style == "replicate" and reason in plan.layers["attn"].note
    assert plan.layers["attn.out_proj"].style == "replicate"
    assert "read inside attn, which stays whole" in plan.layers["attn.out_proj"].note
    assert reason in plan.describe(model)


def test_cross_attention_twice_called_and_need_weights():
    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    x, mem = torch.randn(2, 5, 16, requires_grad=True), torch.randn(2, 7, 16)

    def plan_for(step):
        trace = trace_step(mha, step)
        return make_plan(mha, 2, trace)

    assert "cross-attention" in plan_for(lambda: mha(x, mem, mem)[0].sum()).layers[""].note
    assert "called 2 times" in plan_for(lambda: (mha(x, x, x)[0] + mha(x, x, x)[0]).sum()).layers[""].note
    plan = plan_for(lambda: sum(t.sum() for t in mha(x, x, x)))  # need_weights=True (the default), both used
    assert plan.layers[""].style == "heads" and plan.layers[""].gather_weights
    assert plan.comm_per_step()["forward"] == {"all_reduce": 1, "all_gather": 1}


def test_user_plan_styles_attention_and_refuses_its_out_proj():
    model = Encoder(False)
    x = torch.randn(2, 5, 32, requires_grad=True)
    _, plan = _plan(model, x, user_plan={"enc.layers.0.self_attn": "replicate"})
    assert plan.layers["enc.layers.0.self_attn"].style == "replicate"
    assert plan.layers["enc.layers.0.self_attn"].note == "user plan"
    assert plan.layers["enc.layers.1.self_attn"].style == "heads"
    _, plan = _plan(model, x, user_plan={"enc.layers.*": "replicate"})  # the glob also matches out_proj: fine
    assert plan.layers["enc.layers.1.self_attn"].style == "replicate"
    with pytest.raises(ValueError, match="reads its weight without calling it"):
        _plan(model, x, user_plan={"enc.layers.0.self_attn.out_proj": "row"})
    with pytest.raises(ValueError, match="use 'heads' or 'replicate'"):
        _plan(model, x, user_plan={"enc.layers.0.self_attn": "column"})
    with pytest.raises(ValueError, match="for nn.MultiheadAttention only"):
        _plan(model, x, user_plan={"enc.layers.0.linear1": "heads"})


@pytest.mark.parametrize("batch_first", [True, False])
def test_head_parallel_attention_round_trip_at_mp1(batch_first):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=batch_first).double()
    layer = HeadParallelMultiheadAttention.from_dense(mha, None)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    mask = nn.Transformer.generate_square_subsequent_mask(5, dtype=torch.float64)
    for kwargs in ({"need_weights": False, "attn_mask": mask, "is_causal": True}, {"need_weights": True}):
        a, wa = mha(x, x, x, **kwargs)
        b, wb = layer(x, x, x, **kwargs)
        torch.testing.assert_close(b, a, rtol=0, atol=1e-14)
        assert (wa is None) == (wb is None)
    assert [n for n, _ in layer.named_parameters()] == [n for n, _ in mha.named_parameters()]
    dense = layer.to_dense()
    assert type(dense) is nn.MultiheadAttention and type(dense.out_proj) is type(mha.out_proj)
    assert dense.batch_first == batch_first and dense.num_heads == 4
    nn.MultiheadAttention(16, 4, batch_first=batch_first).double().load_state_dict(dense.state_dict(), strict=True)
    assert all(dense.state_dict()[k].equal(v) for k, v in mha.state_dict().items())
