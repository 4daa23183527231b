"""VocabShardedLogits without processes: the full logical shape, ops on the shard equal the dense op's slice,
everything else refused with the layer and the fix; the layer shards only in the traced mode."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_dpmp.parallel.layers import ColumnParallelLinear
from lightning_dpmp.parallel.loss import ELEMENTWISE, KEEP, LAYOUT, VocabShardedLogits, VocabShardedLogitsError
from lightning_dpmp.planner import flow
from lightning_dpmp.planner.plan import make_plan
from lightning_dpmp.planner.trace import trace_step

V, LOCAL = 8, 4  # a shard of half the classes, as rank 0 of mp=2 holds


@pytest.fixture
def dense():
    torch.manual_seed(0)
    return torch.randn(2, 5, V, dtype=torch.float64)


def shard(dense: torch.Tensor) -> VocabShardedLogits:
    return VocabShardedLogits.wrap(dense[..., :LOCAL], None, V, "lm_head")


def test_reports_the_full_logical_shape(dense):
    x = shard(dense)
    assert x.shape == x.size() == (2, 5, V) and x.size(-1) == V and x.size(1) == 5
    assert (x.numel(), len(x), x.dim(), x.ndim, x.dtype) == (2 * 5 * V, 2, 3, 3, torch.float64)
    assert x.local().shape == (2, 5, LOCAL)
    assert repr(x) == "VocabShardedLogits(local (2, 5, 4) of (2, 5, 8), layer 'lm_head', mp=1)"


LOCAL_OPS = {
    "shift and flatten": lambda t: t[:, :-1].reshape(-1, V),
    "view(-1, size(-1))": lambda t: t.view(-1, t.size(-1)),
    "reshape(-1, shape[-1])": lambda t: t.reshape(-1, t.shape[-1]),
    "flatten(0, 1)": lambda t: t.flatten(0, 1),
    "float, contiguous": lambda t: t.float().contiguous(),
    "to(float32), detach, clone": lambda t: t.to(torch.float32).detach().clone(),
    "temperature": lambda t: t / 0.7,
    "soft-capping": lambda t: torch.tanh(t / 30.0) * 30.0,
    "mask broadcast over vocab": lambda t: t.masked_fill(torch.tensor([[True], [False]]).unsqueeze(-1), 0.0),
    "per-row bias (size 1 on vocab)": lambda t: t + torch.arange(5.0, dtype=t.dtype).view(1, 5, 1),
    "sum over batch": lambda t: t.sum(0),
    "transpose of other dims": lambda t: t.transpose(0, 1),
    "cat along batch": lambda t: torch.cat([t, t], 0),
    "unsqueeze(0)": lambda t: t.unsqueeze(0),
    "boolean row mask": lambda t: t[torch.tensor([[True, False, True, True, False], [False] * 5])],
}


@pytest.mark.parametrize("op", sorted(LOCAL_OPS))
def test_ops_along_other_dims_run_on_the_shard_and_equal_the_dense_slice(dense, op):
    out = LOCAL_OPS[op](shard(dense))
    expected = LOCAL_OPS[op](dense)
    assert isinstance(out, VocabShardedLogits), type(out)
    assert out.shape == expected.shape
    torch.testing.assert_close(out.local(), expected[..., :LOCAL], rtol=0, atol=1e-6)


REFUSED = {
    "argmax": lambda t: t.argmax(-1),
    "torch.argmax": lambda t: torch.argmax(t, dim=-1),
    "softmax": lambda t: t.softmax(-1),
    "F.log_softmax": lambda t: F.log_softmax(t, -1),
    "topk": lambda t: t.topk(3),
    "max over vocab": lambda t: t.max(-1),
    "sum over vocab": lambda t: t.sum(-1),
    "sum of all": lambda t: t.sum(),
    "full-vocabulary bias": lambda t: t + torch.zeros(V, dtype=t.dtype),
    "flatten of the vocab": lambda t: t.flatten(),
    "vocab merged by view": lambda t: t.view(2, 5 * V),
    "index into the vocab": lambda t: t[..., 3],
    "transpose of the vocab": lambda t: t.transpose(-1, -2),
    ".T": lambda t: t.mT,
    "tolist": lambda t: t.tolist(),
    "item": lambda t: t[0, 0, :1].item(),
    "cross_entropy with class weights": lambda t: F.cross_entropy(t.view(-1, V), torch.zeros(10, dtype=torch.long),
                                                                  weight=torch.ones(V, dtype=t.dtype)),
    "cross_entropy in (N, C, T) layout": lambda t: F.cross_entropy(t.transpose(1, 2),
                                                                   torch.zeros(2, 5, dtype=torch.long)),
}


@pytest.mark.parametrize("op", sorted(REFUSED))
def test_ops_needing_the_whole_vocabulary_are_refused_with_the_fix(dense, op):
    with pytest.raises(VocabShardedLogitsError, match=r"'lm_head'.*plan_overrides=\{'lm_head': 'column_gather'\}"):
        REFUSED[op](shard(dense))


def test_cross_entropy_is_routed_to_the_vocab_parallel_loss(dense):
    """At mp=1 the shard is the whole vocabulary: the routed loss equals torch's, positional and module forms."""
    full = dense.clone().requires_grad_()
    x = VocabShardedLogits.wrap(full, None, V, "lm_head")
    t = torch.randint(0, V, (2, 4))
    t[0, 0] = -100
    ours = F.cross_entropy(x[:, :-1].reshape(-1, V), t.reshape(-1), label_smoothing=0.1)
    module = nn.CrossEntropyLoss(reduction="sum")(x[:, :-1].reshape(-1, x.size(-1)), t.reshape(-1))
    assert type(ours) is torch.Tensor and type(module) is torch.Tensor
    ref = F.cross_entropy(dense[:, :-1].reshape(-1, V), t.reshape(-1), label_smoothing=0.1)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(module, F.cross_entropy(dense[:, :-1].reshape(-1, V), t.reshape(-1), reduction="sum"),
                               rtol=0, atol=1e-12)
    ours.backward()
    assert full.grad is not None and full.grad.shape == (2, 5, V)


