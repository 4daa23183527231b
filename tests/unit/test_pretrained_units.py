"""One-process pieces of the pretrained path: slices read from safetensors and checkpoint files, key matching
(tied weights, base-model prefix), the streamed safetensors writer, parameters on meta with buffers computed, and
meta materialisation through a model's own ``_init_weights``."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from lightning_dpmp.checkpoint.hf_export import TensorEntry, parse_size, state_entries, write_config, write_streamed
from lightning_dpmp.checkpoint.weights import WeightFiles, defer_weights, load_deferred, match_keys
from lightning_dpmp.integration.pretrained import from_pretrained, load_weights
from lightning_dpmp.parallel.sharding import params_to_meta, shard_tensor
from lightning_dpmp.planner.materialize import empty_parameters, materialize

safetensors = pytest.importorskip("safetensors")
from safetensors.torch import save_file  # noqa: E402


@pytest.fixture
def files(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"fused.weight": torch.randn(12, 4, generator=g), "row.weight": torch.randn(4, 8, generator=g),
               "norm.weight": torch.randn(4, generator=g)}
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    torch.save({"state_dict": tensors}, tmp_path / "plain.ckpt")
    return tmp_path, tensors


@pytest.mark.parametrize("source", ["model.safetensors", "plain.ckpt", "."])
def test_slices_equal_shard_tensor(files, source):
    folder, tensors = files
    wf = WeightFiles(str(folder / source))
    assert wf.shape("fused.weight") == (12, 4)
    for parts in (1, 2):
        for part in range(parts):
            got = wf.read("fused.weight", 0, parts, part, blocks=3)  # q|k|v: the same rows of each block
            assert torch.equal(got, shard_tensor(tensors["fused.weight"], 0, parts, part, blocks=3))
            row = shard_tensor(tensors["row.weight"], 1, parts, part)
            assert torch.equal(wf.read("row.weight", 1, parts, part), row)
    assert torch.equal(wf.read("norm.weight"), tensors["norm.weight"])
    with pytest.raises(ValueError, match="does not split into 3 block"):
        wf.read("fused.weight", 0, 8, 0, blocks=3)


def test_missing_weights_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no model.safetensors"):
        WeightFiles(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="No pretrained weights"):
        WeightFiles(str(tmp_path / "nope.ckpt"))


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(6, 4)
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.embed.weight


def test_match_keys_finds_tied_and_prefixed_names():
    m = Tied()
    assert match_keys(m, ["embed.weight"]) == {"embed.weight": "embed.weight", "head.weight": "embed.weight"}
    assert match_keys(m, ["model.embed.weight"], prefix="model")["head.weight"] == "model.embed.weight"
    wrapped = nn.Sequential()
    wrapped.add_module("model", m)
    assert match_keys(wrapped, ["embed.weight"], prefix="model")["model.embed.weight"] == "embed.weight"


def test_deferred_load_one_process_and_errors(tmp_path):
    ref = Tied()
    save_file({"embed.weight": ref.embed.weight.detach()}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    with empty_parameters():
        m = Tied()
    assert m.embed.weight.is_meta and m.head.weight is m.embed.weight
    defer_weights(m, str(tmp_path))
    materialize(m, torch.device("cpu"), seed=0, mp_rank=0)
    assert load_deferred(m, None) == {"tensors": 1, "elements": 24}
    assert torch.equal(m.embed.weight, ref.embed.weight) and m.head.weight is m.embed.weight
    wrong = nn.Linear(4, 5)
    with empty_parameters():
        wrong = defer_weights(nn.Linear(4, 5), str(tmp_path), strict=True)
    materialize(wrong, torch.device("cpu"), 0, 0)
    with pytest.raises(KeyError, match="has no tensor for 'weight'"):
        load_deferred(wrong, None)


def test_load_weights_real_module_loads_now(tmp_path):
    ref = nn.Linear(3, 2)
    torch.save({"state_dict": {f"net.{k}": v for k, v in ref.state_dict().items()}}, tmp_path / "m.ckpt")
    got = load_weights(nn.Linear(3, 2), str(tmp_path / "m.ckpt"), prefix="net")
    assert torch.equal(got.weight, ref.weight) and torch.equal(got.bias, ref.bias)


def test_streamed_writer_reads_back(tmp_path):
    from safetensors import safe_open

    g = torch.Generator().manual_seed(1)
    tensors = {"a": torch.randn(3, 5, generator=g, dtype=torch.float64), "b": torch.randn(7, generator=g).bfloat16(),
               "c": torch.arange(6, dtype=torch.int64).reshape(2, 3)}
    entries = state_entries(tensors, {k: tuple(v.shape) for k, v in tensors.items()})
    out = str(tmp_path / "export")
    summary = write_streamed(out, entries, lambda e: tensors[e.name], max_shard_size=100)
    write_config(out, None, None)
    assert summary == {"files": 2, "tensors": 3, "bytes": 120 + 14 + 48}
    index = json.loads((tmp_path / "export" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 182 and set(index["weight_map"]) == {"a", "b", "c"}
    for name, t in tensors.items():
        with safe_open(os.path.join(out, index["weight_map"][name]), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            assert torch.equal(f.get_tensor(name), t)


def test_streamed_writer_refuses_wrong_tensor(tmp_path):
    with pytest.raises(ValueError, match="expected"):
        write_streamed(str(tmp_path / "x"), [TensorEntry("w", (2,), torch.float32)], lambda e: torch.ones(3))


def test_state_entries_store_tied_once():
    m = Tied()
    state = m.state_dict(keep_vars=True)
    names = [e.name for e in state_entries(state, {k: tuple(v.shape) for k, v in state.items()})]
    assert names == ["embed.weight"]


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("20KB") == 20_000 and parse_size("1GiB") == 2**30
    assert parse_size(7) == 7
    with pytest.raises(ValueError, match="max_shard_size"):
        parse_size("lots")


class WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 4, 2).float() / 4)), persistent=False)


def test_empty_parameters_computes_buffers_even_under_meta():
    with torch.device("meta"), empty_parameters():
        m = WithBuffer()
    assert m.lin.weight.is_meta and m.lin.weight.requires_grad
    assert not m.inv_freq.is_meta and torch.allclose(m.inv_freq, torch.tensor([1.0, 0.01]))
    materialize(m, torch.device("cpu"), 0, 0)
    assert not m.lin.weight.is_meta and torch.allclose(m.inv_freq, torch.tensor([1.0, 0.01]))
    meta = params_to_meta(m)
    assert m.lin.weight.is_meta and len(meta) == 2 and not m.inv_freq.is_meta


def test_materialize_uses_the_models_own_init():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, initializer_range=0.5)
    with empty_parameters():
        m = transformers.LlamaForCausalLM(cfg)
    materialize(m, torch.device("cpu"), 0, 0)
    assert torch.equal(m.model.norm.weight, torch.ones(16))  # RMSNorm has no reset_parameters: _init_weights
    assert 0.3 < m.model.layers[0].mlp.up_proj.weight.std().item() < 0.7  # normal(0, initializer_range)
    fresh = transformers.LlamaForCausalLM(cfg)
    assert torch.equal(m.model.rotary_emb.inv_freq, fresh.model.rotary_emb.inv_freq)


def test_from_pretrained_outside_the_strategy_is_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    eager = from_pretrained(transformers.LlamaForCausalLM, str(tmp_path), lazy=False)
    assert not any(p.is_meta for p in eager.parameters())
    lazy = from_pretrained(transformers.LlamaForCausalLM, str(tmp_path), lazy=True)
    assert all(p.is_meta for p in lazy.parameters()) and not lazy.training
    with pytest.raises(TypeError, match="does not take \\['device_map'\\]"):
        from_pretrained(transformers.LlamaForCausalLM, str(tmp_path), lazy=True, device_map="cpu")


def test_a_method_named_init_weights_outside_transformers_is_not_called():
    """The GPT example's ``_init_weights(n_layer)`` re-initialises its whole model: not a per-module init."""
    from examples.models.gpt import GPT

    with empty_parameters():
        m = GPT(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8)
    materialize(m, torch.device("cpu"), seed=0, mp_rank=0)
    assert all(torch.isfinite(p).all() for p in m.parameters())
    assert torch.equal(m.ln_f.weight, torch.ones(8))  # LayerNorm.reset_parameters
    assert m.blocks[0].mlp.fc1.weight.abs().max() <= 1 / 8**0.5  # nn.Linear's own bound, not the example's normal


