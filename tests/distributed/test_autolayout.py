"""``DPMPStrategy(dp="auto", mp="auto")`` in one 4-process launch: the layout the cost model ranks first is the one
built (two different choices from two sets of link figures, and this machine's own), the choice and its table are
in the plan printout, and training at the chosen layout reaches single-process training's weights (float64, 1e-8)
at the global batch the choice implies (dp x the loader's batch).

Issue 44 item 3: the ranking is the layout estimator's now (``planner.layout_search``), so the printout's words
and its table's columns changed ("chose dp=4, mp=1", rows ``-> dp pp mp zero ...``); the choices asserted are the
same."""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch

from lightning_dpmp.parallel.topology import Topology
from tests.conftest import run_ranks
from tests.distributed import autolayout_worker as W
from tests.support.models import ResMLP, build, reference_loader

CASES = ("latency", "bandwidth", "measured")


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    out = tmp_path_factory.mktemp("autolayout")
    proc = run_ranks(4, ["tests/distributed/autolayout_worker.py", str(out)], timeout=420)
    assert proc.returncode == 0, proc.stderr[-5000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    return out, ranks, proc.stdout + proc.stderr


def _reference(global_batch: int, path) -> dict:
    L.seed_everything(W.SEED, workers=True)
    model, dataset = build("resmlp")
    trainer = L.Trainer(
        accelerator="cpu", devices=1, precision="64-true", max_steps=W.STEPS, gradient_clip_val=W.CLIP,
        gradient_clip_algorithm="norm", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, reference_loader(dataset, global_batch, W.SEED))
    trainer.save_checkpoint(path)
    return torch.load(path, weights_only=True)["state_dict"]


@pytest.mark.slow
def test_choice_is_the_first_ranked_and_logged(launch):
    _, ranks, output = launch
    for case in CASES:
        layouts = {tuple(r[case]["layout"]) for r in ranks}
        assert len(layouts) == 1, f"{case}: ranks disagree on the layout: {layouts}"
        res = ranks[0][case]
        assert res["pending_before_fit"], "dp/mp must wait for setup"
        assert res["grid"] == res["layout"] and res["sampler"] == res["layout"][0]
        report = res["report"]
        dp, mp = res["layout"]
        assert f"chose {Topology(dp=dp, mp=mp)} of 4" in report and report in res["plan_text"]
        lines = report.splitlines()
        first = lines[next(i for i, line in enumerate(lines) if "dp  pp  mp" in line) + 1]
        assert first.split()[:4] == ["->", str(dp), "1", str(mp)], first  # the chosen row is the first ranked
        assert report.splitlines()[1] in output  # printed at setup, in the plan printout
    assert ranks[0]["latency"]["measured"] == ["latency"]
    assert ranks[0]["latency"]["layout"] == [4, 1]  # slow per message: no MP collectives
    assert ranks[0]["bandwidth"]["layout"][1] > 1  # slow per byte: the gradient all-reduce is what to avoid
    assert ranks[0]["measured"]["measured"] == [] and "links measured in" in ranks[0]["measured"]["report"]


@pytest.mark.slow
def test_parity_at_the_chosen_layout(launch, tmp_path):
    out, ranks, _ = launch
    refs: dict[int, dict] = {}
    for case in CASES:
        dp, mp = ranks[0][case]["layout"]
        batch = dp * W.PER_RANK_BATCH
        if batch not in refs:
            refs[batch] = _reference(batch, tmp_path / f"ref{batch}.ckpt")
        plain = ResMLP().double()
        plain.load_state_dict(torch.load(out / f"{case}.ckpt", weights_only=True)["state_dict"], strict=True)
        worst = max((plain.state_dict()[k] - v).abs().max().item() for k, v in refs[batch].items())
        print(f"mp='auto' {case}: dp={dp} x mp={mp}, max |w - w_ref| = {worst:.2e}")
        assert worst <= 1e-8, f"{case} at dp={dp} x mp={mp}: {worst:.3e}"
