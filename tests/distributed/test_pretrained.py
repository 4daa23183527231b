"""Pretrained models in and out: tiny transformers checkpoints (written with ``save_pretrained``, one file and a
sharded index) loaded with ``lightning_dpmp.from_pretrained`` at (1,2), (2,2) and (1,4), each rank reading only
its slices, against single-process training from transformers' own ``from_pretrained``.

- right after the load, every tensor a rank holds equals its slice of the file exactly (Mixtral, whose file holds
  per-expert tensors that transformers stacks when it loads: its slice of transformers' own loaded tensors);
- 20 float64 AdamW steps (norm clipping) end within 1e-8 of single-process training, with the usual shifted loss
  and with transformers' ``labels=`` loss (tied Llama, where it computes in float32: 1e-7; T5), Conv1D with fused
  q|k|v (GPT-2), T5's one embedding under three names, and at zero=3;
- an export written with ``strategy.save_pretrained`` while the model is split, and ``python -m
  lightning_dpmp.convert CKPT OUT --hf --config BASE``, load back (transformers) to the trained weights exactly;
- LoRA adapters (peft) added to the lazily loaded model follow their base layers with no collective of their own:
  on a column-parallel base ``A`` stays whole inside the base's region and ``B`` is split like the base (2 + 2
  all-reduces per block, no all-gather); on a row-parallel base ``A`` is split by input and ``B`` stays whole;
- ``trainer.validate`` with a step that generates keeps the split layout (2 all-reduces per block per token) and
  gives transformers' tokens;
- after ``fit`` only global rank 0 holds the model (``consolidate_on_teardown="rank0"``), and a second ``fit`` on
  the same module takes its weights from rank 0: 6 + 4 steps equal single-process 6 + 4.

One launch per layout trains every case.
"""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch

from tests.conftest import run_ranks
from tests.distributed import pretrained_worker as W
from tests.support import pretrained as P
from tests.support.models import reference_loader
from tests.support.reference import one_process_trainer

pytest.importorskip("transformers")

CASES = {
    (2, 2): ["llama", "llama_tied+sharded", "gpt2", "t5", "llama+again", "llama+z3", "llama+lora", "mixtral"],
    (1, 2): ["llama", "gpt2", "t5", "llama@generate", "llama+lora", "llama+lora_all", "mixtral+sharded",
             "gpt2_vocab67+sharded"],
    (1, 4): ["llama_tied+sharded", "gpt2", "gpt2_vocab67"],
}


# transformers' labels= loss casts the logits to float32 (``logits.float()``) even in a float64 model: that step
# rounds like float32 on one process too. The vocab-parallel loss rounds as torch's does on most entries; the rest
# (row sums rounded otherwise) moves 20 AdamW steps by 2.4e-8 at (2,2) and (1,4) (1.5e-7 before it did; how such a
# loss is judged: tests/distributed/test_float32_loss.py).
FLOAT32_LOSS_TOL = {"llama_tied+sharded": 1e-7}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrained_runs")
    for case in {P.base(c) + ("+sharded" if "+sharded" in c else "") for cases in CASES.values() for c in cases}:
        P.save(case, str(root / "pretrained"))
    return root


def _reference(folder, case: str) -> dict:
    """Single process, transformers' own from_pretrained, the same steps and global batch."""
    L.seed_everything(W.SEED, workers=True)
    path = str(folder / "pretrained" / P.checkpoint_case(case))
    model = P.lightning_module(case, P.model_class(case).from_pretrained(path, **P.load_kwargs(case)))
    for steps in W.AGAIN_STEPS if "+again" in case else (W.STEPS,):
        trainer = one_process_trainer(max_steps=steps, gradient_clip_val=W.CLIP, gradient_clip_algorithm="norm")
        trainer.fit(model, reference_loader(P.dataset(), W.GLOBAL_BATCH, W.SEED))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def references(folders):
    cases = sorted({c for cs in CASES.values() for c in cs if "@" not in c})
    return {c: _reference(folders, c) for c in cases}


