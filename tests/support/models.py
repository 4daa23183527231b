"""Small models and data shared by the tests (importable from worker scripts as ``tests.support.models``)."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Block(nn.Module):
    """Pre-LN residual MLP block: x + fc2(dropout(gelu(fc1(ln(x)))))."""

    def __init__(self, width: int, hidden: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.act = nn.GELU()
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.drop(self.act(self.fc1(self.ln(x)))))


class ResMLP(L.LightningModule):
    """Residual MLP classifier; ``head`` has 3 outputs, not divisible by mp = 2 or 4."""

    def __init__(self, d_in: int = 12, width: int = 16, hidden: int = 32, n_blocks: int = 2, n_out: int = 3,
                 lr: float = 1e-2, dropout: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.inp = nn.Linear(d_in, width)
        self.blocks = nn.ModuleList(Block(width, hidden, dropout) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)


class ExpertMLP(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class MoEBlock(nn.Module):
    """Pre-LN residual top-1 mixture of experts, experts in a ``ModuleList``, run only on the tokens routed to them:
    on a small batch some experts get no token on one DP rank (or on every rank) and so no gradient."""

    def __init__(self, width: int, hidden: int, n_experts: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.router = nn.Linear(width, n_experts)
        self.experts = nn.ModuleList(ExpertMLP(width, hidden) for _ in range(n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        prob, choice = self.router(h).softmax(-1).max(-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            idx = (choice == e).nonzero(as_tuple=True)[0]
            if idx.numel() == 0:
                continue  # data-dependent: this expert's parameters get no gradient on this rank
            out = out.index_add(0, idx, expert(h[idx]) * prob[idx, None])
        return x + out


class MoEMLP(ResMLP):
    """ResMLP whose blocks are :class:`MoEBlock` (4 experts each)."""

    def __init__(self, n_experts: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MoEBlock(16, 32, n_experts) for _ in range(2))


class LayerDropMLP(ResMLP):
    """ResMLP that skips each block with probability 0.3 while training (LayerDrop, drawn from torch's RNG in the
    model's own forward, as transformers does): some steps leave a whole block without gradients."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            if self.training and torch.rand(()) < 0.3:
                continue
            x = block(x)
        return self.head(self.norm(x))


class CheckpointedMLP(ResMLP):
    """ResMLP whose blocks run under ``torch.utils.checkpoint`` (non-reentrant): recomputed in the backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        x = self.inp(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(self.norm(x))


class SharedReentrantMLP(ResMLP):
    """ResMLP whose first block is applied three times (weights shared across depth, as ALBERT does), each call under
    ``torch.utils.checkpoint`` with ``use_reentrant=True``: each call's backward is its own backward pass, so the
    block's parameters get their gradients, and their post-accumulate hooks fire, three times in one step."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        x = self.inp(x)
        for _ in range(3):
            x = checkpoint(self.blocks[0], x, use_reentrant=True)
        x = self.blocks[1](x)
        return self.head(self.norm(x))


class CheckpointedMoE(MoEMLP):
    """:class:`MoEMLP` with each block under ``torch.utils.checkpoint`` (non-reentrant)."""

    forward = CheckpointedMLP.forward


class ScaledBlock(Block):
    """:class:`Block` whose residual branch is multiplied by a per-feature ``scale`` read in the block's own
    forward, after a submodule call: no layer call covers that read (what a recompute outside ``nn.Module.__call__``
    must still run like the forward)."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__(width, hidden)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.ln(x)))) * self.scale


class ScaledMLP(ResMLP):
    """ResMLP with 4 :class:`ScaledBlock` blocks."""

    def __init__(self) -> None:
        super().__init__(n_blocks=4)
        self.blocks = nn.ModuleList(ScaledBlock(16, 32) for _ in range(4))


class ChainMLP(L.LightningModule):
    """``n`` Linears in a row, GELU after all but the last two: ``L1 -> GELU -> ... -> L(n-1) -> Ln -> cross-entropy``.

    Every layer but the first could be the row end of the previous one and the start of the next: one role each.
    """

    def __init__(self, n: int = 4, d_in: int = 12, width: int = 16, n_out: int = 4, lr: float = 1e-2) -> None:
        super().__init__()
        sizes = [d_in] + [width] * (n - 1) + [n_out]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 2:
                x = F.gelu(x)
        return x

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


class HeadScaled(L.LightningModule):
    """A head-wise MLP whose code divides by the *number of heads it sees*: ``h / h.shape[-2]``.

    Structurally a paired region (reshape to heads, element-wise, reshape back), but its value depends on the local
    width, so the split first step disagrees with the dense one: verification must fall back and say why.
    """

    def __init__(self, d_in: int = 12, hidden: int = 16, n_out: int = 4, lr: float = 1e-2) -> None:
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(d_in, hidden), nn.Linear(hidden, d_in), nn.Linear(d_in, n_out)
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        h = F.gelu(self.fc1(x)).view(B, T, -1, 4)
        h = (h / h.shape[-2]).reshape(B, T, -1)
        return self.head(self.fc2(h).mean(1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


class AliasedLM(nn.Module):
    """One token table under four names, the T5 way: ``shared`` is never called itself. ``dec.embed_tokens`` is the
    same module object, ``enc.embed_tokens`` a distinct module holding the same weight, ``head`` an LM head tied to it.
    """

    def __init__(self, vocab: int = 64, dim: int = 32) -> None:
        super().__init__()
        self.shared = nn.Embedding(vocab, dim)
        self.enc, self.dec = nn.Module(), nn.Module()
        self.enc.embed_tokens = nn.Embedding(vocab, dim)
        self.enc.embed_tokens.weight = self.shared.weight
        self.dec.embed_tokens = self.shared
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.shared.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.enc.embed_tokens(ids) + 0.5 * self.dec.embed_tokens(ids.flip(-1))
        return self.head(x + self.fc2(F.gelu(self.fc1(x))))


def make_dataset(n: int = 160, d_in: int = 12, n_out: int = 3, seed: int = 1234) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    w = torch.randn(d_in, n_out, generator=g)
    y = (x @ w + 0.3 * torch.randn(n, n_out, generator=g)).argmax(-1)
    return TensorDataset(x, y)


def reference_loader(ds: TensorDataset, global_batch: int, seed: int) -> DataLoader:
    """The single-process loader drawing the permutation Lightning's DistributedSampler draws in multi-process runs."""
    sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=seed)
    return DataLoader(ds, batch_size=global_batch, sampler=sampler)