def test_teardown_of_a_meta_module_moves_only_real_tensors():
    """Lightning's teardown calls ``lightning_module.cpu()`` and moves the optimizer state: on a module left on
    meta (a rank that does not keep the model, a setup that failed) that raises "Cannot copy out of meta tensor"
    over the first error; under ``meta_safe_teardown`` the real tensors move and the meta ones stay."""
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    from lightning_dpmp.integration.split import meta_safe_teardown

    module = WithBuffer()
    params_to_meta(module)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    with pytest.raises(NotImplementedError, match="meta tensor"):
        module.cpu()
    with meta_safe_teardown(module, [optimizer]) as movable:
        assert movable == []  # its state would be meta: left where it is
        _optimizers_to_device(movable, torch.device("cpu"))
        module.cpu()
    assert "cpu" not in module.__dict__
    assert module.lin.weight.is_meta and module.inv_freq.device.type == "cpu"


def test_match_keys_finds_a_module_wrapped_after_loading():
    """An adapter layer registered under the old name holds the original as a child: ``q.base.weight`` reads
    ``q.weight``; the adapter's own tensors (two levels below) are not in the checkpoint and stay unmatched."""

    class Wrapper(nn.Module):
        def __init__(self, base: nn.Module) -> None:
            super().__init__()
            self.base = base
            self.extra = nn.ModuleDict({"a": nn.Linear(4, 2)})

    m = nn.Sequential()
    m.add_module("q", Wrapper(nn.Linear(4, 4)))
    found = match_keys(m, ["q.weight", "q.bias"])
    assert found == {"q.base.weight": "q.weight", "q.base.bias": "q.bias"}, found


