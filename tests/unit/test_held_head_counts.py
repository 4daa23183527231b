"""Head counts held outside the attention module (issue 42 item 7): litgpt's config object shared by every layer
(``self.config.n_head``, ``self.config.n_query_groups``) and einops ``Rearrange`` layers built with ``h=heads``.

The plan must find the holder from where the code passed the size (the module running the ``view``/``reshape``),
set it per rank on this module only (a copy of the config: the MLP and the model keep the dense one), and the
attention computed with this rank's slices and per-rank counts must be this rank's share of the dense attention:
the shares summed over the ranks give the dense output (float64, 1e-12), in one process.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_dpmp.parallel.sharding import shard_tensor
from lightning_dpmp.planner.plan import make_plan
from lightning_dpmp.planner.structure import read_path, set_per_rank, unset_per_rank
from lightning_dpmp.planner.trace import trace_step
from tests.support.real_models import (
    AttentionLM,
    CausalLM,
    EinopsConfigGQA,
    EinopsLayersAttention,
    EinopsWidthAttention,
    LitConfig,
    LitGPT,
    einops_gqa_config,
)


def _plan(lm: nn.Module, mp: int):
    torch.manual_seed(1)
    ids = torch.randint(0, 64, (2, 16))
    trace = trace_step(lm, lambda: lm.training_step((ids,), 0))
    return make_plan(lm, mp, trace)


def _litgpt(fused_groups: bool, **config) -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(LitGPT(LitConfig(**config), fused_groups)).double()


def _einops(attention=EinopsLayersAttention) -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(AttentionLM(attention)).double()


def _own_shares_sum_to_dense(lm: CausalLM, plan, mp: int) -> None:
    attn = lm.net.blocks[0]["attn"]
    x = torch.randn(2, 16, 32, dtype=torch.float64)
    with torch.no_grad():
        want = attn(x)
        got = sum(_rank_share(attn, plan, "net.blocks.0.attn", mp, r)(x) for r in range(mp))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def _rank_share(attn: nn.Module, plan, prefix: str, mp: int, rank: int) -> nn.Module:
    """A copy of ``attn`` (named ``prefix`` in the planned model) as rank ``rank`` holds it: its column layers' rows and
    row layers' columns sliced as the plan says (block by block), its held sizes set per rank."""
    local = copy.deepcopy(attn)
    for name, lp in plan.layers.items():
        if not name.startswith(prefix + "."):
            continue
        layer = local.get_submodule(name[len(prefix) + 1:])
        assert lp.style in ("column", "row"), (name, lp.style, lp.note)
        dim = 0 if lp.style == "column" else 1
        layer.weight = nn.Parameter(shard_tensor(layer.weight.detach(), dim, mp, rank, lp.blocks))
        if layer.bias is not None and lp.style == "column":
            layer.bias = nn.Parameter(shard_tensor(layer.bias.detach(), 0, mp, rank, lp.blocks))
        elif layer.bias is not None and rank:  # a row layer's bias is added once
            layer.bias = nn.Parameter(torch.zeros_like(layer.bias))
    for name, paths in plan.adjust.items():
        if name == prefix or name.startswith(prefix + "."):
            held = local.get_submodule(name[len(prefix) + 1:]) if name != prefix else local
            set_per_rank(held, {p: v for p, (_, v) in paths.items()})
    return local


