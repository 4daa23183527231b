"""The layout estimator and ``python -m lightning_dpmp.plan`` (issue 44 items 1-2): profiles from meta tensors,
memory terms that scale as the layouts divide them, the command line on a config and on module:function, and
Megatron-LM's published rows within 15%."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lightning_dpmp.tools.costmodel import GPTShape
from lightning_dpmp.tools.estimate import DEVICES, LayoutSpec, estimate, layouts, predict
from lightning_dpmp.tools.plan_cli import main
from lightning_dpmp.tools.profile import ModelProfile, profile_config, profile_step

ROOT = Path(__file__).resolve().parents[2]
KEYS = ["dp", "pp", "mp", "zero", "sequence_parallel", "microbatches", "schedule", "recompute", "fits",
        "peak_mem_gib", "step_s", "tokens_per_s", "mfu", "chosen"]


def _llama_config(layers: int = 4):  # noqa: ANN202
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=512, num_hidden_layers=layers,
                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                       tie_word_embeddings=False)


def tiny_module():  # noqa: ANN201
    """A module:function target: the example GPT's LightningModule with an example batch."""
    from examples.models.gpt import GPT, GPTLitModule

    m = GPTLitModule(GPT(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64))
    ids = torch.zeros(2, 32, dtype=torch.long)
    return m, (ids, ids)


@pytest.fixture(scope="module")
def llama() -> ModelProfile:
    return profile_config(_llama_config(), seq=64)


def test_profile_from_meta_counts_the_real_model(llama: ModelProfile) -> None:
    from transformers import LlamaForCausalLM

    dense = LlamaForCausalLM(_llama_config())
    assert llama.params == sum(p.numel() for p in dense.parameters())
    assert llama.layers == 4 and llama.mp_allreduces_per_block == (2, 2)  # o_proj and down_proj; q|k|v, gate|up
    block = dense.model.layers[0]
    linears = sum(m.weight.numel() for m in block.modules() if isinstance(m, torch.nn.Linear))
    assert llama.block_split_params == linears and llama.block_replicated_params == 2 * 128  # the two RMSNorms
    assert llama.vocab_params == 2 * 256 * 128 and not llama.tied


def test_profile_of_the_example_gpt_matches_the_analytic_gpt() -> None:
    from examples.models.gpt import GPT

    with torch.device("meta"):
        net = GPT(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128, dropout=0.0)
    ids = torch.zeros(2, 64, dtype=torch.long, device="meta")
    prof = profile_step(net, lambda: net(ids).sum(), vocab=256, hidden=128, seq=64, sequences=2, heads=4, ffn=512)
    gpt = ModelProfile.from_gpt(GPTShape(layers=2, hidden=128, heads=4, vocab=256, seq=64, batch=2))
    assert prof.params == gpt.params
    assert prof.block_split_params == gpt.block_split_params
    assert prof.mp_allreduces_per_block == (2, 2)
    assert prof.block_flops_split == pytest.approx(gpt.block_flops_split, rel=0.01)


def test_zero_levels_divide_what_they_shard(llama: ModelProfile) -> None:
    dev = DEVICES["h100"]
    mem = {z: predict(llama, dev, 4, 8, LayoutSpec(4, 1, 1, z), "32-true").memory for z in (0, 1, 2, 3)}
    p = mem[0]["parameters"]
    assert mem[0]["gradients"] == p and mem[0]["optimizer"] == 2 * p and mem[0]["dp_buffers"] == p  # DDP buckets
    for z in (1, 2):
        assert mem[z]["optimizer"] == pytest.approx(2 * p / 4) and mem[z]["gradients"] == pytest.approx(p / 4)
        assert mem[z]["parameters"] == pytest.approx(p * 1.25)  # the parameters + their flat DP shard
    assert mem[3]["parameters"] == pytest.approx(p / 4) and mem[3]["optimizer"] == pytest.approx(p / 2)
    assert mem[0]["activations"] == mem[3]["activations"]