def test_lora_on_a_lazily_loaded_model_keeps_peft_initial_values(tmp_path):
    """``get_peft_model`` on a model whose weights are pending: the adapters stay real with peft's own initial
    values (the same as on an eagerly loaded model, B zeros), the base weights stay pending, and the deferred load
    reads the wrapped base weights from the checkpoint without calling the adapters missing."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(tmp_path)
    cfg = LoraConfig(r=2, target_modules=["q_proj", "v_proj"])
    torch.manual_seed(1)
    lazy = get_peft_model(from_pretrained(LlamaForCausalLM, str(tmp_path), lazy=True), cfg)
    torch.manual_seed(1)
    eager = get_peft_model(LlamaForCausalLM.from_pretrained(str(tmp_path)), cfg)
    ours, ref = dict(lazy.named_parameters()), dict(eager.named_parameters())
    adapters = [n for n in ours if "lora_" in n]
    assert len(adapters) == 4 and all(not ours[n].is_meta and torch.equal(ours[n], ref[n]) for n in adapters)
    assert all(ours[n].is_meta for n in ours if n not in adapters)
    materialize(lazy, torch.device("cpu"), seed=0, mp_rank=0)
    load_deferred(lazy, None)
    for n, p in lazy.named_parameters():
        assert torch.equal(p, ref[n]), n


def test_lazy_float16_keeps_transformers_fp32_modules(tmp_path):
    """T5 loaded in float16 keeps its ``wo`` projections in float32 (``_keep_in_fp32_modules``), lazily as
    transformers does eagerly; after the deferred load the values equal transformers' own."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    T5ForConditionalGeneration(T5Config(vocab_size=32, d_model=16, d_kv=4, num_heads=4, d_ff=32, num_layers=1,
                                        decoder_start_token_id=0, pad_token_id=0)).save_pretrained(tmp_path)
    eager = T5ForConditionalGeneration.from_pretrained(str(tmp_path), dtype=torch.float16)
    lazy = from_pretrained(T5ForConditionalGeneration, str(tmp_path), lazy=True, dtype=torch.float16)
    want = {n: p.dtype for n, p in eager.named_parameters()}
    assert {n: p.dtype for n, p in lazy.named_parameters()} == want
    assert {n for n, d in want.items() if d == torch.float32} == {
        "encoder.block.0.layer.1.DenseReluDense.wo.weight", "decoder.block.0.layer.2.DenseReluDense.wo.weight"}
    materialize(lazy, torch.device("cpu"), seed=0, mp_rank=0)
    load_deferred(lazy, None)
    ref = dict(eager.named_parameters())
    for n, p in lazy.named_parameters():
        assert torch.equal(p, ref[n]), n


