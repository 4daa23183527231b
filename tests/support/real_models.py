"""Real architectures for the planner: models built from the ``transformers`` package's configs (tiny sizes,
random init, no downloads) and from torch's own layers, each wrapped the way users train them.

Every entry of :data:`REAL_MODELS` is ``name -> RealModel``: a builder returning ``(LightningModule, dataset)``,
the number of repeated blocks, and what each block must cost. Add a model by adding an entry;
``tests/models/test_real_models.py`` picks it up.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Callable

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from tests.support.models import make_lm_dataset

VOCAB, SEQ = 64, 16
GPT2_VOCAB = 50257  # GPT-2's real vocabulary: no mp > 1 divides it


class CausalLM(L.LightningModule):
    """Next-token loss the usual way: the logits are shifted by slicing first (``logits[:, :-1]``)."""

    def __init__(self, net: nn.Module, vocab: int = VOCAB, lr: float = 3e-3) -> None:
        super().__init__()
        self.net, self.vocab, self.lr = net, vocab, lr

    def training_step(self, batch, batch_idx):
        ids = batch[0]
        logits = self.net(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, self.vocab), ids[:, 1:].reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        trainable = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(trainable, lr=self.lr, weight_decay=0.01)


@dataclass(frozen=True)
class RealModel:
    build: Callable[[], tuple[L.LightningModule, object]]
    n_blocks: int  # repeated blocks (module paths with a numeric index, e.g. model.layers.3)
    max_mp: int = 4  # the largest mp its heads allow
    attention: bool = True  # its blocks hold attention, which must come out head-parallel
    # MP all-reduces (forward, backward) a block must cost: one per sublayer each way (attention, MLP), by
    # default 2 + 2; an encoder-decoder block with cross-attention has 3.
    per_block: Callable[[str], tuple[int, int]] = lambda block: (2, 2)
    float64_tol: float = 1e-8  # weights vs single process after 20 float64 steps (see _mixtral for the exception)
    vocab: tuple[str, ...] = ()  # layers that must come out split by vocabulary (a token table and its tied head)


def llama(hidden: int = 32, intermediate: int = 64, norm_in_model_dtype: bool = False, layers: int = 2
          ) -> tuple[L.LightningModule, object]:
    """transformers' Llama (2 blocks, 8 query / 4 key-value heads: GQA), ``hidden`` wide. transformers computes
    ``LlamaRMSNorm`` in float32 whatever the model's dtype; ``norm_in_model_dtype`` makes it compute in the
    model's dtype instead (float64 throughout, for exact float64 comparisons of compiled code)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=SEQ, tie_word_embeddings=False,
    )
    net = LlamaForCausalLM(cfg)
    if norm_in_model_dtype:
        import types

        for mod in net.modules():
            if type(mod).__name__ == "LlamaRMSNorm":
                mod.forward = types.MethodType(_rms_norm_in_model_dtype, mod)
    return CausalLM(net), make_lm_dataset(vocab=VOCAB, seq=SEQ)


def _rms_norm_in_model_dtype(self, hidden_states):
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _llama() -> tuple[L.LightningModule, object]:
    return llama()


def _llama4() -> tuple[L.LightningModule, object]:
    return llama(layers=4)


# The Llamas the compile tests train against single-process training: stock (its RMSNorm in float32), with the norm
# in the model's dtype, and that one wide enough (a block of over 1 MB per rank at mp=2, in float64) for Dynamo to
# split a compiled block's graph at DDP's first bucket boundary.
COMPILE_LLAMAS: dict[str, dict] = {
    "llama": {},
    "llama_norm64": {"norm_in_model_dtype": True},
    "llama_wide_norm64": {"hidden": 256, "intermediate": 512, "norm_in_model_dtype": True},
}


def build_llama(name: str) -> tuple[L.LightningModule, object]:
    """A Llama of :data:`COMPILE_LLAMAS` by name, from the same seed in every process and in the reference."""
    torch.manual_seed(0)
    return llama(**COMPILE_LLAMAS[name])


