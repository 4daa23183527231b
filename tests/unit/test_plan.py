"""The planner on recorded data flow: pairs only where a column output reaches row layers element-wise."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_dpmp.planner.plan import make_plan
from lightning_dpmp.planner.trace import trace_step
from tests.support.models import ResMLP


def plan_of(model: nn.Module, x: torch.Tensor, mp: int = 2, user_plan=None, step=None):
    trace = trace_step(model, step or (lambda: model(x)))
    plan = make_plan(model, mp, trace, user_plan)
    return {n: lp.style for n, lp in plan.layers.items()}, plan


class Gated(nn.Module):
    """LLaMA-style MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, d: int = 8, h: int = 16) -> None:
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(d, h), nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.c(F.gelu(self.b(F.gelu(self.a(x)))))


@pytest.mark.parametrize("mp", [2, 4])
def test_resmlp_pairs_blocks_and_explains_the_rest(mp):
    model = ResMLP()
    styles, plan = plan_of(model, torch.randn(4, 12), mp)
    assert styles == {
        "inp": "column_gather", "blocks.0.fc1": "column", "blocks.0.fc2": "row",
        "blocks.1.fc1": "column", "blocks.1.fc2": "row", "head": "replicate",
    }
    assert plan.layers["head"].note == f"out_features=3 not divisible by mp={mp}"
    assert plan.layers["blocks.0.fc1"].note == "-> blocks.0.fc2"
    # inp reads data (no input gradient): its backward all-reduce is not counted
    assert plan.comm_per_step() == {
        "forward": {"all_reduce": 2, "all_gather": 1}, "backward": {"all_reduce": 2, "all_gather": 0}
    }
    text = plan.describe(model)
    assert "blocks.0.fc1  column" in text and f"({32 // mp}, 16)" in text and "parameters per rank" in text
    local, total = plan.param_counts(model)
    split = sum(
        m.weight.numel() + m.bias.numel() for n, m in model.named_modules() if n in ("inp",) or n.endswith("fc1")
    )
    split_w_only = sum(m.weight.numel() for n, m in model.named_modules() if n.endswith("fc2"))
    assert total - local == (split + split_w_only) - (split + split_w_only) // mp


def test_gated_mlp_shares_one_entry():
    styles, plan = plan_of(Gated(), torch.randn(3, 5, 8, requires_grad=True))
    assert styles == {"gate": "column", "up": "column", "down": "row"}
    assert plan.layers["gate"].entry == plan.layers["up"].entry >= 0
    assert plan.comm_per_step()["backward"]["all_reduce"] == 1
    assert plan.comm_per_step()["forward"]["all_reduce"] == 1


def test_chain_pairs_first_two_and_gathers_the_third():
    styles, _ = plan_of(Chain(), torch.randn(2, 8))
    assert styles == {"a": "column", "b": "row", "c": "column_gather"}


@pytest.mark.parametrize(
    "between,reason",
    [
        (lambda h, x: torch.softmax(h, dim=-1), "softmax"),      # reads the whole feature dim
        (lambda h, x: h + x.repeat(1, 2), "add"),                # mixes in a replicated full-width tensor
        (lambda h, x: h[..., :16].repeat(1, 2), "getitem"),       # slices the feature dim
    ],
)
def test_non_elementwise_use_prevents_pairing(between, reason):
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

        def forward(self, x):
            return self.fc2(between(self.fc1(x), x))

    styles, plan = plan_of(M(), torch.randn(4, 16))
    assert styles == {"fc1": "column_gather", "fc2": "column_gather"}
    assert reason in plan.layers["fc1"].note


def test_a_sharded_tensor_returned_from_the_step_is_not_left_sharded():
    model = Chain()
    x = torch.randn(2, 8)

    def step():
        h = F.gelu(model.a(x))
        return {"loss": model.c(F.gelu(model.b(h))).sum(), "hidden": h}

    styles, plan = plan_of(model, x, step=step)
    assert styles["a"] == "column_gather" and "returned from the step" in plan.layers["a"].note


