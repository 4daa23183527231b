"""An analytic cost model for (dp, mp) layouts of a GPT-like transformer, and a recommended layout.

For every valid ``(dp, mp)`` with ``dp * mp == devices`` it predicts, per optimizer step and per rank:

* **compute**: ``6 * N_matmul * tokens + 12 * layers * seq^2 * hidden * sequences`` FLOPs (forward + backward;
  the attention score/value matmuls in the second term), the MP-split part divided by ``dp * mp``, the rest
  (norms, position table, replicated head) by ``dp`` only, at the device's effective FLOP rate; plus the
  optimizer step (AdamW reads and writes ~7 words per local parameter) at the device's memory bandwidth;
* **MP communication**: the Megatron minimum, 2 all-reduces forward and 2 backward per block of
  ``sequences/dp * seq * hidden`` activations (with sequence parallelism 2 all-gathers + 2 reduce-scatters each
  way, the same bytes), plus the vocab-parallel embedding and loss; ring cost ``2 (mp-1)/mp * bytes / bw`` and
  ``2 (mp-1)`` latencies per all-reduce, on the intra-node link when an MP group fits in a node;
* **DP communication**: one ring all-reduce of the local gradients (``params/mp``) over ``dp`` ranks, on the
  inter-node link as soon as a DP group spans nodes; DDP overlaps it with the backward pass, so only what
  exceeds the backward compute is exposed (``overlap_dp=True``);
* **memory**: parameters, gradients and AdamW state of the local shard (``bytes_per_param``: 16 for bf16 mixed
  precision with fp32 master weights and moments, 16 for fp32 too: 4 + 4 + 8), and activations after Korthikanti
  et al. 2022 (``seq * mb * hidden * (10 + 24/mp + 5 * heads * seq / (hidden * mp))`` bytes per layer for 16-bit
  activations, ``34/mp`` instead of ``10 + 24/mp`` with sequence parallelism, doubled for fp32), plus the logits.

The recommendation is the layout with the smallest predicted step time among those whose memory fits; ties go to
the smaller ``mp``.

Use it from Python::

    from lightning_dpmp.tools.costmodel import GPTShape, Hardware, recommend
    best, table = recommend(GPTShape(layers=24, hidden=2048, heads=16, vocab=50304, seq=2048, batch=512),
                            Hardware.preset("dgx-a100", devices=64))
    trainer = L.Trainer(devices=8, num_nodes=8, strategy=best.strategy())   # DPMPStrategy(dp=best.dp, mp=best.mp)

or from the command line (``python -m lightning_dpmp.costmodel --help``, :mod:`lightning_dpmp.tools.costmodel_cli`)::

    python -m lightning_dpmp.costmodel --model gpt-1.3b --hardware dgx-a100 --devices 64

This model plans *before* launch, from a shape and preset link figures, at a fixed global batch.
``DPMPStrategy(dp="auto", mp="auto")`` chooses at setup instead, from the traced model's own plan at every ``mp``
and links it measures itself, at the loader's fixed per-rank batch (so by tokens/s):
:mod:`lightning_dpmp.planner.cost` holds that model, and both share one ring formula (:func:`ring_s`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from lightning_dpmp.planner.cost import ring_s

__all__ = ["GPTShape", "Hardware", "Layout", "predict", "recommend", "valid_layouts"]


@dataclass(frozen=True)
class GPTShape:
    """The shape of a GPT-like decoder (the sizes the cost depends on).

    Args:
        layers: transformer blocks.
        hidden: model width.
        heads: attention heads (``mp`` must divide it).
        vocab: vocabulary (split by vocabulary when ``mp`` divides it, replicated otherwise).
        seq: tokens per sequence.
        batch: sequences per optimizer step, over all DP ranks (the global batch).
        ffn: feed-forward width; ``4 * hidden`` when ``None``.
        micro_batch: sequences per forward pass on one rank (gradient accumulation over ``batch / (dp *
            micro_batch)`` micro-batches); ``None`` = the whole local batch in one pass.
        tied: input and output embeddings share one matrix.
        act_bytes: bytes per activation element (2 for bf16/fp16, 4 for fp32).
        bytes_per_param: bytes per parameter for weights + gradients + AdamW state (16 for bf16 mixed precision
            with fp32 master weights and moments; 16 for fp32: 4 weight + 4 gradient + 8 moments).
        grad_bytes: bytes per gradient element on the wire (2 for bf16 gradients, 4 for fp32).
        recompute: full activation recomputation (keeps only block inputs; one more forward pass).
    """

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    batch: int
    ffn: Optional[int] = None
    micro_batch: Optional[int] = None
    tied: bool = True
    act_bytes: int = 2
    bytes_per_param: int = 16
    grad_bytes: int = 2
    recompute: bool = False

    @property
    def ffn_width(self) -> int:
        return self.ffn if self.ffn is not None else 4 * self.hidden

    @property
    def block_params(self) -> int:
        """Split parameters of one block: q/k/v/out (4 h^2 + 3h column biases) and fc1/fc2 (2 h f + f)."""
        h, f = self.hidden, self.ffn_width
        return 4 * h * h + 3 * h + 2 * h * f + f

    @property
    def replicated_block_params(self) -> int:
        """Two LayerNorms (weight + bias) and the two row-layer biases."""
        return 4 * self.hidden + 2 * self.hidden

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def params(self) -> int:
        """All parameters (position table and final norm included)."""
        return (self.layers * (self.block_params + self.replicated_block_params) + self.embedding_params
                + self.seq * self.hidden + 2 * self.hidden)

    @classmethod
    def from_module(cls, module: Any, seq: int, batch: int, heads: Optional[int] = None, **kwargs: Any) -> "GPTShape":
        """Read the shape off a GPT-like ``nn.Module``: vocab and hidden from the largest ``nn.Embedding``, layers
        from the longest ``nn.ModuleList``, ffn from the widest Linear reading ``hidden`` features, heads from an
        attribute named ``n_head``/``num_heads``/``num_attention_heads``/``n_heads`` (or ``head_dim``) unless given.
        """
        from torch import nn

        embs = [m for m in module.modules() if isinstance(m, nn.Embedding)]
        if not embs:
            raise ValueError("GPTShape.from_module needs an nn.Embedding (the token table) to read vocab and hidden.")
        emb = max(embs, key=lambda m: m.num_embeddings * m.embedding_dim)
        vocab, hidden = emb.num_embeddings, emb.embedding_dim
        layers = max((len(m) for m in module.modules() if isinstance(m, nn.ModuleList)), default=1)
        wide = [m.out_features for m in module.modules() if isinstance(m, nn.Linear) and m.in_features == hidden
                and m.out_features > hidden and m.out_features != vocab]
        ffn = max(wide) if wide else 4 * hidden
        if heads is None:
            for m in module.modules():
                for name in ("n_head", "num_heads", "num_attention_heads", "n_heads"):
                    if isinstance(getattr(m, name, None), int):
                        heads = getattr(m, name)
                        break
                if heads is None and isinstance(getattr(m, "head_dim", None), int):
                    heads = hidden // m.head_dim
                if heads is not None:
                    break
        if heads is None:
            raise ValueError("GPTShape.from_module could not find the number of heads; pass heads=...")
        tied = any(
            isinstance(m, nn.Linear) and m.weight is emb.weight for m in module.modules()
        )
        return cls(layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq=seq, batch=batch, ffn=ffn, tied=tied,
                   **kwargs)


# name -> (devices_per_node, memory GB, effective FLOP/s, memory B/s, intra B/s, inter B/s, intra s, inter s)
_PRESETS: dict[str, dict[str, float]] = {
    # DGX A100: bf16 peak 312 TFLOP/s at ~45% MFU; NVLink3 300 GB/s per direction (NCCL bus bw ~230 GB/s);
    # 8x HDR InfiniBand 200 Gb/s = 25 GB/s per GPU (~22 GB/s achieved); HBM2e 2 TB/s.
    "dgx-a100": dict(devices_per_node=8, memory_gb=80, flops=140e12, mem_bw=2.0e12, intra_bw=230e9, inter_bw=22e9,
                     intra_latency=2e-6, inter_latency=5e-6),
    # DGX H100: bf16 dense peak 989 TFLOP/s at ~40% MFU; NVLink4 450 GB/s per direction (~360 GB/s bus bw);
    # 8x NDR 400 Gb/s = 50 GB/s per GPU (~45 GB/s achieved); HBM3 3.35 TB/s.
    "dgx-h100": dict(devices_per_node=8, memory_gb=80, flops=400e12, mem_bw=3.35e12, intra_bw=360e9, inter_bw=45e9,
                     intra_latency=2e-6, inter_latency=5e-6),
}


@dataclass(frozen=True)
class Hardware:
    """Devices and links.

    Args:
        devices: total devices (the world size).
        devices_per_node: devices sharing the fast intra-node link.
        memory_gb: memory per device, GiB.
        flops: effective FLOP/s one device sustains on the model's matmuls (peak x achievable utilisation).
        mem_bw: device memory bandwidth, bytes/s (the optimizer step is bandwidth-bound).
        intra_bw, inter_bw: achieved per-device collective bandwidth (NCCL "bus bandwidth") inside a node and
            across nodes, bytes/s.
        intra_latency, inter_latency: per-message latency of one ring step, seconds.
    """

    devices: int
    devices_per_node: int
    memory_gb: float
    flops: float
    mem_bw: float
    intra_bw: float
    inter_bw: float
    intra_latency: float = 2e-6
    inter_latency: float = 5e-6

    @classmethod
    def preset(cls, name: str, devices: int, **overrides: Any) -> "Hardware":
        """``"dgx-a100"`` or ``"dgx-h100"`` figures for ``devices`` GPUs; any field can be overridden."""
        if name not in _PRESETS:
            raise ValueError(f"unknown hardware preset {name!r}; known: {sorted(_PRESETS)}")
        values = dict(_PRESETS[name])
        values.update(overrides)
        return cls(devices=devices, **values)  # type: ignore[arg-type]


@dataclass
class Layout:
    """The prediction for one ``(dp, mp)``; times in seconds per optimizer step, memory in bytes per rank."""

    dp: int
    mp: int
    compute_s: float
    optimizer_s: float
    mp_comm_s: float
    dp_comm_s: float
    dp_exposed_s: float
    step_s: float
    mp_bytes: int
    dp_bytes: int
    param_bytes: int
    state_bytes: int
    activation_bytes: int
    memory_bytes: int
    fits: bool
    tokens_per_s: float
    notes: list[str] = field(default_factory=list)

    def strategy(self, **kwargs: Any) -> Any:
        """``DPMPStrategy(dp=self.dp, mp=self.mp, **kwargs)``, by its registered name (``"dpmp"``, registered when
        the package is imported): ``tools`` sits below ``integration``, which asks the estimator at setup."""
        from lightning.pytorch.strategies import StrategyRegistry

        return StrategyRegistry["dpmp"]["strategy"](dp=self.dp, mp=self.mp, **kwargs)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_layouts(shape: GPTShape, devices: int) -> list[tuple[int, int]]:
    """``(dp, mp)`` with ``dp * mp == devices``, ``mp`` dividing heads, hidden and ffn, ``dp`` dividing the batch."""
    out = []
    for mp in _divisors(devices):
        dp = devices // mp
        if shape.heads % mp or shape.hidden % mp or shape.ffn_width % mp or shape.batch % dp:
            continue
        if shape.micro_batch is not None and (shape.batch // dp) % shape.micro_batch:
            continue
        out.append((dp, mp))
    return out


def _ring_allreduce_s(nbytes: float, n: int, bw: float, latency: float) -> float:
    return ring_s(nbytes, n, bw, latency, "all_reduce")  # the formula mp="auto" ranks with, too


def predict(shape: GPTShape, hw: Hardware, dp: int, mp: int, sequence_parallel: bool = False,
            overlap_dp: bool = True) -> Layout:
    """Predict step time, communication and memory of ``shape`` at ``(dp, mp)`` on ``hw``."""
    if dp * mp != hw.devices:
        raise ValueError(f"dp*mp = {dp}*{mp} != devices = {hw.devices}")
    s, h, L, V = shape.seq, shape.hidden, shape.layers, shape.vocab
    notes: list[str] = []
    local_seqs = shape.batch / dp                       # sequences one DP rank processes per step
    mb = shape.micro_batch or local_seqs                # sequences per forward pass
    micro_steps = max(1, round(local_seqs / mb))
    vocab_split = V % mp == 0
    if not vocab_split and mp > 1:
        notes.append(f"vocab {V} not divisible by mp={mp}: embedding and head replicated")

    # ---- compute: split matmuls /(dp*mp); attention scores split by heads; the rest (norms, pos) /dp
    tokens_rank = local_seqs * s
    split_matmul = L * shape.block_params + (V * h if vocab_split else 0)
    rep_matmul = 0 if vocab_split else V * h
    attn = 12 * L * s * h  # per token, forward + backward (QK^T and AV, each 2*s*h per token forward)
    passes = 4 / 3 if shape.recompute else 1.0      # recomputation adds one forward (1/3 of fwd+bwd)
    flops = passes * tokens_rank * (6 * split_matmul / mp + attn / mp + 6 * rep_matmul)
    compute_s = flops / hw.flops
    # ---- optimizer: AdamW reads p, g, m, v and writes p, m, v: ~7 words of 4 bytes per local parameter
    local_params = L * (shape.block_params / mp + shape.replicated_block_params) + (
        shape.embedding_params / mp if vocab_split else shape.embedding_params) + s * h + 2 * h
    optimizer_s = local_params * 28 / hw.mem_bw

    # ---- MP: 4 activation all-reduces per block (2 fwd + 2 bwd), + embedding (1 fwd) + head input grad (1 bwd)
    act = mb * s * h * shape.act_bytes
    n_act = 4 * L + (2 if vocab_split else 0)
    loss_stats = mb * s * 4 * 4 if vocab_split else 0   # the loss's MAX and SUM all-reduces, fp32 per token
    mp_bytes_per_micro = n_act * act + loss_stats
    mp_in_node = mp <= hw.devices_per_node and hw.devices_per_node % mp == 0
    mp_bw, mp_lat = (hw.intra_bw, hw.intra_latency) if mp_in_node else (hw.inter_bw, hw.inter_latency)
    if mp > 1 and not mp_in_node:
        notes.append("MP group spans nodes")
    n_msgs = n_act + (2 if vocab_split else 0)
    mp_comm_s = micro_steps * (
        n_act * _ring_allreduce_s(act, mp, mp_bw, 0) + (2 * _ring_allreduce_s(loss_stats / 2, mp, mp_bw, 0))
        + n_msgs * (2 * (mp - 1) * mp_lat if mp > 1 else 0)
    )
    mp_bytes = int(micro_steps * mp_bytes_per_micro) if mp > 1 else 0

    # ---- DP: one all-reduce of the local gradients per optimizer step (DDP buckets), overlapped with backward
    grad_bytes = local_params * shape.grad_bytes
    dp_in_node = dp * mp <= hw.devices_per_node
    dp_bw, dp_lat = (hw.intra_bw, hw.intra_latency) if dp_in_node else (hw.inter_bw, hw.inter_latency)
    buckets = max(1, math.ceil(grad_bytes / (25 * 2**20)))
    dp_comm_s = _ring_allreduce_s(grad_bytes, dp, dp_bw, 0) + (buckets * 2 * (dp - 1) * dp_lat if dp > 1 else 0)
    backward_s = compute_s * (2 / 3) / micro_steps     # only the last micro-batch's backward overlaps
    dp_exposed_s = max(0.0, dp_comm_s - backward_s) if overlap_dp else dp_comm_s
    step_s = compute_s + optimizer_s + mp_comm_s + dp_exposed_s

    # ---- memory
    param_bytes = int(local_params * shape.act_bytes)
    state_bytes = int(local_params * shape.bytes_per_param)
    if shape.recompute:
        per_layer = 2 * s * mb * h * (1 if not sequence_parallel else 1 / mp)
    else:
        a = shape.heads
        lin = 34 / mp if sequence_parallel else 10 + 24 / mp
        per_layer = s * mb * h * (lin + 5 * a * s / (h * mp))
    per_layer *= shape.act_bytes / 2
    logits = mb * s * (V / mp if vocab_split else V) * 4 * 2   # fp32 logits and their softmax gradient
    activation_bytes = int(L * per_layer + logits)
    memory_bytes = state_bytes + activation_bytes
    fits = memory_bytes <= hw.memory_gb * 2**30
    if not fits:
        notes.append("does not fit in memory")
    return Layout(
        dp=dp, mp=mp, compute_s=compute_s, optimizer_s=optimizer_s, mp_comm_s=mp_comm_s, dp_comm_s=dp_comm_s,
        dp_exposed_s=dp_exposed_s, step_s=step_s, mp_bytes=mp_bytes, dp_bytes=int(grad_bytes) if dp > 1 else 0,
        param_bytes=param_bytes, state_bytes=state_bytes, activation_bytes=activation_bytes,
        memory_bytes=memory_bytes, fits=fits, tokens_per_s=shape.batch * s / step_s, notes=notes,
    )


def recommend(shape: GPTShape, hw: Hardware, sequence_parallel: bool = False,
              overlap_dp: bool = True) -> tuple[Optional[Layout], list[Layout]]:
    """``(best, all layouts)``: the fastest predicted layout that fits in memory (``None`` if none fits)."""
    table = [predict(shape, hw, dp, mp, sequence_parallel, overlap_dp) for dp, mp in valid_layouts(shape, hw.devices)]
    fitting = [t for t in table if t.fits]
    best = min(fitting, key=lambda t: (round(t.step_s, 12), t.mp)) if fitting else None
    return best, table