class LabelsLM(CausalLM):
    """The objective computed inside the model: transformers' own ``labels=`` loss (BERT's masked-LM head, T5's
    decoder, which shifts its inputs itself)."""

    def training_step(self, batch, batch_idx):
        ids, targets = batch
        loss = self.net(input_ids=ids, labels=targets).loss
        self.log("train_loss", loss)
        return loss


def _qwen3() -> tuple[L.LightningModule, object]:
    """transformers' Qwen3: an RMSNorm over ``head_dim`` on q and on k (``q_norm``/``k_norm``), one weight shared by
    all heads: on head-parallel attention each MP rank holds the gradient of its own heads only (summed over MP)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, head_dim=4, max_position_embeddings=SEQ, tie_word_embeddings=False,
    )
    return CausalLM(Qwen3ForCausalLM(cfg)), make_lm_dataset(vocab=VOCAB, seq=SEQ)


def _gemma() -> tuple[L.LightningModule, object]:
    """transformers' Gemma: its token table is an ``nn.Embedding`` subclass whose forward scales the lookup by
    ``sqrt(hidden)`` (``GemmaTextScaledWordEmbedding``), tied to the LM head; both split by vocabulary."""
    from transformers import GemmaConfig, GemmaForCausalLM

    cfg = GemmaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, head_dim=4, max_position_embeddings=SEQ,
    )
    return CausalLM(GemmaForCausalLM(cfg)), make_lm_dataset(vocab=VOCAB, seq=SEQ)


def _phi3() -> tuple[L.LightningModule, object]:
    """transformers' Phi-3: one fused ``qkv_proj`` with 8 query and 4 key/value heads, sliced by bounds its forward
    computes from config integers (``qkv[..., :query_pos]``, ...); a fused ``gate_up_proj`` chunked in two."""
    from transformers import Phi3Config, Phi3ForCausalLM

    cfg = Phi3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=SEQ, pad_token_id=0, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, tie_word_embeddings=False,
    )
    return CausalLM(Phi3ForCausalLM(cfg)), make_lm_dataset(vocab=VOCAB, seq=SEQ)


def _dbrx() -> tuple[L.LightningModule, object]:
    """transformers' DBRX: one fused ``Wqkv`` (8 query, 4 key/value heads), clamped, then split by sizes its forward
    computes (``split([hidden_size, kv_heads * head_dim, kv_heads * head_dim])``); mixture-of-experts MLPs."""
    from transformers import DbrxConfig, DbrxForCausalLM

    cfg = DbrxConfig(
        vocab_size=VOCAB, d_model=32, n_heads=8, n_layers=2, max_seq_len=SEQ, tie_word_embeddings=False,
        attn_config={"kv_n_heads": 4, "clip_qkv": 8.0, "rope_theta": 10000.0},
        ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
    )
    return CausalLM(DbrxForCausalLM(cfg)), make_lm_dataset(vocab=VOCAB, seq=SEQ)


class SizedQKV(nn.Module):
    """Grouped-query attention on one fused projection cut by sizes computed from integers, as vLLM-style code
    writes it: ``qkv.split([n_heads * head_dim, n_kv * head_dim, n_kv * head_dim], -1)`` or the same cuts as
    slices; RoPE-free, ``repeat_interleave`` for the groups."""

    def __init__(self, d: int = 32, heads: int = 8, kv_heads: int = 4, slices: bool = False) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim, self.slices = heads, kv_heads, d // heads, slices
        self.qkv = nn.Linear(d, (heads + 2 * kv_heads) * self.head_dim, bias=True)
        self.out = nn.Linear(d, d, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        qkv = self.qkv(x)
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        if self.slices:
            q, k, v = qkv[..., :q_size], qkv[..., q_size:q_size + kv_size], qkv[..., q_size + kv_size:]
        else:
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, T, -1))


class EinopsAttention(nn.Module):
    """Attention written the einops way (lucidrains' x-transformers): heads given to ``rearrange`` through an
    attribute (``h=self.heads``), a fused k|v chunked in two, partial rotary on the first ``rot_dim`` features of
    each head, ``einsum`` for the scores and the values."""

    def __init__(self, dim: int = 32, heads: int = 8, dim_head: int = 4, rot_dim: int = 2) -> None:
        super().__init__()
        self.heads, self.inner_dim, self.rot_dim = heads, heads * dim_head, rot_dim
        self.to_q = nn.Linear(dim, heads * dim_head, bias=False)
        self.to_kv = nn.Linear(dim, 2 * heads * dim_head, bias=False)
        self.to_out = nn.Linear(heads * dim_head, dim, bias=False)

    def rotary(self, t: torch.Tensor, dim_head: int) -> torch.Tensor:
        # rotary on the first rot_dim features of each head, scaled by the head width the code derives
        inv_freq = 1.0 / 10000 ** (torch.arange(0, self.rot_dim, 2, dtype=t.dtype, device=t.device) / dim_head)
        freqs = torch.einsum("i,j->ij", torch.arange(t.shape[-2], dtype=t.dtype, device=t.device), inv_freq)
        freqs = torch.cat((freqs, freqs), dim=-1)
        rot, rest = t[..., :self.rot_dim], t[..., self.rot_dim:]
        x1, x2 = rot.chunk(2, dim=-1)
        rot = rot * freqs.cos() + torch.cat((-x2, x1), dim=-1) * freqs.sin()
        return torch.cat((rot, rest), dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from einops import rearrange

        dim_head = self.inner_dim // self.heads  # a size derived from two attributes
        self.scale = dim_head**-0.5
        q, (k, v) = self.to_q(x), self.to_kv(x).chunk(2, dim=-1)
        q, k, v = (rearrange(t, "b n (h d) -> b h n d", h=self.heads) for t in (q, k, v))
        q, k = self.rotary(q, dim_head), self.rotary(k, dim_head)
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).triu(1)
        sim = torch.einsum("b h i d, b h j d -> b h i j", q, k) * self.scale
        attn = sim.masked_fill(causal, float("-inf")).softmax(dim=-1)
        out = torch.einsum("b h i j, b h j d -> b h i d", attn, v)
        return self.to_out(rearrange(out, "b h n d -> b n (h d)"))


class GroupedAttention(nn.Module):
    """Grouped-query attention fused per kv group, as Falcon's new decoder architecture lays it out: one projection
    whose output is ``groups`` runs of ``[q_1 .. q_n, k, v]``, viewed as ``(B, T, groups, n + 2, head_dim)`` and
    sliced along the per-group dim. Split by groups, each rank holds whole groups: no blocks to interleave."""

    def __init__(self, d: int = 32, heads: int = 8, groups: int = 4) -> None:
        super().__init__()
        self.per_group, self.head_dim = heads // groups + 2, d // heads
        self.qkv = nn.Linear(d, groups * self.per_group * self.head_dim, bias=False)
        self.out = nn.Linear(d, d, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        qkv = self.qkv(x).view(B, T, -1, self.per_group, self.head_dim)
        q, k, v = qkv[:, :, :, :-2], qkv[:, :, :, [-2]], qkv[:, :, :, [-1]]
        k, v = torch.broadcast_to(k, q.shape), torch.broadcast_to(v, q.shape)
        q, k, v = (t.flatten(2, 3).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, T, -1))


class EinopsLayersAttention(nn.Module):
    """Attention the x-transformers way: the heads split and merged by einops ``Rearrange`` layers built with
    ``h=heads`` (the count lives in the layer), the same count also kept as an attribute of the attention module,
    which its forward never reads; a fused q|k|v chunked in three, ``einsum`` scores and values."""

    def __init__(self, dim: int = 32, heads: int = 8, dim_head: int = 4) -> None:
        from einops.layers.torch import Rearrange

        super().__init__()
        self.heads, self.scale = heads, dim_head**-0.5
        self.to_qkv = nn.Linear(dim, 3 * heads * dim_head, bias=False)
        self.split_heads = Rearrange("b n (h d) -> b h n d", h=heads)
        self.merge_heads = Rearrange("b h n d -> b n (h d)")
        self.to_out = nn.Linear(heads * dim_head, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = map(self.split_heads, self.to_qkv(x).chunk(3, dim=-1))
        sim = torch.einsum("b h i d, b h j d -> b h i j", q, k) * self.scale
        causal = torch.ones(sim.shape[-2:], dtype=torch.bool, device=x.device).triu(1)
        attn = sim.masked_fill(causal, -torch.finfo(sim.dtype).max).softmax(dim=-1)
        return self.to_out(self.merge_heads(torch.einsum("b h i j, b h j d -> b h i d", attn, v)))


class EinopsWidthAttention(nn.Module):
    """einops given the head width instead of the count: ``rearrange(t, 'b n (h d) -> b h n d', d=dim_head)``
    infers ``h`` from the tensor's width (``t.shape[-1] // d``), so no attribute holds the head count at all."""

    def __init__(self, dim: int = 32, heads: int = 8, dim_head: int = 4) -> None:
        super().__init__()
        self.dim_head = dim_head
        self.to_qkv = nn.Linear(dim, 3 * heads * dim_head, bias=False)
        self.to_out = nn.Linear(heads * dim_head, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from einops import rearrange

        q, k, v = (rearrange(t, "b n (h d) -> b h n d", d=self.dim_head) for t in self.to_qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.to_out(rearrange(y, "b h n d -> b n (h d)"))


class EinopsConfigGQA(nn.Module):
    """einops with the counts read from a config object shared with the rest of the model, grouped-query heads
    repeated by ``einops.repeat``, and a config whose ``dim_head`` equals ``kv_heads`` (4): only the fields the code
    passes as head counts (``h=``) may go per rank."""

    def __init__(self, config: types.SimpleNamespace) -> None:
        super().__init__()
        self.config = config
        d, h, kv, dh = config.dim, config.heads, config.kv_heads, config.dim_head
        self.to_q = nn.Linear(d, h * dh, bias=False)
        self.to_kv = nn.Linear(d, 2 * kv * dh, bias=False)
        self.to_out = nn.Linear(h * dh, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from einops import rearrange, repeat

        q = rearrange(self.to_q(x), "b n (h d) -> b h n d", h=self.config.heads)
        k, v = (rearrange(t, "b n (h d) -> b h n d", h=self.config.kv_heads) for t in self.to_kv(x).chunk(2, dim=-1))
        k, v = (repeat(t, "b h n d -> b (h r) n d", r=self.config.heads // self.config.kv_heads) for t in (k, v))
        sim = torch.einsum("b h i d, b h j d -> b h i j", q, k) * self.config.dim_head**-0.5
        causal = torch.ones(sim.shape[-2:], dtype=torch.bool, device=x.device).triu(1)
        attn = sim.masked_fill(causal, -torch.finfo(sim.dtype).max).softmax(dim=-1)
        return self.to_out(rearrange(torch.einsum("b h i j, b h j d -> b h i d", attn, v), "b h n d -> b n (h d)"))


def einops_gqa_config() -> types.SimpleNamespace:
    """The config :class:`EinopsConfigGQA` reads (one object for every layer): 8 query heads, 4 key/value heads."""
    return types.SimpleNamespace(dim=32, heads=8, kv_heads=4, dim_head=4)


class AttentionLM(nn.Module):
    """Two pre-norm blocks around any attention module (``attention()`` builds one), a GELU MLP each, a token
    table and an LM head: the own models whose attention is the pattern under test."""

    def __init__(self, attention: Callable[[], nn.Module], vocab: int = VOCAB, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"norm": nn.LayerNorm(d), "attn": attention(), "norm2": nn.LayerNorm(d),
                           "mlp": nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))})
            for _ in range(2)
        )
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        for b in self.blocks:
            h = h + b["attn"](b["norm"](h))
            h = h + b["mlp"](b["norm2"](h))
        return types.SimpleNamespace(logits=self.head(h))


def _own_attention(attention: Callable[[], nn.Module]) -> Callable[[], tuple[L.LightningModule, object]]:
    return lambda: (CausalLM(AttentionLM(attention)), make_lm_dataset(vocab=VOCAB, seq=SEQ))


@dataclass
class LitConfig:
    """A litgpt-style config: one object every block, attention and MLP reads its sizes from (never copied)."""

    vocab_size: int = VOCAB
    block_size: int = SEQ
    n_layer: int = 2
    n_embd: int = 48
    n_head: int = 8
    n_query_groups: int = 4  # grouped-query attention: 2 query heads per key/value head
    head_size: int = 6
    intermediate_size: int = 96
    rotary_percentage: float = 1.0
    scale_embeddings: bool = True  # the model reads config.n_embd in its own forward

    @property
    def rope_n_elem(self) -> int:
        return int(self.rotary_percentage * self.head_size)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.size(-1) // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class LitAttention(nn.Module):
    """litgpt's CausalSelfAttention: every head count read from the shared config in forward. ``fused_groups``: the
    fused projection viewed per kv group, ``(B, T, n_query_groups, q_per_kv + 2, head_size)``, split along the
    per-group dim and expanded (litgpt up to 0.4); otherwise split by sizes into q|k|v, each viewed ``(B, T,
    heads, head_size)``, and repeat-interleaved (litgpt 0.5)."""

    def __init__(self, config: LitConfig, fused_groups: bool) -> None:
        super().__init__()
        shape = (config.n_head + 2 * config.n_query_groups) * config.head_size
        self.attn = nn.Linear(config.n_embd, shape, bias=True)
        self.proj = nn.Linear(config.head_size * config.n_head, config.n_embd, bias=False)
        self.config, self.fused_groups = config, fused_groups

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.size()
        qkv = self.attn(x)
        if self.fused_groups:
            q_per_kv = self.config.n_head // self.config.n_query_groups
            qkv = qkv.view(B, T, self.config.n_query_groups, q_per_kv + 2, self.config.head_size)
            qkv = qkv.permute(0, 2, 3, 1, 4)  # (B, groups, q_per_kv + 2, T, head_size)
            q, k, v = qkv.split((q_per_kv, 1, 1), dim=2)
            k = k.expand(B, self.config.n_query_groups, q_per_kv, T, self.config.head_size)
            v = v.expand(B, self.config.n_query_groups, q_per_kv, T, self.config.head_size)
            q, k, v = (t.reshape(B, -1, T, self.config.head_size) for t in (q, k, v))
        else:
            head_size, n_head, n_query_groups = self.config.head_size, self.config.n_head, self.config.n_query_groups
            q, k, v = qkv.split((n_head * head_size, n_query_groups * head_size, n_query_groups * head_size), dim=-1)
            q = q.view(B, T, n_head, head_size).transpose(1, 2)
            k = k.view(B, T, n_query_groups, head_size).transpose(1, 2)
            v = v.view(B, T, n_query_groups, head_size).transpose(1, 2)
            q_per_kv = n_head // n_query_groups
            k, v = k.repeat_interleave(q_per_kv, dim=1), v.repeat_interleave(q_per_kv, dim=1)
        n_elem = self.config.rope_n_elem
        q = torch.cat((_apply_rope(q[..., :n_elem], cos, sin), q[..., n_elem:]), dim=-1)
        k = torch.cat((_apply_rope(k[..., :n_elem], cos, sin), k[..., n_elem:]), dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, self.config.head_size * self.config.n_head)
        return self.proj(y)


class LitMLP(nn.Module):
    def __init__(self, config: LitConfig) -> None:
        super().__init__()
        self.fc_1 = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.fc_2 = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.proj = nn.Linear(config.intermediate_size, config.n_embd, bias=False)
        self.config = config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.silu(self.fc_1(x)) * self.fc_2(x))


class LitBlock(nn.Module):
    def __init__(self, config: LitConfig, fused_groups: bool) -> None:
        super().__init__()
        self.norm_1, self.norm_2 = nn.LayerNorm(config.n_embd), nn.LayerNorm(config.n_embd)
        self.attn, self.mlp = LitAttention(config, fused_groups), LitMLP(config)
        self.config = config

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm_1(x), cos, sin)
        return x + self.mlp(self.norm_2(x))