@pytest.fixture(scope="module", params=sorted(CASES), ids=lambda layout: f"dp{layout[0]}_mp{layout[1]}")
def run(request, folders):
    dp, mp = request.param
    out = folders / f"dp{dp}_mp{mp}"
    out.mkdir()
    proc = run_ranks(dp * mp, ["tests/distributed/pretrained_worker.py", str(dp), str(mp), str(out),
                                ",".join(CASES[(dp, mp)])], timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(dp * mp)]
    return dp, mp, out, ranks


def _cases(run):
    """The layout's training cases (``@generate`` validates instead)."""
    return [c for c in CASES[(run[0], run[1])] if "@" not in c]


@pytest.mark.slow
def test_each_rank_reads_exactly_its_slices(run):
    dp, mp, _, ranks = run
    for case in _cases(run):
        for r, rank in enumerate(ranks):
            got = rank[case]
            assert got["lazy"], f"{case} rank {r}: from_pretrained loaded the whole model"
            assert got["load_diff"] == 0.0, f"{case} rank {r}: {got['load_diff']:.3e} from the file's slices"
            assert got["split_tensors"] > 0, f"{case}: nothing split at mp={mp}"
            if P.base(case) == "mixtral":  # the file: block_sparse_moe.gate and experts.<i>.w1/w2/w3 per layer; the
                # model: mlp.gate (renamed), mlp.experts.gate_up_proj and down_proj (stacked), in each of 2 layers
                assert got["converted_tensors"] == 6, got["converted_tensors"]


@pytest.mark.slow
def test_fine_tuning_matches_single_process(run, references):
    dp, mp, out, _ = run
    for case in _cases(run):
        ours = torch.load(out / f"{case}.ckpt", weights_only=True)["state_dict"]
        ref = references[case]
        assert ours.keys() == ref.keys(), set(ours) ^ set(ref)
        worst = max((ours[k] - ref[k]).abs().max().item() for k in ref)
        print(f"pretrained parity {case} dp={dp} mp={mp} float64: {worst:.2e}")
        tol = FLOAT32_LOSS_TOL.get(case, 1e-8)
        assert worst <= tol, f"{case} dp={dp} mp={mp}: {worst:.3e} > {tol:.0e}"


@pytest.mark.slow
def test_export_during_fit_loads_back_exactly(run):
    dp, mp, out, _ = run
    for case in _cases(run):
        if "+again" in case or "+lora" in case:
            continue
        trained = torch.load(out / f"{case}.ckpt", weights_only=True)["state_dict"]
        back = P.model_class(case).from_pretrained(str(out / f"{case}_export"), **P.load_kwargs(case))
        assert back.dtype == torch.float64  # the config says what the weights are
        for k, v in back.state_dict().items():
            assert torch.equal(v, trained[f"net.{k}"]), f"{case}: {k} differs after the export"


@pytest.mark.slow
def test_only_rank_zero_keeps_the_model_after_fit(run):
    _, _, _, ranks = run
    for case in _cases(run):
        held = [rank[case]["rank_holds_model"] for rank in ranks]
        assert held == [True] + [False] * (len(ranks) - 1), f"{case}: {held}"


@pytest.mark.slow
def test_convert_hf_from_the_consolidated_checkpoint(run, folders, tmp_path):
    from lightning_dpmp.convert import main

    dp, mp, out, _ = run
    for case in (c for c in _cases(run) if "+lora" not in c):
        base = str(folders / "pretrained" / P.checkpoint_case(case))
        target = tmp_path / f"{case}_hf"
        assert main([str(out / f"{case}.ckpt"), str(target), "--hf", "--config", base, "--max-shard-size", "20KB"]) == 0
        trained = torch.load(out / f"{case}.ckpt", weights_only=True)["state_dict"]
        back = P.model_class(case).from_pretrained(str(target), **P.load_kwargs(case))
        for k, v in back.state_dict().items():
            assert torch.equal(v, trained[f"net.{k}"]), f"{case}: {k} differs after convert --hf"