def test_dp_buffers_and_zero_gradients_as_the_step_holds_them(llama: ModelProfile) -> None:
    """DDP's buckets exist only where DDP wraps the model (nothing split, no pipeline); with split parameters the DP
    average is a flat copy after the backward (the optimizer phase). ZeRO's full gradients at the peak are the root
    unit's and two blocks', not the model's (each unit's reduce-scatter is waited for at the next one's)."""
    dev = DEVICES["h100"]
    split = predict(llama, dev, 4, 8, LayoutSpec(2, 1, 2, 0), "32-true").memory
    assert split and split["dp_buffers"] == 0.0
    held = split["parameters"] + split["gradients"] + split["optimizer"]
    # the step's phase: + the flat copy (one bucket: the model is far below 25 MB), the size of foreach's temporaries
    flat_phase = held + split["parameters"]
    others = sum(v for k, v in split.items() if k != "optimizer_step")
    assert split["optimizer_step"] == pytest.approx(max(0.0, flat_phase - others))
    z1 = predict(llama, dev, 4, 8, LayoutSpec(4, 1, 1, 1), "32-true").memory
    assert z1
    n1 = llama.params
    block = llama.block_split_params + llama.block_replicated_params
    root = n1 - llama.layers * block
    # the root's, the block's and the previous block's (its reduce-scatter in flight), less the shards zero_grad freed
    assert z1["dp_buffers"] == pytest.approx(max(0.0, (root + 2 * block) * 4 - n1 * 4 / 4))
    z3 = predict(llama, dev, 4, 8, LayoutSpec(4, 1, 1, 3), "32-true").memory
    assert z3 and z3["dp_buffers"] == pytest.approx(z1["dp_buffers"] + root * 4 * 3 / 4 + 2 * block * 4)


def test_optimizer_temporaries_follow_the_implementation(llama: ModelProfile) -> None:
    """foreach (CUDA) holds a float32 temporary of every stepped parameter; the per-parameter loop (CPU) two of the
    largest one: with recomputation the step's phase is the peak only with foreach."""
    spec = LayoutSpec(1, 1, 1, recompute=True)
    gpu = predict(llama, DEVICES["h100"], 1, 1, spec, "32-true")
    cpu = predict(llama, replace(DEVICES["h100"], foreach_step=False), 1, 1, spec, "32-true")
    assert gpu.memory and cpu.memory
    held = sum(gpu.memory[k] for k in ("parameters", "gradients", "optimizer"))
    assert held + gpu.memory["dp_buffers"] + llama.params * 4 == pytest.approx(gpu.peak_mem_gib * 2**30)
    largest = max(llama.hidden * llama.ffn, llama.hidden * llama.vocab)
    others = sum(v for k, v in cpu.memory.items() if k != "optimizer_step")
    assert cpu.memory["optimizer_step"] == pytest.approx(max(0.0, held + 2 * largest * 4 - others))
    assert cpu.peak_mem_gib < gpu.peak_mem_gib


def test_zero3_pays_a_latency_per_unit_collective(llama: ModelProfile) -> None:
    """zero=3 issues one collective per unit: a block gathered for its forward and its backward per micro-batch, the
    root once; a reduce-scatter per unit per step, per micro-batch under a pipeline (the engine's counts: 17 and 9 at
    (4,1,1) with 8 layers). With an infinite link only their latencies remain."""
    lat = 1e-3
    dev = replace(DEVICES["h100"], intra_bw=float("inf"), inter_bw=float("inf"), intra_latency=lat,
                  inter_latency=lat, overlap_dp=False)
    blocks = llama.layers
    flat = predict(llama, dev, 4, 8, LayoutSpec(4, 1, 1, 3), "32-true").time
    assert flat and flat["dp_exposed"] == pytest.approx(((2 * blocks + 1) + (blocks + 1)) * 3 * lat)
    staged = predict(llama, dev, 4, 8, LayoutSpec(2, 2, 1, 3, microbatches=4), "32-true").time
    per_stage = blocks // 2
    assert staged and staged["dp_exposed"] == pytest.approx(((4 * 2 * per_stage + 1) + 4 * (per_stage + 1)) * lat)