class LMModule(L.LightningModule):
    """Next-token prediction around any ``net(ids) -> logits``; AdamW + a linear-warmup LR schedule."""

    def __init__(self, net: nn.Module, lr: float = 3e-3) -> None:
        super().__init__()
        self.net, self.lr = net, lr

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.net(ids)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class LlamaBlock(nn.Module):
    """Grouped-query attention (separate q/k/v, kv heads repeated) and a gated SiLU MLP, no biases."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.head_dim, self.n_rep = dim // n_heads, n_heads // n_kv_heads
        self.attn_norm, self.mlp_norm = RMSNorm(dim), RMSNorm(dim)
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        h = self.attn_norm(x)
        q = self.wq(h).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.wk(h).view(B, T, -1, self.head_dim).transpose(1, 2).repeat_interleave(self.n_rep, dim=1)
        v = self.wv(h).view(B, T, -1, self.head_dim).transpose(1, 2).repeat_interleave(self.n_rep, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(B, T, -1))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class FusedBlock(nn.Module):
    """Pre-LN block with one fused qkv projection split by ``chunk(3, -1)``."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        # no qkv bias: the key bias has an exactly-zero gradient (softmax ignores it), which AdamW turns from
        # rounding noise into lr-sized steps in float32, making any two float32 runs differ by ~1e-4
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in self.qkv(self.ln1(x)).chunk(3, dim=-1))
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class FusedLM(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, n_layers: int = 2, n_heads: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(FusedBlock(dim, n_heads) for _ in range(n_layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        x = self.tok(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class TinyLlama(nn.Module):
    def __init__(
        self, vocab: int = 64, dim: int = 32, n_layers: int = 2, n_heads: int = 4, n_kv_heads: int = 2
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(LlamaBlock(dim, n_heads, n_kv_heads, 2 * dim) for _ in range(n_layers))
        self.norm = RMSNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        x = self.tok(ids)
        for layer in self.layers:
            x = layer(x)
        return self.out(self.norm(x))


def make_lm_dataset(n: int = 160, vocab: int = 64, seq: int = 16, seed: int = 1234) -> TensorDataset:
    """A learnable synthetic language: each next token is a fixed function of the previous two, plus noise."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, seq + 1), generator=g)
    for t in range(2, seq + 1):
        rule = (3 * ids[:, t - 1] + ids[:, t - 2]) % vocab
        keep = torch.rand(n, generator=g) < 0.8
        ids[:, t] = torch.where(keep, rule, ids[:, t])
    return TensorDataset(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())


class Seq2SeqLM(L.LightningModule):
    """An encoder-decoder trained to map ``x`` to ``y`` (teacher forcing: the decoder reads ``y`` shifted right)."""

    def __init__(self, net: nn.Module, lr: float = 3e-3) -> None:
        super().__init__()
        self.net, self.lr = net, lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        dec = torch.cat([torch.zeros_like(y[:, :1]), y[:, :-1]], dim=1)
        logits = self.net(input_ids=x, decoder_input_ids=dec).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


def _tiny_t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)  # the same dense init in every process and in the reference
    cfg = T5Config(vocab_size=64, d_model=32, d_kv=8, num_heads=4, d_ff=64, num_layers=2, dropout_rate=0.0)
    return T5ForConditionalGeneration(cfg)


def freeze_attention(module: nn.Module) -> nn.Module:
    """Fine-tuning style: every parameter of the attention modules (q/k/v/out) gets ``requires_grad=False``."""
    for name, mod in module.named_modules():
        if name.endswith(".attn"):
            mod.requires_grad_(False)
    return module


def build(name: str) -> tuple[L.LightningModule, TensorDataset]:
    """Test models by name: resmlp, gpt (tied), gpt4 (gpt with 4 blocks), gpt_untied, llama (GQA + gated MLP),
    fused (one qkv projection),
    gpt_frozen (gpt_untied with frozen attention), gpt_vocab61 (gpt with 61 tokens), moe_list (ResMLP with top-1
    ModuleList experts), layerdrop (ResMLP skipping blocks at random), resmlp_ckpt (blocks under
    torch.utils.checkpoint), moe_ckpt (moe_list so), shared_reentrant (one block applied three times, each call
    under reentrant checkpointing), resmlp_scaled (4 blocks reading their own
    ``scale`` parameter directly), llama_gc (transformers' Llama with gradient checkpointing)."""
    if name == "resmlp":
        return ResMLP(), make_dataset()
    if name == "moe_list":
        return MoEMLP(), make_dataset()
    if name == "layerdrop":
        return LayerDropMLP(n_blocks=4), make_dataset()
    if name == "resmlp_ckpt":
        return CheckpointedMLP(), make_dataset()
    if name == "moe_ckpt":
        return CheckpointedMoE(), make_dataset()
    if name == "shared_reentrant":
        return SharedReentrantMLP(), make_dataset()
    if name == "resmlp_scaled":
        return ScaledMLP(), make_dataset()
    if name == "llama_gc":  # transformers' gradient checkpointing (non-reentrant) on its Llama
        from tests.support.real_models import build_real

        module, data = build_real("hf_llama")
        module.net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return module, data
    if name in ("gpt", "gpt_untied", "gpt_frozen", "gpt_vocab61", "gpt4"):
        from examples.models.gpt import GPT

        vocab = 61 if name == "gpt_vocab61" else 64  # 61: no mp > 1 divides it (the tied table and head are padded)
        net = GPT(vocab_size=vocab, block_size=16, n_layer=4 if name == "gpt4" else 2, n_head=4, n_embd=32,
                  dropout=0.0,
                  tie_embeddings=name in ("gpt", "gpt_vocab61", "gpt4"))
        return LMModule(freeze_attention(net) if name == "gpt_frozen" else net), make_lm_dataset(vocab=vocab)
    if name == "llama":
        return LMModule(TinyLlama()), make_lm_dataset()
    if name == "aliased":
        return LMModule(AliasedLM()), make_lm_dataset()
    if name == "t5":
        return Seq2SeqLM(_tiny_t5()), make_lm_dataset()
    if name == "headscaled":
        ds = make_dataset(n_out=4)
        x = ds.tensors[0].view(-1, 1, 12).repeat(1, 4, 1) * torch.arange(1.0, 5.0).view(1, 4, 1)
        return HeadScaled(), TensorDataset(x, ds.tensors[1])
    if name.startswith("chain"):  # chain2 .. chain5
        return ChainMLP(int(name[len("chain"):] or 4)), make_dataset(n_out=4)
    if name == "fused":
        return LMModule(FusedLM()), make_lm_dataset()
    from tests.support.real_models import OTHERS, REAL_MODELS, build_real

    if name in REAL_MODELS or name in OTHERS:
        return build_real(name)
    raise ValueError(name)