def test_materialize_initialises_a_whole_parallel_layer_alike_on_every_rank():
    """An EnteredLinear (a LoRA ``A`` inside a column region) holds only whole parameters: on meta, every MP rank must
    draw the same values (a split layer draws its own shard per rank)."""
    from lightning_dpmp.parallel.entry import SharedInputCopy
    from lightning_dpmp.parallel.layers import EnteredLinear

    def built(rank: int) -> nn.Module:
        with torch.device("meta"):
            layer = EnteredLinear(8, 2, bias=False, shared_input=SharedInputCopy(None))
        root = nn.Sequential()
        root.add_module("a", layer)
        materialize(root, torch.device("cpu"), seed=0, mp_rank=rank)
        return layer

    assert torch.equal(built(0).weight, built(1).weight)


def _tiny_mixtral(folder):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    MixtralForCausalLM(cfg).save_pretrained(str(folder))
    return MixtralForCausalLM


def test_a_converted_layout_is_read_as_transformers_reads_it(tmp_path):
    """Mixtral's file holds ``block_sparse_moe.experts.<i>.w1/w2/w3``; the model ``mlp.experts.gate_up_proj`` (4
    experts' w1|w3 stacked) and ``down_proj``: the view names the model's keys, makes each stack once per group from
    whole source tensors, slices it like any split tensor, and keeps one group at a time."""
    from lightning_dpmp.checkpoint.weights import ConvertedWeights
    from lightning_dpmp.integration.pretrained import converted_view

    cls = _tiny_mixtral(tmp_path)
    want = cls.from_pretrained(str(tmp_path)).state_dict()
    lazy = from_pretrained(cls, str(tmp_path), lazy=True)
    files = WeightFiles(str(tmp_path))
    assert not any("gate_up_proj" in k for k in files.keys())
    view = converted_view(lazy, files)
    assert isinstance(view, ConvertedWeights)
    assert sorted(view.keys()) == sorted(want), set(view.keys()) ^ set(want)
    key = "model.layers.1.mlp.experts.gate_up_proj"
    assert view.shape(key) == tuple(want[key].shape) == (4, 48, 16)
    assert torch.equal(view.read(key), want[key])
    for part in range(2):  # the fused gate|up blocks, split per block as the experts' split holds them
        got = view.read(key, dim=1, parts=2, part=part, blocks=2)
        assert torch.equal(got, shard_tensor(want[key], 1, 2, part, 2))
    assert torch.equal(view.read("model.layers.0.mlp.gate.weight"), want["model.layers.0.mlp.gate.weight"])
    view.read("model.layers.0.mlp.experts.down_proj")
    held = view._made[1]  # noqa: SLF001 - the bound: one group's tensors held, the last one made
    assert list(held) == ["model.layers.0.mlp.experts.down_proj"]


def test_a_checkpoint_in_the_models_own_layout_needs_no_view(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_dpmp.integration.pretrained import converted_view

    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=4)).save_pretrained(str(tmp_path))
    lazy = from_pretrained(LlamaForCausalLM, str(tmp_path), lazy=True)
    assert converted_view(lazy, WeightFiles(str(tmp_path))) is None


def test_deferred_load_of_a_converted_layout_equals_transformers(tmp_path):
    cls = _tiny_mixtral(tmp_path)
    want = cls.from_pretrained(str(tmp_path)).state_dict()
    lazy = from_pretrained(cls, str(tmp_path), lazy=True)
    materialize(lazy, torch.device("cpu"), 0, 0)
    read = load_deferred(lazy, None)
    assert read["tensors"] == len(want)
    got = lazy.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
