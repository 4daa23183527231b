"""The cost model: layouts, the analytic MP/DP bytes, memory, the recommendation, the command line."""

from __future__ import annotations

import pytest

from lightning_dpmp.tools.costmodel import GPTShape, Hardware, predict, recommend, valid_layouts
from lightning_dpmp.tools.costmodel_cli import MODELS, main

SMALL = GPTShape(layers=4, hidden=256, heads=8, vocab=256, seq=128, batch=8, act_bytes=4, grad_bytes=4)
CPU = Hardware(devices=4, devices_per_node=4, memory_gb=24, flops=5e9, mem_bw=5e9, intra_bw=1e9, inter_bw=1e9)


def test_valid_layouts_respect_divisibility() -> None:
    assert valid_layouts(SMALL, 4) == [(4, 1), (2, 2), (1, 4)]
    odd_heads = GPTShape(layers=2, hidden=96, heads=6, vocab=64, seq=16, batch=8)
    assert valid_layouts(odd_heads, 4) == [(4, 1), (2, 2)]  # 6 heads do not split 4 ways
    batch_of_2 = GPTShape(layers=2, hidden=64, heads=4, vocab=64, seq=16, batch=2)
    assert valid_layouts(batch_of_2, 4) == [(2, 2), (1, 4)]  # dp=4 does not divide a batch of 2


def test_parameter_count_matches_the_example_gpt() -> None:
    from examples.models.gpt import GPT

    net = GPT(vocab_size=256, block_size=128, n_layer=4, n_head=8, n_embd=256)
    assert SMALL.params == sum(p.numel() for p in net.parameters())
    shape = GPTShape.from_module(net, seq=128, batch=8)
    found = (shape.layers, shape.hidden, shape.heads, shape.vocab, shape.ffn_width, shape.tied)
    assert found == (4, 256, 8, 256, 1024, True)


def test_mp_bytes_are_the_megatron_minimum() -> None:
    # dp=2: 4 sequences per rank; 4 activation all-reduces per block + embedding + head input gradient, fp32
    act = 4 * 128 * 256 * 4
    p = predict(SMALL, CPU, dp=2, mp=2)
    assert p.mp_bytes == (4 * 4 + 2) * act + 4 * 128 * 16
    assert predict(SMALL, CPU, dp=4, mp=1).mp_bytes == 0
    assert predict(SMALL, CPU, dp=1, mp=4).dp_bytes == 0


def test_local_parameters_and_dp_bytes_shrink_with_mp() -> None:
    full = predict(SMALL, CPU, dp=4, mp=1)
    half = predict(SMALL, CPU, dp=2, mp=2)
    assert full.dp_bytes == SMALL.params * 4
    split = SMALL.layers * SMALL.block_params + SMALL.embedding_params
    assert half.dp_bytes == (split / 2 + SMALL.params - split) * 4
    assert half.state_bytes < full.state_bytes and half.compute_s < full.compute_s * 1.01


def test_memory_decides_the_7b_layout_on_8_gpus() -> None:
    best, table = recommend(GPTShape(**MODELS["gpt-7b"]), Hardware.preset("dgx-a100", 8))
    by = {(t.dp, t.mp): t for t in table}
    assert not by[(8, 1)].fits  # 6.7B x 16 bytes > 80 GiB
    assert best is not None and best.mp >= 2 and best.fits


def test_slow_inter_node_links_keep_mp_inside_a_node() -> None:
    best, table = recommend(GPTShape(**MODELS["gpt-1.3b"]), Hardware.preset("dgx-a100", 64))
    assert best is not None and best.mp <= 8
    cross = [t for t in table if t.mp > 8]
    assert cross and all("MP group spans nodes" in t.notes for t in cross)
    assert all(t.step_s > best.step_s for t in cross)


def test_fast_dp_makes_pure_data_parallel_best_when_it_fits() -> None:
    best, _ = recommend(GPTShape(**MODELS["gpt-1.3b"]), Hardware.preset("dgx-a100", 8))
    assert best is not None and (best.dp, best.mp) == (8, 1)


def test_nothing_fits_gives_none() -> None:
    best, table = recommend(GPTShape(**MODELS["gpt-7b"]), Hardware.preset("dgx-a100", 8, memory_gb=1))
    assert best is None and table and not any(t.fits for t in table)


def test_layout_builds_the_strategy() -> None:
    best, _ = recommend(SMALL, CPU)
    assert best is not None
    s = best.strategy(verify_plan=False)
    assert (s._dp_arg, s._mp_arg) == (best.dp, best.mp)


def test_command_line(capsys: pytest.CaptureFixture) -> None:
    main(["--model", "gpt-1.3b", "--devices", "64"])
    out = capsys.readouterr().out
    assert "recommended: DPMPStrategy(dp=" in out and "| 64 x 1 |" in out
    with pytest.raises(SystemExit):
        main(["--layers", "2"])  # the other sizes are missing