class LitGPT(nn.Module):
    """A tiny litgpt-style GPT: one :class:`LitConfig` object shared by the model, every block, attention and MLP
    (the model itself reads ``config.n_embd`` in forward), rotary embeddings computed in forward, untied head."""

    def __init__(self, config: LitConfig, fused_groups: bool) -> None:
        super().__init__()
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(config.vocab_size, config.n_embd),
            "h": nn.ModuleList(LitBlock(config, fused_groups) for _ in range(config.n_layer)),
            "ln_f": nn.LayerNorm(config.n_embd),
        })
        self.config = config

    def forward(self, input_ids: torch.Tensor) -> types.SimpleNamespace:
        T, n_elem = input_ids.size(1), self.config.rope_n_elem
        theta = 1.0 / 10000 ** (torch.arange(0, n_elem, 2, device=input_ids.device).double() / n_elem)
        freqs = torch.outer(torch.arange(T, device=input_ids.device).double(), theta).repeat(1, 2)
        cos, sin = freqs.cos().to(self.lm_head.weight.dtype), freqs.sin().to(self.lm_head.weight.dtype)
        x = self.transformer["wte"](input_ids)
        if self.config.scale_embeddings:
            x = x * torch.tensor(self.config.n_embd**0.5, dtype=x.dtype)
        for block in self.transformer["h"]:
            x = block(x, cos, sin)
        return types.SimpleNamespace(logits=self.lm_head(self.transformer["ln_f"](x)))