def test_optimizer_step_time_on_cpu_caches_small_tensors_and_pays_zeros_copies(llama: ModelProfile) -> None:
    """The per-parameter AdamW loop steps a tensor that fits the cache at ``cached_step_fraction`` of the
    memory-bound time; ZeRO adds its flat copies (gradients in, the shard out: 4 words read or written)."""
    base = replace(DEVICES["cpu"], step_cache_bytes=0.0)
    cached = replace(base, step_cache_bytes=2 * 2**20, cached_step_fraction=0.5)
    n = llama.params
    t0 = predict(llama, base, 1, 8, LayoutSpec(1, 1, 1), "32-true").time
    t1 = predict(llama, cached, 1, 8, LayoutSpec(1, 1, 1), "32-true").time
    assert t0 and t1 and t0["optimizer"] == pytest.approx(n * 28 / base.mem_bw)
    assert t1["optimizer"] == pytest.approx(0.5 * t0["optimizer"])  # the largest matrix, 256 KiB, fits
    z1 = predict(llama, base, 2, 8, LayoutSpec(2, 1, 1, 1), "32-true").time
    assert z1 and z1["optimizer"] == pytest.approx(n / 2 * 28 / base.mem_bw + n * 16 / base.mem_bw)


def test_mp_sp_and_recompute_divide_activations(llama: ModelProfile) -> None:
    dev = DEVICES["h100"]
    one = predict(llama, dev, 2, 8, LayoutSpec(1, 1, 2), "32-true").memory
    sp = predict(llama, dev, 2, 8, LayoutSpec(1, 1, 2, sequence_parallel=True), "32-true").memory
    rc = predict(llama, dev, 2, 8, LayoutSpec(1, 1, 2, recompute=True), "32-true").memory
    whole = predict(llama, dev, 1, 8, LayoutSpec(1, 1, 1), "32-true").memory
    assert one and sp and rc and whole
    logits = llama.logits_act * 8
    rest = llama.rest_act * 8  # the embedding's output and the final norm, whole on every MP rank
    blocks = 4 * 8 * (llama.block_act_split / 2 + llama.block_act_tokenwise)
    assert one["activations"] == pytest.approx(blocks + rest + logits / 2)  # vocab 256 splits over 2
    assert sp["activations"] == pytest.approx(blocks - 4 * 8 * llama.block_act_tokenwise / 2 + rest + logits / 2)
    assert rc["activations"] < one["activations"] / 2
    split = 4 * llama.block_split_params + llama.vocab_params
    assert whole["parameters"] - one["parameters"] == pytest.approx(split / 2 * 4)  # float32 bytes


def test_pipeline_in_flight_micro_batches(llama: ModelProfile) -> None:
    dev = DEVICES["h100"]
    f1b = predict(llama, dev, 4, 8, LayoutSpec(1, 4, 1, microbatches=8, schedule="1f1b"), "32-true")
    gp = predict(llama, dev, 4, 8, LayoutSpec(1, 4, 1, microbatches=8, schedule="gpipe"), "32-true")
    assert f1b.memory and gp.memory and gp.memory["activations"] > f1b.memory["activations"]
    assert f1b.time and f1b.time["bubble"] == pytest.approx(3 / 8 * f1b.time["compute"] + 3 / 8 * f1b.time["pp"],
                                                            rel=0.05)


def test_layouts_cover_every_degree(llama: ModelProfile) -> None:
    specs = layouts(llama, 4, 8)
    assert {(s.dp, s.pp, s.mp) for s in specs} == {(4, 1, 1), (2, 2, 1), (1, 4, 1), (2, 1, 2), (1, 2, 2), (1, 1, 4)}
    assert {s.zero for s in specs} == {0, 1, 2, 3} and {s.schedule for s in specs} >= {"1f1b", "gpipe", "none"}
    assert all(s.zero == 0 for s in specs if s.dp == 1) and all(not s.sequence_parallel for s in specs if s.mp == 1)


