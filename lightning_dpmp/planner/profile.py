"""What one training step of a model holds and computes, read from meta tensors: the input of the layout estimator.

:func:`profile_step` runs the forward pass of a step once on the ``meta`` device (nothing is allocated) and records,
under a ``TorchFunctionMode`` and autograd's saved-tensor hooks:

* the repeated blocks (the children of the longest ``nn.ModuleList``): the parameters each holds, split or
  replicated over MP, the bytes autograd saves for backward per sequence, split or replicated over MP (replicated
  tensors are the token-wise ones, 1/mp with sequence parallelism), the block input (what recomputation keeps),
  the forward FLOPs and the MP collectives per block;
* the rest: the token table and LM head (split by vocabulary when ``mp`` divides it), other parameters, the
  logits and loss tensors saved, the head's FLOPs.

Which tensors are split over MP follows the data flow, Megatron's rule, not module names: a Linear reading a
replicated input is a column layer (its output is split, its input gradient is all-reduced backward), a Linear
reading a split input is a row layer (its output all-reduced forward, replicated); any other op's output is split
when one of its inputs is. ``scaled_dot_product_attention`` is charged what a fused (flash) kernel saves
(q, k, v, the output and a float32 log-sum-exp per row), not the math fallback the meta device runs.

Data-dependent reads (``.item()``, ``bool(t)``) on meta tensors answer the dense, unpadded case (``0``/``True``):
a step that branches on its data is profiled along one branch.

Example:
    >>> from lightning_dpmp.planner.gpt_shape import GPTShape
    >>> p = ModelProfile.from_gpt(GPTShape(layers=2, hidden=64, heads=4, vocab=128, seq=32, batch=8))
    >>> p.layers, p.block_split_params, p.mp_allreduces_per_block
    (2, 49600, (2, 2))
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_dpmp.compat import storage_identity, tree_leaves
from lightning_dpmp.planner.gpt_shape import GPTShape

__all__ = ["ModelProfile", "config_sizes", "profile_config", "profile_step", "token_tensor"]


@dataclass(frozen=True)
class ModelProfile:
    """Sizes of one model's training step, per sequence of ``seq`` tokens (the estimator scales them).

    Attributes:
        layers: repeated blocks.
        hidden: width of the residual stream.
        vocab: vocabulary (the head and token table are split by vocabulary when ``mp`` divides it).
        seq: tokens per sequence profiled.
        heads, kv_heads, ffn: sizes ``mp`` must divide (attention heads, key/value heads, feed-forward width).
        block_split_params, block_replicated_params: parameters of one block split over MP (dense count) and whole.
        vocab_params: parameters of the token table and of an untied head (split by vocabulary).
        other_params: every other parameter (final norm, position table), whole on every rank.
        block_act_split, block_act_tokenwise: bytes one block saves for backward per sequence, split over MP /
            replicated over MP (token-wise: 1/mp with sequence parallelism).
        block_input_bytes: bytes of one block's input per sequence (what recomputation keeps).
        rest_act: bytes saved outside the blocks per sequence (embeddings, final norm), replicated.
        logits_act: bytes of vocabulary-wide tensors saved per sequence (logits, softmax), split with the head.
        block_flops_split, block_flops_replicated: forward FLOPs of one block per sequence (split ones /mp).
        head_flops: forward FLOPs of the LM head per sequence (/mp when the vocabulary is split).
        mp_allreduces_per_block: (forward, backward) MP all-reduces of one block (row layers, column inputs).
        param_bytes: bytes per parameter element in the profiled dtype.
        act_bytes: bytes per element of the residual stream (for MP/PP messages).
        tied: the head reads the token table.
    """

    layers: int
    hidden: int
    vocab: int
    seq: int
    heads: int
    kv_heads: int
    ffn: int
    block_split_params: int
    block_replicated_params: int
    vocab_params: int
    other_params: int
    block_act_split: float
    block_act_tokenwise: float
    block_input_bytes: float
    rest_act: float
    logits_act: float
    block_flops_split: float
    block_flops_replicated: float
    head_flops: float
    mp_allreduces_per_block: tuple[int, int] = (2, 2)
    param_bytes: int = 4
    act_bytes: int = 4
    tied: bool = False

    @property
    def params(self) -> int:
        """All parameters."""
        return (self.layers * (self.block_split_params + self.block_replicated_params) + self.vocab_params
                + self.other_params)

    def model_flops_per_token(self) -> float:
        """Forward + backward FLOPs per token, recomputation not counted (3x the forward)."""
        return 3 * (self.layers * (self.block_flops_split + self.block_flops_replicated) + self.head_flops) / self.seq

    def at_seq(self, seq: int) -> "ModelProfile":
        """The profile at another sequence length: linear terms scale with ``seq``; attention's ``seq^2`` terms
        are not separated here, so this is exact only for the linear parts (profile at the length you train)."""
        r = seq / self.seq
        return replace(self, seq=seq, block_act_split=self.block_act_split * r,
                       block_act_tokenwise=self.block_act_tokenwise * r, block_input_bytes=self.block_input_bytes * r,
                       rest_act=self.rest_act * r, logits_act=self.logits_act * r,
                       block_flops_split=self.block_flops_split * r,
                       block_flops_replicated=self.block_flops_replicated * r, head_flops=self.head_flops * r)

    @classmethod
    def from_gpt(cls, shape: GPTShape) -> "ModelProfile":
        """The analytic profile of a GPT of :class:`~lightning_dpmp.planner.gpt_shape.GPTShape` (Megatron's layer:
        LayerNorm, GeLU MLP of ``ffn``, learned positions), activations after Korthikanti et al. 2022:
        ``s h (10 + 24/mp) + 5 a s^2 / mp`` bytes per sequence per layer at 16-bit activations, of which ``10 s h``
        are token-wise (LayerNorm inputs, the inputs of the column layers, dropout masks) and the rest split over
        MP (``8 s h`` in attention, ``16 s h`` in the MLP, scaled by ``ffn / 4h``, and the scores)."""
        s, h, a, f = shape.seq, shape.hidden, shape.heads, shape.ffn_width
        k = shape.act_bytes / 2  # Korthikanti's figures are for 2-byte activations with 1-byte dropout masks
        matmul = 4 * h * h + 2 * h * f
        return cls(
            layers=shape.layers, hidden=h, vocab=shape.vocab, seq=s, heads=a, kv_heads=a, ffn=f,
            block_split_params=shape.block_params, block_replicated_params=shape.replicated_block_params,
            vocab_params=shape.embedding_params, other_params=s * h + 2 * h,
            block_act_split=k * (8 * s * h + 16 * s * h * f / (4 * h) + 5 * a * s * s),
            block_act_tokenwise=k * 10 * s * h, block_input_bytes=s * h * shape.act_bytes,
            rest_act=s * h * shape.act_bytes, logits_act=2 * s * shape.vocab * 4,
            block_flops_split=2 * s * matmul + 4 * s * s * h, block_flops_replicated=0.0,
            head_flops=2 * s * h * shape.vocab, param_bytes=shape.act_bytes, act_bytes=shape.act_bytes,
            tied=shape.tied,
        )


# ---------------------------------------------------------------------------------------------------- the recorder
def _blocks(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks: the entries of the longest ``nn.ModuleList`` (the pipeline cuts there too)."""
    lists = [list(m) for m in module.modules() if isinstance(m, nn.ModuleList) and len(m) >= 1]
    return max(lists, key=len) if lists else []