def test_non_differentiable_consumer_is_seen():
    model = Chain()
    x = torch.randn(2, 8)

    def step():
        h = model.a(x)
        return model.c(F.gelu(model.b(F.gelu(h)))).sum() + h.argmax(-1).float().mean()

    styles, _ = plan_of(model, x, step=step)
    assert styles["a"] == "column_gather"


def test_user_plan_globs_override_and_validate():
    model = ResMLP()
    x = torch.randn(4, 12)
    styles, plan = plan_of(model, x, user_plan={"blocks.1.*": "replicate", "inp": "replicate"})
    assert styles["blocks.1.fc1"] == styles["blocks.1.fc2"] == styles["inp"] == "replicate"
    assert styles["blocks.0.fc1"] == "column"
    with pytest.warns(UserWarning, match="matches no module"):
        plan_of(model, x, user_plan={"decoder.*": "column"})
    with pytest.raises(ValueError, match="'blocks.0.ln', a LayerNorm, and no nn.Linear"):
        plan_of(model, x, user_plan={"blocks.0.ln": "column"})
    with pytest.raises(ValueError, match=r"'head'.*out_features=3 is not divisible by mp=2"):
        plan_of(model, x, user_plan={"head": "column"})
    with pytest.raises(ValueError, match="not a style"):
        plan_of(model, x, user_plan={"head": "colwise"})


def test_without_a_trace_user_plan_pairs_and_the_rest_is_self_contained():
    model = ResMLP()
    plan = make_plan(model, 2, None, {"blocks.*.fc1": "column", "blocks.*.fc2": "row"})
    styles = {n: lp.style for n, lp in plan.layers.items()}
    assert styles["blocks.0.fc1"] == "column" and styles["blocks.1.fc2"] == "row"
    assert styles["inp"] == "column_gather" and styles["head"] == "replicate"


@pytest.mark.parametrize("vocab", [32, 33])
def test_tied_head_splits_with_its_embedding_and_attention_is_head_parallel(vocab):
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(vocab, 8)
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
            self.head = nn.Linear(8, vocab, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids):
            h = self.emb(ids)
            return self.head(self.attn(h, h, h)[0])

    styles, plan = plan_of(Tied(), torch.randint(0, vocab, (2, 5)))
    # nn.MultiheadAttention reads out_proj.weight without calling it: the attention itself is the plan entry
    assert styles["attn"] == "heads" and styles["attn.out_proj"] == "row"
    assert plan.layers["attn.out_proj"].note == "<- heads of attn"
    # split together: the head's logits are returned, so it gathers them; 33 rows are padded to 34 (17 per rank)
    assert styles["emb"] == "vocab" and styles["head"] == "column_gather"
    assert plan.layers["emb"].local_shape(2) == (-(-vocab // 2), 8)


def test_lm_head_feeding_only_the_loss_is_vocab_parallel():
    emb, head = nn.Embedding(64, 16), nn.Linear(16, 64, bias=False)
    model = nn.ModuleDict({"emb": emb, "head": head})
    ids, y = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))

    def step():
        logits = head(emb(ids))
        return F.cross_entropy(logits.view(-1, 64), y.view(-1), label_smoothing=0.1)

    styles, plan = plan_of(model, ids, step=step)
    assert styles == {"emb": "vocab", "head": "vocab"}
    # embedding all-reduce + the loss's two all-reduces forward; the head's input gradient backward
    assert plan.comm_per_step() == {
        "forward": {"all_reduce": 3, "all_gather": 0}, "backward": {"all_reduce": 1, "all_gather": 0}
    }


def test_fixed_head_count_reshape_is_adjusted_or_refused():
    class Attn(nn.Module):
        """Keeps its head count in an attribute and reshapes with it (nanoGPT-like)."""

        def __init__(self, full_width_reshape: bool) -> None:
            super().__init__()
            self.n_head, self.full = 4, full_width_reshape
            self.q, self.k, self.v, self.o = (nn.Linear(16, 16) for _ in range(4))

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = (p(x).view(B, T, self.n_head, 4).transpose(1, 2) for p in (self.q, self.k, self.v))
            y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).contiguous()
            return self.o(y.view(B, T, C) if self.full else y.view(B, T, -1))

    styles, plan = plan_of(Attn(False), torch.randn(2, 3, 16))
    assert styles == {"q": "column", "k": "column", "v": "column", "o": "row"}
    assert plan.adjust == {"": {"n_head": (4, 2)}}
    styles, plan = plan_of(Attn(True), torch.randn(2, 3, 16))
    assert set(styles.values()) == {"column_gather"}
    assert "fixed size 16" in plan.layers["q"].note and "view(B, T, -1, head_dim)" in plan.layers["q"].note