def test_layouts_that_do_not_fit_are_marked(llama: ModelProfile) -> None:
    rows = estimate(llama, DEVICES["cpu"], 4, 8, "32-true")
    peaks = sorted(r.peak_mem_gib for r in rows)
    dev = replace(DEVICES["cpu"], memory_gib=peaks[len(peaks) // 2])
    rows = estimate(llama, dev, 4, 8, "32-true")
    assert any(r.fits for r in rows) and any(not r.fits for r in rows)
    assert all(r.fits == (r.peak_mem_gib <= dev.memory_gib) for r in rows)
    assert sum(r.chosen for r in rows) == 1 and rows[0].chosen and rows[0].fits
    assert all(rows[0].step_s <= r.step_s for r in rows if r.fits)
    none = estimate(llama, replace(dev, memory_gib=1e-6), 4, 8, "32-true")
    assert not any(r.chosen or r.fits for r in none)


def test_cli_on_a_transformers_config(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _llama_config().save_pretrained(tmp_path)
    args = ["--model", str(tmp_path), "--devices", "4", "--hardware", "cpu", "--seq", "64", "--global-batch", "8",
            "--precision", "32-true"]
    assert main(args + ["--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and all(list(r) == KEYS for r in rows)
    assert sum(r["chosen"] for r in rows) == 1 and rows[0]["chosen"]
    fitting = [r["tokens_per_s"] for r in rows if r["fits"]]
    assert fitting == sorted(fitting, reverse=True)
    assert main(args + ["--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "**chosen**" in out and out.strip().splitlines()[-1].startswith("chosen (dp, pp, mp)")


def test_cli_marks_what_does_not_fit(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=32).save_pretrained(tmp_path)  # Llama-2 7B
    assert main(["--model", str(tmp_path), "--devices", "8", "--hardware", "a100-40gb", "--seq", "4096",
                 "--global-batch", "64", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert any(not r["fits"] for r in rows) and any(r["fits"] for r in rows)
    unsharded = [r for r in rows if (r["dp"], r["zero"], r["recompute"]) == (8, 0, False)]
    assert unsharded and not any(r["fits"] for r in unsharded)  # 7B x 16 bytes > 40 GB


def test_cli_on_module_function(capsys: pytest.CaptureFixture) -> None:
    assert main(["--model", "tests.unit.test_estimator:tiny_module", "--devices", "2", "--hardware", "cpu",
                 "--global-batch", "4", "--precision", "32-true", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {(r["dp"], r["pp"], r["mp"]) for r in rows} == {(2, 1, 1), (1, 2, 1), (1, 1, 2)}


def test_cli_refuses_bad_input(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["--model", "no_such_thing", "--devices", "4", "--global-batch", "8"])
    assert "neither a config.json" in capsys.readouterr().err


def test_megatron_table1_within_15_percent() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import megatron_check
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    table = megatron_check.rows()
    assert len(table) == 10
    for r in table:
        tf, _ = megatron_check.predicted_tflops(r, DEVICES["a100-80gb"])
        assert abs(tf / r["tflops_per_gpu"] - 1) <= 0.15, (r["params_billion"], tf, r["tflops_per_gpu"])


def test_mfu_monitor_logs_measured_throughput_beside_the_prediction(llama: ModelProfile) -> None:
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_dpmp.tools.mfu import MFUMonitor

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(256, 16)
            self.out = torch.nn.Linear(16, 256)

        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            ids = batch[0]
            return torch.nn.functional.cross_entropy(self.out(self.emb(ids)).flatten(0, 1), ids.flatten())

        def configure_optimizers(self):  # noqa: ANN201
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = DataLoader(TensorDataset(torch.randint(0, 256, (16, 64))), batch_size=2)
    monitor = MFUMonitor(device="cpu", profile=llama)  # the Llama profile at seq 64: a prediction to log beside
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=5, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[monitor])
    trainer.fit(Tiny(), data)
    assert len(monitor.history) == 3  # steps 2..4 measured (one warm-up step, the last step has no successor)
    flops = llama.model_flops_per_token() * 2 * 64
    for row in monitor.history:
        assert row["tokens_per_s"] == pytest.approx(128 / row["step_s"])
        assert row["mfu"] == pytest.approx(flops / (row["step_s"] * DEVICES["cpu"].peak_flops["fp32"]))
        assert row["predicted_step_s"] > 0 and 0 < row["predicted_mfu"] < 1
    assert set(monitor.summary()) == set(monitor.history[0])
    assert "perf/mfu" in trainer.callback_metrics
    with pytest.raises(ValueError, match="known presets"):
        MFUMonitor(device="tpu")