def _storage_key(t: torch.Tensor) -> int:
    return storage_identity(t)  # one key per storage, shared by views (meta tensors have no data pointer)


class _Recorder(TorchFunctionMode):
    """Tags tensors split over MP by the data flow, counts FLOPs and MP collectives per block."""

    def __init__(self, vocab: int, params: dict[int, nn.Parameter]) -> None:
        super().__init__()
        self.vocab = vocab
        self.params = params                       # id -> parameter
        self.split: "torch.utils.weak.WeakTensorKeyDictionary" = torch.utils.weak.WeakTensorKeyDictionary()
        self.block: Optional[int] = None
        self.out_split = False                     # the running op's output (for tensors saved inside it)
        self.inputs: dict[int, bool] = {}          # storages of the running op's arguments -> split
        self.split_params: set[int] = set()
        self.vocab_param_ids: set[int] = set()
        self.flops_split: dict[Optional[int], float] = {}
        self.flops_rep: dict[Optional[int], float] = {}
        self.head_flops = 0.0
        self.rows: dict[Optional[int], int] = {}   # forward all-reduces (row layers)
        self.col_inputs: dict[Optional[int], set[int]] = {}

    def _is_split(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and self.split.get(t, False)

    def _add(self, table: dict[Optional[int], float], flops: float) -> None:
        table[self.block] = table.get(self.block, 0.0) + flops

    def _linear(self, x: torch.Tensor, w: torch.Tensor, bias: Any, in_dim: int) -> bool:
        """A matmul with a parameter: returns whether its output is split."""
        out_dim = w.shape[1 - in_dim] if w.dim() == 2 else 1
        flops = 2.0 * x.numel() / max(x.shape[-1], 1) * w.shape[in_dim] * out_dim
        if self.block is None:
            if out_dim == self.vocab or w.shape[0] == self.vocab:
                self.head_flops += flops
                self.vocab_param_ids.add(id(w))
                return True                          # vocab-parallel logits
            self._add(self.flops_rep, flops)
            return False
        self._add(self.flops_split, flops)
        self.split_params.add(id(w))
        if self._is_split(x):                        # row layer: all-reduce forward, replicated output
            self.rows[self.block] = self.rows.get(self.block, 0) + 1
            return False
        self.col_inputs.setdefault(self.block, set()).add(_storage_key(x))  # column layer: copy at its input
        if isinstance(bias, nn.Parameter):
            self.split_params.add(id(bias))
        return True

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func in (torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.tolist) and args[0].is_meta:
            # data-dependent control flow on meta tensors: answer the dense, unpadded case
            if func is torch.Tensor.__bool__:
                return True
            return 0 if func is torch.Tensor.item else torch.zeros(args[0].shape).tolist()
        flat = list(args) + list(kwargs.values())
        split = any(self._is_split(a) for a in flat)
        if func is torch.nn.functional.linear:
            w = args[1] if len(args) > 1 else kwargs["weight"]
            if id(w) in self.params:
                split = self._linear(args[0], w, args[2] if len(args) > 2 else kwargs.get("bias"), in_dim=1)
        elif func in (torch.addmm, torch.Tensor.addmm) and len(args) >= 3 and id(args[2]) in self.params:
            split = self._linear(args[1], args[2], args[0], in_dim=0)   # GPT-2's Conv1D: addmm(b, x, W)
        elif func is torch.nn.functional.embedding:
            w = args[1] if len(args) > 1 else kwargs["weight"]
            if w.shape[0] == self.vocab:
                self.vocab_param_ids.add(id(w))
            split = False
        elif func is torch.nn.functional.scaled_dot_product_attention:
            return self._sdpa(split, *args, **kwargs)
        elif func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm):
            a, b = args[0], args[1]
            if id(b) not in self.params and a.dim() >= 2 and b.dim() >= 2:
                self._add(self.flops_split if split else self.flops_rep,
                          2.0 * a.numel() * b.shape[-1])
        self.out_split = split
        self.inputs = {_storage_key(a): self._is_split(a) for a in flat
                       if isinstance(a, torch.Tensor) and not isinstance(a, nn.Parameter)}
        out = func(*args, **kwargs)
        if split:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.split[t] = True
        return out

    def _sdpa(self, split: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest: Any, **kw: Any) -> Any:
        """What a fused attention kernel saves and computes; its output is produced without the math fallback."""
        scores = q.shape[-2] * k.shape[-2]
        self._add(self.flops_split if split else self.flops_rep, 4.0 * q.numel() / q.shape[-2] * scores)
        out = q.new_empty(q.shape[:-1] + (v.shape[-1],))
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        if q.requires_grad or k.requires_grad:
            out.requires_grad_(True)
            self.saved_extra(out, split)
            self.saved_extra(lse, split)
            for t in (q, k, v):
                self.saved_extra(t, split)
        if split:
            self.split[out] = True
        return out

    saved_extra: Callable[[torch.Tensor, bool], None]