def test_heads_not_divisible_fall_back_with_the_reason():
    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(12, 12) for _ in range(4))

        def forward(self, x):
            B, T, _ = x.shape
            q, k, v = (p(x).view(B, T, -1, 4).transpose(1, 2) for p in (self.q, self.k, self.v))  # 3 heads
            return self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, -1))

    styles, plan = plan_of(Attn(), torch.randn(2, 3, 12), mp=2)
    assert styles["q"] == "column_gather" and "3 heads/groups at dim 2, not divisible by mp=2" in plan.layers["q"].note


def test_fused_qkv_is_split_block_by_block():
    class Fused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.o = nn.Linear(16, 48), nn.Linear(16, 16)

        def forward(self, x):
            B, T, _ = x.shape
            q, k, v = self.qkv(x).view(B, T, 3, -1, 4).permute(2, 0, 3, 1, 4).unbind(0)
            return self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, -1))

    styles, plan = plan_of(Fused(), torch.randn(2, 3, 16))
    assert styles == {"qkv": "column", "o": "row"} and plan.layers["qkv"].blocks == 3


def test_mp1_splits_nothing():
    styles, plan = plan_of(ResMLP(), torch.randn(4, 12), mp=1)
    assert set(styles.values()) == {"replicate"}
    assert plan.comm_per_step()["forward"] == {"all_reduce": 0, "all_gather": 0}


def test_sequence_parallel_analysis_on_gpt_and_refusals():
    from lightning_dpmp.planner.sequence import plan_sequence_parallel
    from tests.support.models import build

    model, ds = build("gpt")
    x, y = ds.tensors[0][:4], ds.tensors[1][:4]
    model.log = lambda *a, **k: None
    trace = trace_step(model, lambda: model.training_step((x, y), 0))
    plan = make_plan(model, 2, trace)
    sp = plan_sequence_parallel(trace, plan, 2, {n for n, _ in model.named_parameters()})
    assert sp.problem is None
    assert sp.scatter == {"net.wte": 1, "net.wpe": 0}
    assert set(sp.owner_gather) == {"net.blocks.0.attn", "net.blocks.1.attn", "net.blocks.0.mlp", "net.blocks.1.mlp"}
    # norms and row biases see 1/mp of the tokens; column biases and embeddings do not
    assert "net.blocks.0.ln_1.weight" in sp.partial_params and "net.blocks.0.attn.out_proj.bias" in sp.partial_params
    assert "net.ln_f.bias" in sp.partial_params and "net.blocks.0.mlp.fc1.bias" not in sp.partial_params
    assert not any("wte" in p or "wpe" in p for p in sp.partial_params)

    # a 15-token sequence cannot be split 2 ways; a model with no embedding has no sequence to split
    trace15 = trace_step(model, lambda: model.training_step((x[:, :15], y[:, :15]), 0))
    assert "not divisible by mp=2" in plan_sequence_parallel(trace15, make_plan(model, 2, trace15), 2).problem
    mlp = ResMLP()
    t = trace_step(mlp, lambda: mlp(torch.randn(4, 12)))
    assert "no nn.Embedding" in plan_sequence_parallel(t, make_plan(mlp, 2, t), 2).problem


