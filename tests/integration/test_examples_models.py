"""The example models and data modules on their own (single process, no strategy)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from examples.data.digits import DigitsDataModule
from examples.data.text import ByteWindows, TextDataModule, stdlib_files
from examples.models.common import warmup_cosine_schedule
from examples.models.gpt import GPT, GPTLitModule
from examples.models.mlp import MLPLitModule, ResidualMLP


def test_gpt_shapes_tied_head_and_seeded_init():
    torch.manual_seed(0)
    a = GPT(vocab_size=256, block_size=16, n_layer=2, n_head=4, n_embd=32)
    torch.manual_seed(0)
    b = GPT(vocab_size=256, block_size=16, n_layer=2, n_head=4, n_embd=32)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert a.lm_head.weight is a.wte.weight
    assert GPT(n_layer=1, n_embd=32, tie_embeddings=False).lm_head.weight is not None
    idx = torch.randint(0, 256, (3, 16))
    assert a(idx).shape == (3, 16, 256)
    with pytest.raises(ValueError, match="exceeds block_size"):
        a(torch.randint(0, 256, (1, 17)))


def test_gpt_attention_is_causal_and_head_count_follows_the_width():
    torch.manual_seed(0)
    model = GPT(block_size=8, n_layer=1, n_head=4, n_embd=32).eval()
    x = torch.randint(0, 256, (1, 8))
    y = x.clone()
    y[0, -1] = (y[0, -1] + 1) % 256
    assert torch.allclose(model(x)[0, :-1], model(y)[0, :-1], atol=1e-6)  # the future does not leak
    attn = model.blocks[0].attn
    assert not hasattr(attn, "n_head")  # heads = (local) width // head_dim, so column splits keep heads whole
    half = torch.nn.Linear(32, 16)
    out = half(torch.randn(2, 8, 32)).view(2, 8, -1, attn.head_dim)
    assert out.shape[2] == 2


def test_gpt_overfits_a_batch():
    torch.manual_seed(0)
    module = GPTLitModule(
        GPT(block_size=16, n_layer=1, n_head=2, n_embd=32), optimizer=functools.partial(torch.optim.AdamW, lr=1e-2)
    )
    opt = module.optimizer_factory(params=module.parameters())
    x = torch.randint(0, 256, (4, 17))
    batch = (x[:, :-1], x[:, 1:])
    first = module._loss(batch).item()
    for _ in range(30):
        opt.zero_grad()
        module._loss(batch).backward()
        opt.step()
    assert module._loss(batch).item() < first / 2


def test_mlp_forward_and_metrics():
    module = MLPLitModule(ResidualMLP(in_features=64, num_classes=10, width=32, n_blocks=2))
    x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
    assert module(x).shape == (8, 10)
    module.val_acc.update(module(x), y)
    assert 0.0 <= float(module.val_acc.compute()) <= 1.0


def test_warmup_cosine_schedule():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = warmup_cosine_schedule(opt, total_steps=100, warmup_steps=10, min_lr_ratio=0.1)
    lrs = []
    for _ in range(100):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[-1] == pytest.approx(0.1, abs=1e-3) and all(a >= b for a, b in zip(lrs[10:], lrs[11:]))


def test_stdlib_corpus_is_deterministic_and_cached(tmp_path):
    files = stdlib_files()
    assert len(files) > 100 and files == stdlib_files()
    rel = [p.relative_to(files[0].parents[len(files[0].parents) - 1]).as_posix() for p in files]
    assert rel == sorted(rel)
    assert not any("site-packages" in p.parts for p in files)
    dm = TextDataModule(max_bytes=50_000, block_size=32, cache_dir=str(tmp_path))
    dm.prepare_data()
    dm.setup()
    assert len(list(tmp_path.glob("bytes-*.npy"))) == 1
    again = TextDataModule(max_bytes=50_000, block_size=32, cache_dir=str(tmp_path))
    again.setup()
    assert np.array_equal(np.asarray(dm.train_set.data), np.asarray(again.train_set.data))
    x, y = dm.train_set[5]
    assert x.shape == (32,) and torch.equal(x[1:], y[:-1]) and x.dtype == torch.int64
    assert len(dm.val_set) > 0


def test_text_from_a_user_file(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("hello world " * 200)
    dm = TextDataModule(path=str(path), block_size=8, batch_size=4, cache_dir=str(tmp_path / "c"))
    dm.setup()
    x, _ = next(iter(dm.train_dataloader()))
    assert x.shape == (4, 8) and int(x.max()) < 256


def test_byte_windows_length_and_stride():
    data = np.arange(101, dtype=np.uint8)
    assert len(ByteWindows(data, block_size=10)) == 10
    assert len(ByteWindows(data, block_size=10, stride=5)) == 19
    x, y = ByteWindows(data, block_size=10, stride=5)[18]
    assert int(y[-1]) == 100


def test_digits_split_is_fixed():
    a, b = DigitsDataModule(), DigitsDataModule()
    a.setup()
    b.setup()
    assert len(a.train_set) + len(a.val_set) == 1797
    assert torch.equal(a.val_set.tensors[1], b.val_set.tensors[1])
    x, y = a.train_set[0]
    assert x.shape == (64,) and 0.0 <= float(x.min()) and float(x.max()) <= 1.0
    loss = F.cross_entropy(ResidualMLP()(x[None]), y[None])
    assert torch.isfinite(loss)