@pytest.mark.slow
def test_generation_keeps_the_split_layout(run, folders):
    """``trainer.validate`` whose step calls ``generate`` (greedy, 4 new tokens) on a model loaded lazily: the plan
    comes from the first pass through the model, so every decode step costs 2 all-reduces per block, plus the
    embedding's all-reduce and the logits' all-gather, and the tokens are transformers' own on one process."""
    dp, mp, _, ranks = run
    if (dp, mp) != (1, 2):
        pytest.skip("generation is checked at (1, 2)")
    got = ranks[0]["llama@generate"]
    assert all(r["llama@generate"]["tokens"] == got["tokens"] for r in ranks)
    net = P.model_class("llama").from_pretrained(str(folders / "pretrained" / "llama")).double()
    prompt = P.dataset().tensors[0][:2, :8]
    want = net.generate(prompt, max_new_tokens=P.NEW_TOKENS, min_new_tokens=P.NEW_TOKENS, do_sample=False,
                        pad_token_id=0)[:, 8:].tolist()
    assert got["tokens"] == [want]
    styles = got["styles"]
    assert {styles[f"net.model.layers.{b}.self_attn.{p}_proj"] for b in (0, 1) for p in "qkv"} == {"column"}
    rows = ("self_attn.o_proj", "mlp.down_proj")
    assert {styles[f"net.model.layers.{b}.{p}"] for b in (0, 1) for p in rows} == {"row"}
    blocks, forwards = 2, P.NEW_TOKENS  # one forward per new token (the prefill makes the first)
    assert got["counts"] == {"mp/all_reduce": forwards * (2 * blocks + 1), "mp/all_gather": forwards}, got["counts"]
    assert "planned from the first complete pass through net" in got["plan_text"]


@pytest.mark.slow
def test_lora_adapters_follow_their_base_layers(run):
    """peft's LoRA on q and v (column-parallel bases): ``A`` is whole and reads the base's entry (its gradient summed
    over MP once per step), ``B`` is split by output features, and a block costs what the frozen base alone costs,
    2 all-reduces forward and 2 backward, with no all-gather; on every Linear (``+lora_all``), the row-parallel
    bases' ``A`` is split by input (one all-reduce of its rank-4 output) and their ``B`` stays whole. The measured
    collectives of a training step are the plan's, plus the clipping norm and the one partial-gradient sum."""
    dp, mp, _, ranks = run
    for case in (c for c in _cases(run) if "+lora" in c):
        got = ranks[0][case]
        styles, blocks = got["styles"], got["per_block"]
        pre = "net.base_model.model.model.layers"
        for b in (0, 1):
            for proj in P.LORA_TARGETS["+lora_all" if "+lora_all" in case else "+lora"]:
                sub = "self_attn" if proj[0] in "qkvo" else "mlp"
                a, bb = (styles[f"{pre}.{b}.{sub}.{proj}.lora_{x}.default"] for x in "AB")
                want = ("row", "replicate") if proj in ("o_proj", "down_proj") else ("partial", "column")
                assert (a, bb) == want, (case, b, proj, a, bb)
        block = blocks[f"{pre}.1"]
        extra = 2 if "+lora_all" in case else 0  # the two row-parallel A's all-reduce their rank-4 outputs
        assert block["forward"] == {"all_reduce": 2 + extra, "all_gather": 0}, (case, block)
        assert block["backward"] == {"all_reduce": 2, "all_gather": 0}, (case, block)
        comm = got["comm"]
        assert comm["forward"]["all_gather"] == comm["backward"]["all_gather"] == 0, comm
        planned = comm["forward"]["all_reduce"] + comm["backward"]["all_reduce"]
        for r, rank in enumerate(ranks):
            mp_counts = {k: n for k, n in rank[case]["step_counts"].items() if k.startswith("mp/")}
            assert mp_counts == {"mp/all_reduce": planned + 2}, (case, r, rank[case]["step_counts"])
            assert rank[case]["mp_replicated_bitwise_equal"], (case, r)
        assert "partial gradients: " in got["plan_text"], got["plan_text"]  # the printout says so