def test_the_vocab_layer_shards_only_in_the_traced_mode():
    dense = nn.Linear(4, V).double()
    layer = ColumnParallelLinear.from_dense(dense, None, vocab_logits=True, vocab_mode=(True, True), name="lm_head")
    x = torch.randn(3, 4, dtype=torch.float64)
    layer.train()
    assert isinstance(layer(x), VocabShardedLogits)
    with torch.no_grad():  # training mode, but not the traced mode: full logits
        assert type(layer(x)) is torch.Tensor
    layer.eval()  # validation, test, predict, sanity check
    assert type(layer(x)) is torch.Tensor
    torch.testing.assert_close(layer(x), dense(x), rtol=0, atol=1e-12)


def test_every_op_the_planner_lets_reach_a_vocab_loss_runs_on_the_shard():
    """The flow's op table decides what a vocab head's logits may pass through on their way to the loss; each such
    op must be one the sharded logits compute locally (attention-like ops never precede a (N, classes) loss)."""
    semantic = flow.BATCHED | flow.LOSSES | {"einsum", "__get__", "T", "mT"}
    handled = ELEMENTWISE | LAYOUT | KEEP | {"__getitem__"}
    assert set(flow.OPS) - semantic <= handled, sorted(set(flow.OPS) - semantic - handled)