@pytest.mark.parametrize("mp", [2, 4])
@pytest.mark.parametrize("fused_groups", [True, False], ids=["fused_per_group", "split_by_sizes"])
def test_a_config_shared_by_every_layer_is_set_per_rank_on_a_copy(fused_groups, mp):
    lm = _litgpt(fused_groups)
    plan = _plan(lm, mp)
    blocks = [f"net.transformer.h.{i}" for i in range(2)]
    styles = {n: lp.style for n, lp in plan.layers.items()}
    for b in blocks:
        assert (styles[f"{b}.attn.attn"], styles[f"{b}.attn.proj"]) == ("column", "row"), plan.layers[f"{b}.attn.attn"]
        assert (styles[f"{b}.mlp.fc_1"], styles[f"{b}.mlp.fc_2"], styles[f"{b}.mlp.proj"]) == ("column",) * 2 + ("row",)
    # the counts the attention reshapes with (n_query_groups) and the one its code divides by it (n_head, for
    # q_per_kv = n_head // n_query_groups); head_size * n_head follows by itself
    assert plan.adjust == {f"{b}.attn": {"config.n_query_groups": (4, 4 // mp), "config.n_head": (8, 8 // mp)}
                           for b in blocks}
    # 0 all-gathers: 2 all-reduces each way per block (+ the token table and the vocab-parallel loss's 2 forward)
    assert plan.comm_per_step() == {"forward": {"all_reduce": 7, "all_gather": 0},
                                    "backward": {"all_reduce": 5, "all_gather": 0}}
    assert "adjusted: net.transformer.h.0.attn.config.n_head = 8 -> " in plan.describe(lm)

    # the config is shared: setting it per rank on the attention gives that module a copy, nothing else changes
    config, attn = lm.net.config, lm.net.transformer["h"][0].attn
    dense = set_per_rank(attn, {p: v for p, (_, v) in plan.adjust["net.transformer.h.0.attn"].items()})
    assert (attn.config.n_head, attn.config.n_query_groups, attn.config.head_size) == (8 // mp, 4 // mp, 6)
    assert attn.config is not config and config.n_head == 8 and lm.net.transformer["h"][0].mlp.config is config
    assert lm.net.transformer["h"][1].attn.config is config
    unset_per_rank(attn, dense)
    assert attn.config is config

    _shares_sum_to_dense(lm, plan, mp)
    assert attn.config is config and config.n_head == 8  # the copies never touched the shared object


def _shares_sum_to_dense(lm: CausalLM, plan, mp: int) -> None:
    """Each rank's share of block 0's attention (its slices, its per-rank counts), summed, is the dense attention."""
    attn, config = lm.net.transformer["h"][0].attn, lm.net.config
    x = torch.randn(2, 16, config.n_embd, dtype=torch.float64)
    T, n = 16, config.rope_n_elem
    theta = 1.0 / 10000 ** (torch.arange(0, n, 2).double() / n)
    freqs = torch.outer(torch.arange(T).double(), theta).repeat(1, 2)
    with torch.no_grad():
        want = attn(x, freqs.cos(), freqs.sin())
        got = sum(_rank_share(attn, plan, "net.transformer.h.0.attn", mp, r)(x, freqs.cos(), freqs.sin())
                  for r in range(mp))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("fused_groups", [True, False], ids=["fused_per_group", "split_by_sizes"])
def test_a_config_field_equal_to_the_count_by_chance_stays_dense(fused_groups):
    """``head_size`` = ``n_layer`` = ``n_query_groups`` = 4: of the config's fields equal to the size a view got at
    the head dim, only the one the code passes there goes per rank (``head_size`` sits at the view's last position,
    ``n_layer`` is passed nowhere); per-rank ``head_size`` would cut every head in half."""
    lm = _litgpt(fused_groups, head_size=4, n_layer=4, n_embd=32)
    plan = _plan(lm, 2)
    assert plan.adjust["net.transformer.h.0.attn"] == {"config.n_query_groups": (4, 2), "config.n_head": (8, 4)}
    assert plan.layers["net.transformer.h.0.attn.attn"].style == "column"
    _shares_sum_to_dense(lm, plan, 2)


def test_a_config_count_mp_does_not_divide_keeps_attention_whole_and_says_why():
    lm = _litgpt(True, n_query_groups=2)  # 2 kv groups cannot be split 4 ways
    plan = _plan(lm, 4)
    lp = plan.layers["net.transformer.h.0.attn.attn"]
    assert lp.style == "column_gather" and not plan.adjust, (lp.style, plan.adjust)
    assert lp.note == "output reshaped to 2 heads/groups at dim 2, not divisible by mp=4", lp.note
    assert plan.comm_per_step()["forward"]["all_gather"] == 4  # the attention's output, gathered in each block


@pytest.mark.parametrize("mp", [2, 4])
def test_einops_rearrange_layers_hold_their_own_head_count(mp):
    """x-transformers' attention splits heads with ``Rearrange('b n (h d) -> b h n d', h=heads)``: the reshape
    that puts the heads on a dim runs inside that layer, with the count it keeps (``axes_lengths``, and einops'
    ``_axes_lengths`` its forward reads). The attention module also keeps ``heads``, which its forward never reads:
    setting that one per rank (as the plan did before) left the reshape at 8 heads of width 2 per rank, and the
    verification failed. The count is looked up from the module whose code passed it."""
    pytest.importorskip("einops")
    lm = _einops()
    plan = _plan(lm, mp)
    styles = {n: lp.style for n, lp in plan.layers.items()}
    for i in range(2):
        a = f"net.blocks.{i}.attn"
        assert (styles[f"{a}.to_qkv"], styles[f"{a}.to_out"]) == ("column", "row"), plan.layers[f"{a}.to_qkv"]
    assert plan.adjust == {f"net.blocks.{i}.attn.split_heads": {"axes_lengths['h']": (8, 8 // mp),
                                                                "_axes_lengths[0][1]": (8, 8 // mp)}
                           for i in range(2)}
    assert plan.comm_per_step() == {"forward": {"all_reduce": 7, "all_gather": 0},
                                    "backward": {"all_reduce": 5, "all_gather": 0}}
    attn = lm.net.blocks[0]["attn"]
    layer, before = attn.split_heads, attn.split_heads._axes_lengths
    dense = set_per_rank(layer, {p: v for p, (_, v) in plan.adjust["net.blocks.0.attn.split_heads"].items()})
    assert read_path(layer, "_axes_lengths[0][1]") == 8 // mp and layer.axes_lengths == {"h": 8 // mp}
    unset_per_rank(layer, dense)
    assert layer._axes_lengths is before and layer.axes_lengths == {"h": 8}
    x = torch.randn(2, 16, 32, dtype=torch.float64)
    with torch.no_grad():
        want = attn(x)
        got = sum(_rank_share(attn, plan, "net.blocks.0.attn", mp, r)(x) for r in range(mp))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert attn.heads == 8 and attn.split_heads.axes_lengths == {"h": 8}


_NO_GATHER = {"forward": {"all_reduce": 7, "all_gather": 0}, "backward": {"all_reduce": 5, "all_gather": 0}}


@pytest.mark.parametrize("mp", [2, 4])
def test_einops_inferring_the_count_from_the_width_needs_no_holder(mp):
    """``rearrange(t, 'b n (h d) -> b h n d', d=dim_head)``: einops reads the width and computes h = width // d, a
    size held by nothing that divides the split width the code read: per rank by itself (was: "reshapes to a fixed
    size 8 ... held by no attribute", attention gathered)."""
    pytest.importorskip("einops")
    lm = _einops(EinopsWidthAttention)
    plan = _plan(lm, mp)
    assert [plan.layers[f"net.blocks.0.attn.{n}"].style for n in ("to_qkv", "to_out")] == ["column", "row"]
    assert plan.adjust == {} and plan.comm_per_step() == _NO_GATHER
    _own_shares_sum_to_dense(lm, plan, mp)


@pytest.mark.parametrize("mp", [2, 4])
def test_einops_counts_from_a_shared_config_passed_by_keyword(mp):
    """``h=self.config.kv_heads`` (the reshape runs inside einops): the config fields passed by keyword go per rank
    (``heads`` with them: the code divides it by ``kv_heads``), not ``dim_head``, equal to ``kv_heads`` by chance."""
    pytest.importorskip("einops")
    config = einops_gqa_config()
    lm = _einops(lambda: EinopsConfigGQA(config))
    plan = _plan(lm, mp)
    assert [plan.layers[f"net.blocks.0.attn.{n}"].style for n in ("to_q", "to_kv", "to_out")] == [
        "column", "column", "row"]
    assert plan.adjust == {f"net.blocks.{i}.attn": {"config.kv_heads": (4, 4 // mp), "config.heads": (8, 8 // mp)}
                           for i in range(2)}
    assert plan.comm_per_step() == _NO_GATHER
    _own_shares_sum_to_dense(lm, plan, mp)
    assert lm.net.blocks[1]["attn"].config is config and (config.heads, config.kv_heads) == (8, 4)