def _litgpt(fused_groups: bool) -> Callable[[], tuple[L.LightningModule, object]]:
    return lambda: (CausalLM(LitGPT(LitConfig(), fused_groups)), make_lm_dataset(vocab=VOCAB, seq=SEQ))


def _einops_config_gqa() -> tuple[L.LightningModule, object]:
    config = einops_gqa_config()
    return _own_attention(lambda: EinopsConfigGQA(config))()


def _bert() -> tuple[L.LightningModule, object]:
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=SEQ, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    return LabelsLM(BertForMaskedLM(cfg)), make_lm_dataset(vocab=VOCAB, seq=SEQ)


def _t5() -> tuple[L.LightningModule, object]:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, num_heads=4, d_ff=64, num_layers=2, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0,
    )
    return LabelsLM(T5ForConditionalGeneration(cfg)), make_lm_dataset(vocab=VOCAB, seq=SEQ)


def _t5_block(block: str) -> tuple[int, int]:
    """Encoder blocks: attention + MLP. Decoder blocks add cross-attention; the encoder output that every
    cross-attention's k/v reads enters the MP region once (one backward all-reduce, charged to block 0)."""
    if ".encoder." in f".{block}.":
        return (2, 2)
    return (3, 4) if block.endswith(".0") else (3, 3)