@pytest.mark.parametrize("mp", [2, 4])
@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_mlp_chain_gives_every_layer_one_role(n, mp):
    """L1 -> GELU -> ... -> L(n-1) -> Ln -> cross-entropy: greedy in call order, (L1, L2), (L3, L4), ...; an odd last
    layer reads a replicated input and its logits reach only the loss: vocab when forced (a 4-class head on a
    16-wide input saves too little to split by itself: it stays whole, and the note says why)."""
    from tests.support.models import ChainMLP

    model = ChainMLP(n)
    x, y = torch.randn(8, 12), torch.randint(0, 4, (8,))
    last = f"layers.{n - 1}"
    styles, plan = plan_of(model, x, mp, step=lambda: F.cross_entropy(model(x), y))
    expected = {f"layers.{i}": ("column" if i % 2 == 0 else "row") for i in range(n - n % 2)}
    if n % 2:
        assert styles[last] == "replicate" and plan.layers[last].note.startswith(
            "kept whole: out_features=4 <= in_features=16"), plan.layers[last].note
        assert plan.comm_per_step()["forward"]["all_reduce"] == n // 2
        styles, plan = plan_of(model, x, mp, step=lambda: F.cross_entropy(model(x), y), user_plan={last: "vocab"})
        expected[last] = "vocab"
    assert styles == expected
    for name, lp in plan.layers.items():  # partners agree: a column's partners are rows and the reverse
        if lp.style in ("column", "row"):
            partners = lp.note[3:].split(", ")
            want = "row" if lp.style == "column" else "column"
            assert partners and all(plan.layers[p].style == want for p in partners), (name, lp.note)
    rows = sum(s == "row" for s in styles.values())
    assert plan.comm_per_step()["forward"]["all_reduce"] == rows + 2 * (n % 2)


def test_chain_conflict_is_explained():
    """A layer that would start a split after being a row end says so, naming the layer that holds the role."""
    from tests.support.models import ChainMLP

    model = ChainMLP(4)
    x, y = torch.randn(8, 12), torch.randint(0, 4, (8,))
    trace = trace_step(model, lambda: F.cross_entropy(model(x), y))
    from lightning_dpmp.planner.flow import analyse

    flow = analyse(trace, {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}, 2, {})
    assert flow.roles == {"layers.0": "column", "layers.1": "row", "layers.2": "column", "layers.3": "row"}
    assert flow.why["layers.1"] == "one role per layer: layers.1 already is row (paired from layers.0)"
    assert flow.why["layers.3"] == "one role per layer: layers.3 already is row (paired from layers.2)"  # not vocab too


def test_a_shared_token_table_is_planned_per_weight():
    """``shared`` is never called itself; a same-object alias and a distinct module holding its weight are."""
    from tests.support.models import AliasedLM

    model = AliasedLM()
    ids = torch.randint(0, 64, (2, 16))
    styles, plan = plan_of(model, ids, step=lambda: F.cross_entropy(model(ids).view(-1, 64), ids.view(-1)))
    assert styles == {"fc1": "column", "fc2": "row", "head": "vocab", "shared": "vocab", "enc.embed_tokens": "vocab"}
    assert "same weight as enc.embed_tokens, dec.embed_tokens" in plan.layers["shared"].note
    # a replicate forced on one name holds for the whole table, and for the head tied to it
    styles, _ = plan_of(model, ids, user_plan={"enc.embed_tokens": "replicate"},
                        step=lambda: F.cross_entropy(model(ids).view(-1, 64), ids.view(-1)))
    assert (styles["shared"], styles["enc.embed_tokens"], styles["head"]) == ("replicate",) * 3


class Adapted(nn.Module):
    """A hand-written low-rank adapter beside each layer of a gated MLP (no peft, names unrelated to LoRA's):
    ``fc(x) + scale * p(q(x))`` with a rank-2 inner width."""

    def __init__(self, d: int = 8, h: int = 16, r: int = 2) -> None:
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(d, h), nn.Linear(d, h), nn.Linear(h, d)
        self.q1, self.p1 = nn.Linear(d, r, bias=False), nn.Linear(r, h, bias=False)  # on a column-parallel base
        self.q2, self.p2 = nn.Linear(h, r, bias=False), nn.Linear(r, d, bias=False)  # on a row-parallel base

    def forward(self, x):
        g = self.gate(x) + 0.5 * self.p1(self.q1(x))
        hid = F.silu(g) * self.up(x)
        return self.down(hid) + 0.5 * self.p2(self.q2(hid))