def profile_step(module: nn.Module, step: Callable[[], Any], vocab: int, hidden: int, seq: int, sequences: int,
                 heads: int = 0, kv_heads: int = 0, ffn: int = 0) -> ModelProfile:
    """Profile one forward of ``step()`` (which runs ``module`` on a batch of ``sequences`` x ``seq`` tokens and
    returns the loss) on the meta device; ``module``'s parameters must be on ``meta`` already.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> class Block(nn.Module):
        ...     def __init__(self):
        ...         super().__init__(); self.up = nn.Linear(8, 32); self.down = nn.Linear(32, 8)
        ...     def forward(self, x): return x + self.down(torch.relu(self.up(x)))
        >>> with torch.device("meta"):
        ...     net = nn.Sequential(nn.Embedding(16, 8), nn.ModuleList([Block(), Block()]))
        >>> def step():
        ...     x = net[0](torch.zeros(2, 4, dtype=torch.long, device="meta"))
        ...     for b in net[1]: x = b(x)
        ...     return x.sum()
        >>> p = profile_step(net, step, vocab=16, hidden=8, seq=4, sequences=2)
        >>> p.layers, p.block_split_params, p.mp_allreduces_per_block
        (2, 544, (1, 1))
    """
    blocks = _blocks(module)
    params = {id(p): p for p in module.parameters()}
    param_storages = {_storage_key(p) for p in module.parameters()}
    rec = _Recorder(vocab, params)
    saved: dict[int, tuple[Optional[int], bool, int, bool]] = {}   # storage -> (block, split, bytes, vocab-wide)

    kept: list[torch.Tensor] = []

    def note(t: torch.Tensor, split: bool) -> None:
        key = _storage_key(t)
        if key in param_storages or key in saved:
            return
        wide = t.dim() > 0 and t.shape[-1] == vocab and rec.block is None
        kept.append(t)  # alive until the end, so that no later tensor reuses its storage's address
        saved[key] = (rec.block, split, t.numel() * t.element_size(), wide)

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)  # an argument saved as it is or as a view (a Linear saves its input flattened)
        note(t, rec.inputs[key] if key in rec.inputs else rec._is_split(t) if t in rec.split else rec.out_split)
        return t

    rec.saved_extra = note
    handles = []
    block_inputs: dict[int, int] = {}
    block_elem: list[int] = []
    for i, b in enumerate(blocks):
        def pre(_m: nn.Module, a: tuple, kw: dict, i: int = i) -> None:
            rec.block = i
            x = next((t for t in list(a) + list(kw.values()) if isinstance(t, torch.Tensor)), None)
            if x is not None:
                block_inputs[i] = x.numel() * x.element_size()
                block_elem[:] = [x.element_size()]

        def post(_m: nn.Module, _a: tuple, _kw: dict, _o: Any) -> None:
            rec.block = None

        handles.append(b.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(b.register_forward_hook(post, with_kwargs=True))
    was_training = module.training
    module.train()  # transformers switches on self.training: profile the step that trains
    try:
        with rec, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            step()
    finally:
        for h in handles:
            h.remove()
        module.train(was_training)
    n_blocks = max(len(blocks), 1)
    per_seq = 1.0 / sequences

    def block_sum(split: bool) -> float:
        return sum(b for blk, s, b, _ in saved.values() if blk is not None and s == split) / n_blocks * per_seq

    block_params = [p for b in blocks for p in b.parameters()]
    split_p = sum(p.numel() for p in block_params if id(p) in rec.split_params) // n_blocks
    rep_p = sum(p.numel() for p in block_params if id(p) not in rec.split_params) // n_blocks
    in_blocks = {id(p) for p in block_params}
    vocab_p = sum(p.numel() for p in module.parameters() if id(p) in rec.vocab_param_ids and id(p) not in in_blocks)
    other_p = sum(p.numel() for p in module.parameters()) - vocab_p - len(blocks) * (split_p + rep_p)
    first = next(iter(module.parameters()), None)
    rows = [rec.rows.get(i, 0) for i in range(len(blocks))] or [0]
    cols = [len(rec.col_inputs.get(i, ())) for i in range(len(blocks))] or [0]
    return ModelProfile(
        layers=len(blocks), hidden=hidden, vocab=vocab, seq=seq, heads=heads, kv_heads=kv_heads or heads, ffn=ffn,
        block_split_params=split_p, block_replicated_params=rep_p, vocab_params=vocab_p, other_params=other_p,
        block_act_split=block_sum(True), block_act_tokenwise=block_sum(False),
        block_input_bytes=(sum(block_inputs.values()) / n_blocks * per_seq) if block_inputs else 0.0,
        rest_act=sum(b for blk, _, b, wide in saved.values() if blk is None and not wide) * per_seq,
        logits_act=sum(b for blk, _, b, wide in saved.values() if blk is None and wide) * per_seq,
        block_flops_split=sum(v for k, v in rec.flops_split.items() if k is not None) / n_blocks * per_seq,
        block_flops_replicated=sum(v for k, v in rec.flops_rep.items() if k is not None) / n_blocks * per_seq,
        head_flops=rec.head_flops * per_seq,
        mp_allreduces_per_block=(round(sum(rows) / len(rows)), round(sum(cols) / len(cols))),
        param_bytes=first.element_size() if first is not None else 4,
        act_bytes=block_elem[0] if block_elem else (first.element_size() if first is not None else 4),
        tied=bool(rec.vocab_param_ids) and len(rec.vocab_param_ids) == 1 and rec.head_flops > 0,
    )


def token_tensor(batch: Any) -> torch.Tensor:
    """The first ``(sequences, tokens)`` integer tensor of a batch (what a language model reads).

    Example:
        >>> token_tensor((torch.zeros(2, 8, dtype=torch.long), torch.ones(2))).shape
        torch.Size([2, 8])
    """
    for t in tree_leaves(batch):
        if isinstance(t, torch.Tensor) and t.dim() == 2 and not t.is_floating_point():
            return t
    raise ValueError("the batch has no (sequences, tokens) integer tensor to read the sequence length from")


def config_sizes(cfg: Any) -> tuple[int, int, int, int, int]:
    """(vocab, hidden, heads, kv_heads, ffn) of a transformers config, by the names transformers uses."""
    def first(*names: str, default: int = 0) -> int:
        for n in names:
            v = getattr(cfg, n, None)
            if isinstance(v, int):
                return v
        return default

    hidden = first("hidden_size", "n_embd", "d_model")
    heads = first("num_attention_heads", "n_head", "num_heads")
    return (first("vocab_size"), hidden, heads, first("num_key_value_heads", default=heads),
            first("intermediate_size", "n_inner", "ffn_dim", "d_ff", default=4 * hidden) or 4 * hidden)


def profile_config(config: Any, seq: int, dtype: torch.dtype = torch.float32) -> ModelProfile:
    """Profile a transformers causal LM from its config (a ``PretrainedConfig`` or the path of a ``config.json``
    or its folder), built on the meta device, trained with the shifted cross-entropy on one sequence.

    Example:
        >>> from transformers import LlamaConfig
        >>> cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        ...                   num_attention_heads=4, num_key_value_heads=2)
        >>> p = profile_config(cfg, seq=16)
        >>> p.layers, p.mp_allreduces_per_block, p.params
        (2, (2, 2), 106816)
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if not hasattr(config, "to_dict"):
        config = AutoConfig.from_pretrained(str(config))
    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    vocab, hidden, heads, kv, ffn = config_sizes(config)
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")

    def step() -> torch.Tensor:
        logits = net(input_ids=ids, use_cache=False).logits
        v = logits.shape[-1]
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, v), ids[:, 1:].reshape(-1))

    return profile_step(net, step, vocab, hidden, seq, 1, heads=heads, kv_heads=kv, ffn=ffn)