class _Out:
    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


class _Attention(nn.Module):
    """Separate q/k/v, ``view(B, T, -1, head_dim)`` and causal sdpa (the planner splits it by heads)."""

    def __init__(self, width: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.q, self.k, self.v, self.o = (nn.Linear(width, width, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class _Experts(nn.Module):
    """Stacked experts as transformers 5.x keeps them: ``gate_up`` (E, 2I, H), ``down`` (E, H, I), a loop over the
    experts that were hit, SiLU-gated, scaled by the routing weights and ``index_add_``-ed into a zero buffer."""

    def __init__(self, n_experts: int, width: int, inner: int) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(torch.randn(n_experts, 2 * inner, width) / width**0.5)
        self.down = nn.Parameter(torch.randn(n_experts, width, inner) / inner**0.5)

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(self.gate_up.shape[0]):
            token, slot = torch.where(index == e)
            if token.numel() == 0:
                continue
            gate, up = F.linear(x[token], self.gate_up[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down[e])
            out.index_add_(0, token, y * weights[token, slot, None])
        return out


class _MoE(nn.Module):
    """Router ``nn.Linear(width, experts)``, softmax, top-2 renormalised, then the experts."""

    def __init__(self, width: int, n_experts: int = 4, inner: int = 64, top_k: int = 2) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(width, n_experts, bias=False)
        self.experts = _Experts(n_experts, width, inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        flat = x.reshape(-1, C)
        probs = F.softmax(self.router(flat), dim=-1)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(flat, index, weights).reshape(B, T, C)


class _MoEBlock(nn.Module):
    def __init__(self, width: int, head_dim: int) -> None:
        super().__init__()
        self.norm1, self.attn = nn.RMSNorm(width), _Attention(width, head_dim)
        self.norm2, self.moe = nn.LayerNorm(width), _MoE(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.moe(self.norm2(x))


class MoELM(nn.Module):
    """embedding(64, 32) -> 2 x [norm -> attention -> residual; norm -> MoE -> residual] -> norm -> lm_head."""

    def __init__(self, vocab: int = VOCAB, width: int = 32, n_blocks: int = 2, head_dim: int = 8) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(_MoEBlock(width, head_dim) for _ in range(n_blocks))
        self.norm = nn.RMSNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> _Out:
        x = self.embed_tokens(input_ids)
        for block in self.blocks:
            x = block(x)
        return _Out(self.lm_head(self.norm(x)))


def _moe() -> tuple[L.LightningModule, object]:
    return CausalLM(MoELM()), make_lm_dataset(vocab=VOCAB, seq=SEQ)


def _mixtral() -> tuple[L.LightningModule, object]:
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=SEQ,
        tie_word_embeddings=False, output_router_logits=False,  # no router aux loss
    )
    cfg._experts_implementation = "eager"  # grouped_mm (the default) has no float64 kernel on CPU
    return CausalLM(MixtralForCausalLM(cfg)), make_lm_dataset(vocab=VOCAB, seq=SEQ)


def _mixtral_wide_router() -> tuple[L.LightningModule, object]:
    """Mixtral with its router computing in the training dtype (transformers casts router logits to float32)."""
    import types

    lm, data = _mixtral()
    for mod in lm.modules():
        if type(mod).__name__ == "MixtralTopKRouter":
            mod.forward = types.MethodType(_router_in_training_dtype, mod)
    return lm, data


def _router_in_training_dtype(self, hidden_states):
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)
    top, index = torch.topk(F.softmax(router_logits, dim=-1), self.top_k, dim=-1)
    return router_logits, top / top.sum(dim=-1, keepdim=True), index


def _gpt2() -> tuple[L.LightningModule, object]:
    """GPT-2: every projection is a ``Conv1D`` (weight stored (in, out), ``addmm``), c_attn fused q|k|v."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,  # use_cache stays True: the step builds a DynamicCache
    )
    return CausalLM(GPT2LMHeadModel(cfg)), make_lm_dataset(vocab=VOCAB, seq=SEQ)


def _gpt2_real_vocab() -> tuple[L.LightningModule, object]:
    """GPT-2 with its real vocabulary of 50,257 tokens (97% of this small model's parameters): the tied wte/lm_head is
    padded to a multiple of mp (Megatron's layout) and split by vocabulary, the padding masked out of the loss."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=GPT2_VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    return CausalLM(GPT2LMHeadModel(cfg), vocab=GPT2_VOCAB), make_lm_dataset(vocab=GPT2_VOCAB, seq=SEQ)


class EncoderLM(L.LightningModule):
    """torch's own layers: nn.Embedding -> nn.TransformerEncoder (causal mask) -> nn.Linear head, shifted loss."""

    def __init__(self, norm_first: bool, vocab: int = VOCAB, d: int = 32, lr: float = 3e-3) -> None:
        super().__init__()
        self.vocab, self.lr = vocab, lr
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True,
                                           norm_first=norm_first)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.lm_head = nn.Linear(d, vocab)

    def training_step(self, batch, batch_idx):
        ids = batch[0]
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], dtype=self.embed.weight.dtype)
        logits = self.lm_head(self.encoder(self.embed(ids), mask=mask, is_causal=True))
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, self.vocab), ids[:, 1:].reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


def _encoder(norm_first: bool, vocab: int = VOCAB) -> Callable[[], tuple[L.LightningModule, object]]:
    return lambda: (EncoderLM(norm_first, vocab=vocab), make_lm_dataset(vocab=vocab, seq=SEQ))


def _frozen_llama() -> tuple[L.LightningModule, object]:
    """Fine-tuning: the Llama above with every attention parameter frozen (``self_attn``'s q/k/v/o)."""
    module, data = _llama()
    for layer in module.net.model.layers:
        layer.self_attn.requires_grad_(False)
    return module, data


REAL_MODELS: dict[str, RealModel] = {
    "hf_llama": RealModel(_llama, 2),
    "hf_qwen3": RealModel(_qwen3, 2),
    "hf_gemma": RealModel(_gemma, 2, vocab=("net.model.embed_tokens", "net.lm_head")),
    "grouped_qkv": RealModel(_own_attention(GroupedAttention), 2),
    "sized_qkv_split": RealModel(_own_attention(lambda: SizedQKV(slices=False)), 2),
    "sized_qkv_slices": RealModel(_own_attention(lambda: SizedQKV(slices=True)), 2),
    "hf_phi3": RealModel(_phi3, 2),
    "einops_attention": RealModel(_own_attention(EinopsAttention), 2),
    # head counts held outside the attention module: by einops Rearrange layers (x-transformers), by one config
    # object every layer reads (litgpt, fused per kv group up to 0.4 and split by sizes since 0.5)
    "einops_layers": RealModel(_own_attention(EinopsLayersAttention), 2),
    "litgpt_grouped": RealModel(_litgpt(fused_groups=True), 2),
    "litgpt_split": RealModel(_litgpt(fused_groups=False), 2),
    "einops_width": RealModel(_own_attention(EinopsWidthAttention), 2),  # h inferred from d=
    "einops_config_gqa": RealModel(_einops_config_gqa, 2),
    "frozen_llama": RealModel(_frozen_llama, 2),
    "hf_bert": RealModel(_bert, 2),
    "hf_t5": RealModel(_t5, 4, per_block=_t5_block),
    "moe": RealModel(_moe, 2),
    # transformers routes in float32 whatever the training dtype (`router_logits.float()`): each MP rank's partial
    # gradient of the routing weights is rounded to float32 before the all-reduce sums them, one float32 ulp per
    # step off rounding the sum once; measured 1.5e-8 after 20 steps at mp=2, and 1.1e-15 with the router in
    # float64 (hf_moe_wide_router), which keeps the 1e-8 bound.
    "hf_moe": RealModel(_mixtral, 2, float64_tol=1e-7),
    "hf_moe_wide_router": RealModel(_mixtral_wide_router, 2),
    "hf_gpt2": RealModel(_gpt2, 2),
    "torch_encoder": RealModel(_encoder(False), 2),
    "torch_encoder_prenorm": RealModel(_encoder(True), 2),
    # a prime vocabulary, an untied head with a bias: table, head weight and head bias padded to a multiple of mp
    "torch_encoder_vocab61": RealModel(_encoder(False, vocab=61), 2, vocab=("embed", "lm_head")),
    "hf_gpt2_vocab50257": RealModel(_gpt2_real_vocab, 2, vocab=("net.transformer.wte", "net.lm_head")),
}


# Real models the planner tests use on their own: their blocks are not all split yet (DBRX's experts), so they stay
# out of the parity matrix above.
PLANNER_ONLY: dict[str, Callable[[], tuple[L.LightningModule, object]]] = {"hf_dbrx": _dbrx}
# Models other tests build by name: a 4-block Llama (pipeline stages, two per rank)
OTHERS: dict[str, Callable[[], tuple[L.LightningModule, object]]] = {"hf_llama4": _llama4}


def build_real(name: str) -> tuple[L.LightningModule, object]:
    torch.manual_seed(0)  # the same dense init in every process and in the reference
    return REAL_MODELS[name].build() if name in REAL_MODELS else {**PLANNER_ONLY, **OTHERS}[name]()
