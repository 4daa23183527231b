"""Pipeline parallelism (``DPMPStrategy(pp=...)``): the same weights as one process, the exact sends and MP
collectives per step, logging, resuming at other layouts, and a refusal at setup for a step that cannot be cut.

One launch per (dp, pp, mp) trains the GPT example (tied embeddings: a parameter on two stages) and transformers'
Llama in float64 with GPipe and 1F1B; at (1, 2, 1) also both with 4 blocks under the interleaved schedule (2 stages
per rank) and GPT with gradient accumulation; at (2, 2, 1) also under ZeRO 1, 2 and 3. The oracle is single-process
Lightning on the same global batch.
"""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch

from tests.conftest import run_ranks
from tests.distributed import parity_worker as PW
from tests.distributed import pipeline_worker as W
from tests.distributed.checkpoint_worker import SaveAtTrainEnd
from tests.support.layouts import layout_launches, spec_references, spec_tag
from tests.support.models import build, reference_loader
from tests.support.reference import max_weight_diff, one_process_trainer

WORKER = "tests/distributed/pipeline_worker.py"
TOL = 1e-8
BASIC = ["gpt:1f1b", "gpt:gpipe", "hf_llama:1f1b", "hf_llama:gpipe"]
RUNS = {
    (1, 2, 1): BASIC + ["gpt4:interleaved:2", "hf_llama4:interleaved:2", "gpt:1f1b:acc2"],
    # torch.compile'd blocks inside the stages; sequence parallelism inside the stages
    (1, 2, 2): BASIC + ["gpt:1f1b:compile", "gpt:1f1b:sp", "gpt_untied:gpipe:sp"],
    # the guard gathers every stage's parameters every 5 steps; ZeRO over each stage's DP group
    # a ModuleList MoE (an expert no token chose keeps no gradient) without and with ZeRO; a mixed-precision policy
    # (float32 compute, float64 masters and reductions: within float32's rounding of one process, never equal)
    (2, 2, 1): BASIC + ["gpt:1f1b:guard", "gpt:1f1b:z1", "gpt:gpipe:z2", "hf_llama:gpipe:z2", "gpt:1f1b:z3",
                        "hf_llama:1f1b:z3", "gpt:1f1b:z3:acc2", "gpt4:interleaved:2:z3", "moe_list:1f1b",
                        "moe_list:1f1b:z2", "moe_list:gpipe:z3", "gpt:1f1b:z3:fp32", "gpt:gpipe:z2:fp32"],
    (1, 3, 1): ["gpt4:1f1b"],  # the tied table and head on the first and last of three stages, not the middle
    (2, 2, 2): ["gpt:1f1b:z2", "hf_llama:1f1b:z3", "gpt:1f1b:z3:sp"],  # ZeRO and MP (and SP) inside each stage
}
CASES = [(layout, spec) for layout, specs in RUNS.items() for spec in specs]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{(dp, pp, mp): (out dir, [rank results])}``, one launch per layout, launched when first needed."""
    return layout_launches(tmp_path_factory, WORKER, "pp", timeout=600, specs=RUNS)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return spec_references(tmp_path_factory, "pp")


@pytest.mark.slow
@pytest.mark.parametrize("layout,spec", CASES, ids=[f"dp{a}pp{b}mp{c}-{s}" for (a, b, c), s in CASES])
def test_weights_and_logged_loss_match_single_process(runs, references, layout, spec):
    out, ranks = runs(layout)
    ref, ref_logged = references(spec)
    worst = max_weight_diff(torch.load(out / f"{spec_tag(spec)}.ckpt", weights_only=True), ref)
    print(f"pipeline parity {spec} (dp, pp, mp)={layout} float64: max |w - w_ref| = {worst:.2e}")
    if spec.endswith(":fp32"):  # computed in float32: off by its rounding, never by more, and never equal
        assert 1e-9 < worst <= 1e-4, (layout, spec, worst)
    else:
        assert worst <= TOL, (layout, spec, worst)
    if spec.endswith(":compile"):  # every block ran compiled (the stand-ins only replace the other stages' blocks)
        assert all(r[spec_tag(spec)]["compiled_blocks"] == 2 for r in ranks)
    # every rank logs its DP replica's loss (the mean over micro-batches): with dp=1, the batch's one process logs
    results = [r[spec_tag(spec)] for r in ranks]
    for r in results:
        logged = {int(k): v for k, v in r["logged"].items()}
        first = next(q for q in results if q["grid"][0] == r["grid"][0])  # the same DP replica
        assert r["logged"] == first["logged"], (layout, spec, r["grid"])
        assert logged.keys() == ref_logged.keys()
        if layout[0] == 1:
            assert max(abs(logged[k] - ref_logged[k]) for k in logged) < 1e-9, (layout, spec, r["grid"])


def _stages(spec: str, pp: int) -> int:
    return pp * int(spec.split(":")[2]) if spec.split(":")[1] == "interleaved" else pp


def _sends(pp_rank: int, pp: int, stages: int, m: int) -> int:
    """Sends of one rank per step: each of its stages sends its activation on (but the last) and its input's
    gradient back (but the first), once per micro-batch."""
    return m * sum((s < stages - 1) + (s > 0) for s in range(pp_rank, stages, pp))


def _zero(spec: str) -> int:
    return next((int(e[1:]) for e in spec.split(":")[2:] if e.startswith("z")), 0)


@pytest.mark.slow
@pytest.mark.parametrize("layout,spec", CASES, ids=[f"dp{a}pp{b}mp{c}-{s}" for (a, b, c), s in CASES])
def test_sends_and_collectives_per_step_are_exact(runs, layout, spec):
    dp, pp, mp = layout
    _, ranks = runs(layout)
    m, stages = W.MICROBATCHES, _stages(spec, pp)
    results = [r[spec_tag(spec)] for r in ranks]
    # activations forward and their gradients back, once per micro-batch and cut: 2 (K - 1) M per pipeline
    sends = sum(r["counts"].get("pp/send", 0) for r in results)
    assert sends == dp * mp * 2 * (stages - 1) * m, [r["counts"] for r in results]
    assert sum(r["counts"].get("pp/recv", 0) for r in results) == sends
    assert all(r["counts"].get("pp/send", 0) == _sends(r["grid"][1], pp, stages, m) for r in results)
    zero, blocks = _zero(spec), stages // pp  # (every model here has one block per stage)
    # a step that may leave parameters out (experts): ZeRO agrees over DP which buckets got a gradient, one flag
    # per bucket in one all-reduce at the end of each backward (zero=3: every micro-batch's), and reduce-scatters
    # unit by unit
    flags = {0: 0, 1: 1, 2: 1, 3: m}[zero] if spec.startswith("moe") else 0
    for r in results:
        counts = r["counts"]
        # one flat gradient bucket; under ZeRO the norm of the clipping (the gradients are DP shards)
        assert counts.get("dp/all_reduce", 0) == (1 + flags if dp > 1 else 0), counts
        # the norm of the clipping; with GPT's tied table and head, their gradient summed over the two stages
        assert counts["pp/all_reduce"] == 1 + (spec.split(":")[0] in ("gpt", "gpt4")), counts
        assert counts["pp/broadcast"] == 1, counts  # the loss and logged values, from the last stage
        if zero in (1, 2):  # the schedule's gradients reduce-scattered once per step; the updated shards gathered
            assert (counts["dp/reduce_scatter"], counts["dp/all_gather"]) == (1 + bool(flags), 1), counts
        elif zero == 3:  # each block gathered for its forward and its backward and reduce-scattered, per
            # micro-batch; the rest of the stage (embeddings, or norm and head) gathered once per optimizer step
            # (with accumulation the counted batch is the window's second: gathered already), reduce-scattered each
            assert counts["dp/all_gather"] == 2 * m * blocks + (not spec.endswith(":acc2")), (spec, counts)
            assert counts["dp/reduce_scatter"] == m * (blocks + 1), counts
        sp = spec.endswith(":sp")
        assert set(counts) <= {"pp/send", "pp/recv", "pp/all_reduce", "pp/broadcast", "dp/all_reduce",
                               "mp/all_reduce"} | ({"dp/reduce_scatter", "dp/all_gather"} if zero else set()) | (
                                   {"mp/all_gather", "mp/reduce_scatter"} if sp else set()), counts
    if mp > 1:  # each pipeline's MP collectives: every layer's once per micro-batch, on its own stage only
        for d in range(dp):
            for m_rank in range(mp):
                pipe = [r for r in results if r["grid"][0] == d and r["grid"][2] == m_rank]
                analytic = pipe[0]["analytic"]
                # + per stage: the clipping norm's all-reduce; with sequence parallelism also the one flat sum of
                # the gradients of the parameters that saw 1/mp of the tokens (every stage's norms)
                extra = pp * (1 + spec.endswith(":sp"))
                total = sum(r["counts"]["mp/all_reduce"] for r in pipe)
                assert total == m * pipe[0]["analytic_all_reduce"] + extra, [r["counts"] for r in pipe]
                for op in ("all_gather", "reduce_scatter"):
                    total = sum(r["counts"].get(f"mp/{op}", 0) for r in pipe)
                    expected = analytic["forward"].get(op, 0) + analytic["backward"].get(op, 0)
                    assert total == m * expected, (op, [r["counts"] for r in pipe])


@pytest.mark.slow
def test_plan_printout_names_stages_and_bubble(runs):
    _, ranks = runs((1, 2, 1))
    text = ranks[0][spec_tag("hf_llama4:interleaved:2")]["plan_text"]
    assert "pipeline: pp=2 x 2 stage(s) per rank, schedule interleaved, 4 micro-batches per step; bubble 11.1%" in text
    assert ("stage 0 (pp_rank 0): net.model.layers.0 .. net.model.layers.0 (1 blocks) + the code before the stack"
            in text)
    assert "stage 3 (pp_rank 1): net.model.layers.3 .. net.model.layers.3 (1 blocks) + the code after it" in text
    assert ranks[0][spec_tag("gpt4:interleaved:2")]["ranges"] == [[0, 1], [1, 2], [2, 3], [3, 4]]
    assert "read on several stages (gradients summed over PP): net.wte.weight" in ranks[0][spec_tag("gpt:1f1b")][
        "plan_text"]


@pytest.mark.slow
def test_the_first_step_runs_once_at_setup(runs):
    """Issue 43 item 4: the stage cut's probe rides on the plan's dense run (one record of the first step), so with
    mp=1 (nothing to verify) every rank runs the step once at setup; it ran twice before (probe, then trace)."""
    _, ranks = runs((1, 2, 1))
    for rank in ranks:
        assert {tag: res["setup_steps"] for tag, res in rank.items()} == {tag: 1 for tag in rank}


def _fit_one_process(steps: int, ckpt=None, save=None) -> None:
    L.seed_everything(PW.SEED, workers=True)
    model, dataset = build("gpt")
    model = model.double()  # one process restores before converting the precision: float64 from the start
    trainer = one_process_trainer(max_steps=steps, gradient_clip_val=PW.CLIP, gradient_clip_algorithm="norm",
                                  callbacks=[SaveAtTrainEnd([(False, str(save))])] if save else [])
    trainer.fit(model, reference_loader(dataset, PW.GLOBAL_BATCH, PW.SEED), ckpt_path=ckpt)


def _launch_and_match_resumed(tmp_path, mode: str, prefix: str) -> None:
    """Launch the worker's ``mode`` on 4 ranks; its ``<prefix>_c.ckpt`` and ``<prefix>_s.ckpt`` (resumed from a
    consolidated and a sharded save at step 10, trained to 20) must match one process interrupted at step 10."""
    proc = run_ranks(4, [WORKER, mode, str(tmp_path)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    _fit_one_process(PW.STEPS // 2, save=tmp_path / "ref10.ckpt")
    _fit_one_process(PW.STEPS, tmp_path / "ref10.ckpt", tmp_path / "ref20.ckpt")
    ref20 = torch.load(tmp_path / "ref20.ckpt", weights_only=True)
    for tag in ("c", "s"):
        worst = max_weight_diff(torch.load(tmp_path / f"{prefix}_{tag}.ckpt", weights_only=True), ref20)
        assert worst <= TOL, (mode, tag, worst)


@pytest.mark.slow
def test_resume_from_a_pipeline_at_other_layouts_and_on_one_process(tmp_path):
    """10 steps at (1, 2, 2) saved in both formats, resumed at (2, 1, 2) to 20 and then on one process to 30: the
    single-process run interrupted at the same steps (resuming decides which batches follow)."""
    _launch_and_match_resumed(tmp_path, "resume", "final_212")
    _fit_one_process(30, tmp_path / "ref20.ckpt", tmp_path / "ref30.ckpt")
    _fit_one_process(30, tmp_path / "final_212_c.ckpt", tmp_path / "one30.ckpt")
    worst = max_weight_diff(torch.load(tmp_path / "one30.ckpt", weights_only=True),
                            torch.load(tmp_path / "ref30.ckpt", weights_only=True))
    assert worst <= TOL, worst


@pytest.mark.slow
def test_a_meta_device_model_builds_only_its_stage(tmp_path):
    """``init_module(empty_init=True)`` at (1,2,1): each rank holds about half the parameters when training starts
    and trains to the weights the same meta model reaches at (2,1,1) (the split seeds each module's initialisation
    by its name); the (2,1,1) checkpoint loads back into the pipelined meta model exactly."""
    proc = run_ranks(2, [WORKER, "meta", str(tmp_path)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    for r in range(2):
        report = json.loads((tmp_path / f"meta_rank{r}.json").read_text())
        assert report["211"]["held"] == report["211"]["dense"]
        assert report["121"]["held"] < 0.55 * report["121"]["dense"], report  # its own stage's parameters
    pipelined = torch.load(tmp_path / "meta_121.ckpt", weights_only=True)
    plain = torch.load(tmp_path / "meta_211.ckpt", weights_only=True)
    assert max_weight_diff(pipelined, plain) <= TOL
    loaded = torch.load(tmp_path / "meta_loaded_121.ckpt", weights_only=True)
    assert all(torch.equal(loaded["state_dict"][k], v) for k, v in plain["state_dict"].items())


@pytest.mark.slow
def test_a_step_that_cannot_be_cut_is_refused_at_setup(tmp_path):
    proc = run_ranks(2, [WORKER, "refuse", str(tmp_path)], timeout=300)
    assert proc.returncode != 0
    assert ("cannot cut this training step into pipeline stages: the code after the block stack reads the output "
            "of block net.net.blocks.0") in proc.stderr, proc.stderr[-3000:]
    assert not list(tmp_path.glob("started*")), "a training step ran before the refusal"


@pytest.mark.slow
def test_zero_under_a_pipeline_evaluates_saves_and_resumes(tmp_path):
    """ZeRO at (dp, pp, mp) = (2, 2, 1): 10 steps at zero=2 with a validation run, saved in both formats; resumed
    under the pipeline at zero=3 and at (2, 1, 2) zero=1 to 20 steps: the single-process run interrupted at the
    same step. A meta-device Llama at zero=3 under the pipeline holds 1/(dp pp) of its parameters and trains to the
    weights of the same meta model at (4, 1, 1)."""
    _launch_and_match_resumed(tmp_path, "zero", "zfinal")
    # the validation run at step 10 saw the whole trained model on every stage: one batch of 8 per DP rank (the
    # even and the odd samples of the first 16), the loss averaged over DP
    model, dataset = build("gpt")
    model = model.double()
    model.load_state_dict(torch.load(tmp_path / "ref10.ckpt", weights_only=True)["state_dict"])
    x, y = (torch.stack(t) for t in zip(*(dataset[i] for i in range(2 * PW.GLOBAL_BATCH))))
    with torch.no_grad():
        logits = model(x)
        expected = float(torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1)))
    reports = [json.loads((tmp_path / f"zero_rank{r}.json").read_text()) for r in range(4)]
    for report in reports:
        assert abs(report["val_loss"] - expected) < 1e-12, (report["val_loss"], expected)
        meta = report["zmeta"]
        assert meta["held"] < 0.26 * meta["dense"], meta  # its stage's parameters, 1/dp of them
    worst = max_weight_diff(torch.load(tmp_path / "zmeta.ckpt", weights_only=True),
                            torch.load(tmp_path / "zmeta_411.ckpt", weights_only=True))
    assert worst <= TOL, worst