def test_traced_mode_is_recorded_and_a_small_head_stays_whole():
    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.ln, self.head = nn.Linear(64, 128), nn.LayerNorm(128), nn.Linear(128, 10)

        def forward(self, x):
            return self.head(self.ln(self.body(x)))  # a norm before the head: nothing for it to pair with

    model = Classifier()
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    trace = trace_step(model, lambda: F.cross_entropy(model(x), y))
    plan = make_plan(model, 2, trace)
    head = plan.layers["head"]
    assert head.style == "replicate"
    assert head.note == ("kept whole: out_features=10 <= in_features=128: a vocab split would save 645 parameters per"
                         " rank for 3 all-reduces moving 2,112 values per step at the traced batch; it pays only when"
                         " out_features > in_features (plan_overrides={'head': 'vocab'} forces it)")
    forced = make_plan(model, 2, trace, {"head": "vocab"}).layers["head"]
    assert forced.style == "vocab" and forced.mode == (True, True)
    with torch.no_grad():
        model.eval()
        trace_eval = trace_step(model, lambda: F.cross_entropy(model(x), y))
    assert make_plan(model, 2, trace_eval, {"head": "vocab"}).layers["head"].mode == (False, False)


def test_module_hooks_dispatch_modes_and_compile_accept_the_shard():
    """torch's own tools see the sharded logits as a tensor: a module's full backward hook (which wraps its output
    in an autograd function and reads ``grad_fn``), ``register_hook``/``retain_grad`` on the logits themselves, a
    dispatch mode around the step (``FlopCounterMode``; ``CommDebugMode`` is checked at mp=2 in test_logits.py)
    and ``torch.compile`` of a loss function."""
    from torch.utils.flop_counter import FlopCounterMode

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, V, dtype=torch.float64)

        def forward(self, h):
            return VocabShardedLogits.wrap(self.lin(h), None, V, "head")

    torch.manual_seed(0)
    head, h, t = Head(), torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True), torch.randint(0, V, (10,))
    calls: list = []
    head.register_full_backward_hook(lambda module, grad_in, grad_out: calls.append(tuple(grad_out[0].shape)))
    with FlopCounterMode(display=False) as flops:
        logits = head(h)
        logits.retain_grad()
        seen: list = []
        logits.register_hook(lambda g: seen.append(tuple(g.shape)))
        loss = F.cross_entropy(logits.reshape(-1, V), t)
    loss.backward()
    assert calls == [(2, 5, V)] and seen == [(2, 5, V)] and logits.grad is not None
    assert flops.get_total_flops() == 2 * 10 * 3 * V  # the head's matmul
    ref = F.cross_entropy(head.lin(h).reshape(-1, V), t)

    def loss_fn(logits, target):
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target)

    compiled = torch.compile(loss_fn, backend="eager")(head(h), t)
    torch.testing.assert_close(compiled, ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("vocab", [128, 16384])
def test_float32_loss_rounds_as_torch_does(vocab):
    """A float32 loss (transformers' ``labels=`` upcasts the logits) computed op for op as torch's log_softmax +
    nll_loss, with the row sums accumulated in float64: the loss and the logits' gradient equal torch's bit for bit
    on most entries, and the float64 loss equals torch's to rounding. Measured, gradient entries equal at V=128 and
    V=16384: 85% and 83% on one host, 83% and 72% on an AMD EPYC host (torch's own kernels vectorise differently
    by CPU); probabilities computed as ``exp(x - max) / sum`` matched 18-19% and 8-9%. The bound, 60%, holds on
    both and stays far above the naive formula's."""
    from lightning_dpmp.parallel.loss import vocab_parallel_cross_entropy

    torch.manual_seed(0)
    logits = (torch.randn(512, vocab, dtype=torch.float64) * 0.5).float()
    target = torch.randint(0, vocab, (512,))
    ref_in, ours_in = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    F.cross_entropy(ref_in, target, reduction="none").sum().backward()
    loss = vocab_parallel_cross_entropy(ours_in, target, None, reduction="none")
    loss.sum().backward()
    ref = F.cross_entropy(logits, target, reduction="none")
    equal = (ours_in.grad == ref_in.grad).float().mean().item()
    assert equal >= 0.6, equal
    assert (loss == ref).float().mean().item() >= 0.6
    assert torch.allclose(ours_in.grad, ref_in.grad, rtol=0, atol=1e-6)
    wide = logits.double()
    assert torch.allclose(vocab_parallel_cross_entropy(wide, target, None), F.cross_entropy(wide, target),
                          rtol=1e-14, atol=0)