def test_low_rank_products_follow_their_base_layer():
    """Found by the flow, not by names: the adapter on the column base has its first factor whole inside the
    base's region (its gradient summed over MP) and its second split without an entry; the one on the row base has
    its first factor split by input and its second whole. The MLP then costs one all-reduce each way plus the row
    adapter's own, and no all-gather."""
    styles, plan = plan_of(Adapted(), torch.randn(4, 8, requires_grad=True))  # as inside a network: x needs dX
    assert styles == {"gate": "column", "up": "column", "down": "row", "q1": "partial", "p1": "column",
                      "q2": "row", "p2": "replicate"}, styles
    assert plan.layers["p1"].entered and not plan.layers["gate"].entered
    assert plan.layers["q1"].entry == plan.layers["gate"].entry >= 0  # one entry: one backward all-reduce
    assert plan.partial_params == ["q1.weight"]
    assert plan.comm_per_step() == {"forward": {"all_reduce": 2, "all_gather": 0},
                                    "backward": {"all_reduce": 1, "all_gather": 0}}
    assert "partial gradients: 1 whole parameters" in plan.describe(Adapted())


def test_a_low_rank_product_after_a_dropout_keeps_its_own_entry():
    """The first factor reads a dropout of the base's input, not the base's input: it stays whole outside the region
    and the second factor keeps its own entry (one all-reduce of the rank-2 gradient), still no all-gather."""

    class Dropped(Adapted):
        def forward(self, x):
            g = self.gate(x) + 0.5 * self.p1(self.q1(F.dropout(x, 0.1, self.training)))
            return self.down(F.silu(g) * self.up(x))

    model = Dropped()
    styles, plan = plan_of(model, torch.randn(4, 8, requires_grad=True))
    assert (styles["q1"], styles["p1"]) == ("replicate", "column") and not plan.layers["p1"].entered
    assert plan.partial_params == []
    assert plan.comm_per_step()["backward"] == {"all_reduce": 2, "all_gather": 0}


class HeadNorm(nn.Module):
    """Attention-like heads with one scale over head_dim shared by every head (a q/k norm's weight), optionally
    also applied to a replicated tensor (then its gradient is not a partial sum: it stays out)."""

    def __init__(self, also_whole: bool = False) -> None:
        super().__init__()
        self.q, self.o = nn.Linear(8, 8), nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(2))
        self.also_whole = also_whole

    def forward(self, x):
        b, t, _ = x.shape
        h = self.q(x).view(b, t, -1, 2) * self.scale  # 4 heads of 2
        out = self.o(torch.softmax(h, -1).reshape(b, t, -1))
        return (out * self.scale.sum() if self.also_whole else out).sum()


def test_a_whole_parameter_read_only_inside_a_split_region_is_partial():
    styles, plan = plan_of(HeadNorm(), torch.randn(2, 3, 8))
    assert (styles["q"], styles["o"]) == ("column", "row"), plan.describe(HeadNorm())
    assert plan.partial_params == ["scale"]
    _, plan = plan_of(HeadNorm(also_whole=True), torch.randn(2, 3, 8))
    assert plan.partial_params == []  # also read on replicated data: its gradient is not a partial sum


def test_a_whole_parameter_also_read_in_a_region_left_whole_is_not_partial():
    """The same shared scale in a second head block whose region breaks (a feature-wide norm reads it): that block
    gathers, the scale's gradient there is a full one, so it is not summed over MP."""

    class Two(HeadNorm):
        def __init__(self) -> None:
            super().__init__()
            self.q2 = nn.Linear(8, 8)

        def forward(self, x):
            b, t, _ = x.shape
            broken = F.layer_norm((self.q2(x).view(b, t, -1, 2) * self.scale).reshape(b, t, 8), (8,))
            return super().forward(x) + broken.sum()

    styles, plan = plan_of(Two(), torch.randn(2, 3, 8))
    assert (styles["q"], styles["o"], styles["q2"]) == ("column", "row", "column_gather"), styles
    assert plan.partial_params == []


class _ScaledLookup(nn.Embedding):
    """Gemma's and BART's token table: the lookup, then a scale."""

    def forward(self, ids):
        return super().forward(ids) * self.embedding_dim**0.5


class _OwnLookup(nn.Embedding):
    """A subclass calling F.embedding itself: a vocab-parallel nn.Embedding.forward would never run."""

    def forward(self, ids):
        return F.embedding(ids, self.weight, self.padding_idx) * 2.0


class _PlainSubclass(nn.Embedding):
    """A subclass for its name only (no forward of its own)."""


@pytest.mark.parametrize(
    "table, style", [(_ScaledLookup, "vocab"), (_PlainSubclass, "vocab"), (_OwnLookup, "replicate")]
)
def test_an_embedding_subclass_splits_by_rows_when_its_lookup_is_nn_embedding_forward(table, style):
    emb, head = table(64, 16), nn.Linear(16, 64, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head})
    ids = torch.randint(0, 64, (2, 8))
    styles, plan = plan_of(model, ids, step=lambda: F.cross_entropy(head(emb(ids)).view(-1, 64), ids.view(-1)))
    assert styles == {"emb": style, "head": style}
    if table is _OwnLookup:
        assert "_OwnLookup.forward calls F.embedding on its weight itself" in plan.layers["emb"].note
    else:  # one lookup, one all-reduce; the scale is recorded as the model's own op
        assert plan.layers["emb"].calls == 1


def test_a_projection_fused_per_kv_group_splits_by_groups():
    from tests.support.real_models import GroupedAttention

    attn = GroupedAttention(d=32, heads=8, groups=4)
    styles, plan = plan_of(attn, torch.randn(2, 6, 32))
    # viewed (B, T, groups, heads_per_group + 2, head_dim) and sliced along the per-group dim: whole groups per
    # rank, one contiguous slice of the rows (a (B, T, 3, H, d) view is split inside each of its 3 blocks instead)
    assert styles == {"qkv": "column", "out": "row"}
    assert plan.layers["qkv"].blocks == 1


@pytest.mark.parametrize("mp", [2, 4])
def test_fused_qkv_cut_by_computed_sizes_is_split_by_its_blocks(mp):
    """DBRX clamps its fused Wqkv and splits it by sizes computed in forward (``[hidden, kv*hd, kv*hd]``): the cut
    pieces are the layer's blocks (32 | 16 | 16), each split evenly; attention stays head-parallel. (Its
    experts are not split yet: see the design notes.)"""
    pytest.importorskip("transformers")
    from tests.support.real_models import build_real

    module, data = build_real("hf_dbrx")
    ids = data.tensors[0][:2]
    styles, plan = plan_of(module, ids, mp, step=lambda: module.training_step((ids, None), 0))
    for i in range(2):
        attn = f"net.transformer.blocks.{i}.norm_attn_norm.attn"
        assert (styles[f"{attn}.Wqkv"], styles[f"{attn}.out_proj"]) == ("column", "row"), plan.layers[f"{attn}.Wqkv"]
        assert plan.layers[f"{attn}.Wqkv"].blocks == (32, 16, 16) and plan.layers[f"{attn}.Wqkv"].attention


def test_an_attribute_divided_by_a_per_rank_one_is_set_per_rank_with_it():
    """einops attention whose forward derives the head width as ``self.inner_dim // self.heads``: ``inner_dim`` is
    set per rank with ``heads``; when it cannot be (33 is odd), the attention stays whole and says why."""
    pytest.importorskip("einops")
    from tests.support.real_models import EinopsAttention

    torch.manual_seed(0)
    attn, x = EinopsAttention(32), torch.randn(2, 5, 32)
    styles, plan = plan_of(attn, x, 2)
    assert styles["to_q"] == styles["to_kv"] == "column" and styles["to_out"] == "row"
    assert plan.adjust == {"": {"heads": (8, 4), "inner_dim": (32, 16)}}
    attn.inner_dim = 33  # the same head width (33 // 8 == 4), but no per-rank value keeps it
    styles, plan = plan_of(attn, x, 2)
    assert styles["to_q"] != "column" and not plan.adjust
    assert "divides inner_dim=33 by an attribute set per rank (heads), and 33 is not divisible by mp=2" in (
        plan.layers["to_q"].note), plan.layers["to_q"].note
