"""Lightning as people write it (issue 27): one batch per MP group whatever the loader does, all_gather and
prediction writers over DP, uneven loaders and refused callbacks named before anything hangs.

One 4-rank pool case runs the cases that train. The cases that must fail run in the pool of their world size when
every rank reports the failure (the rank pool keeps running: a second or less each); the one refused before any
process starts (``swa``) is launched, since there rank 0 alone raises. That a failing rank ends its whole launched
job, with no rank left behind, is ``test_reliability.py``'s subject. Parity is against single-process training on
the batches the MP groups actually trained on (float64, 1e-8).
"""

from __future__ import annotations

import json
import os
import time

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from tests.conftest import run_ranks, run_script
from tests.integration import data_path_worker as W
from tests.support.models import ResMLP, make_dataset, reference_loader
from tests.support.reference import max_json_diff, one_process_trainer

WORKER = "tests/integration/data_path_worker.py"


@pytest.fixture(scope="module")
def grid22(tmp_path_factory):
    out = tmp_path_factory.mktemp("data_path_2x2")
    proc = run_ranks(4, [WORKER, str(out)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


def _replay(used_by_rank: list) -> dict:
    """Single-process training on the global batches: step k = DP rank 0's batch k, then DP rank 1's."""
    steps = [
        (torch.tensor(used_by_rank[0][k][0] + used_by_rank[2][k][0], dtype=torch.float64),
         torch.tensor(used_by_rank[0][k][1] + used_by_rank[2][k][1]))
        for k in range(W.STEPS)
    ]
    L.seed_everything(0)
    model = ResMLP()
    one_process_trainer(max_steps=W.STEPS).fit(model, DataLoader(steps, batch_size=None))
    return model.state_dict()


_max_diff = max_json_diff


@pytest.mark.slow
def test_seeded_workers_with_augmentation_train_one_batch_per_mp_group(grid22):
    _, ranks = grid22
    case = [r["workers"] for r in ranks]
    assert case[0]["raw"] == case[1]["raw"] and case[2]["raw"] == case[3]["raw"]  # workers seeded by DP rank
    assert case[0]["raw"] != case[2]["raw"]  # DP ranks still draw their own augmentations
    assert case[0]["used"] == case[1]["used"] and case[2]["used"] == case[3]["used"]
    ref = _replay([c["used"] for c in case])
    for c in case:
        assert _max_diff(c["weights"], ref) <= 1e-8


@pytest.mark.slow
def test_a_loader_keyed_on_global_rank_trains_on_mp_rank_0s_batch(grid22):
    _, ranks = grid22
    case = [r["keyed"] for r in ranks]
    assert case[0]["raw"] != case[1]["raw"]  # the loaders differ on the two MP ranks ...
    assert case[1]["used"] == case[0]["used"] == case[0]["raw"]  # ... and both train on MP rank 0's batch
    assert case[3]["used"] == case[2]["used"] == case[2]["raw"]
    ref = _replay([c["used"] for c in case])
    for c in case:
        assert _max_diff(c["weights"], ref) <= 1e-8


@pytest.mark.slow
def test_all_gather_in_validation_step_returns_each_sample_once(grid22):
    _, ranks = grid22
    for r in ranks:
        assert sorted(r["gathered"]) == list(range(64)), len(r["gathered"])  # DDP's answer, not 128 (= x mp)


@pytest.mark.slow
def test_prediction_writer_writes_once_per_dp_rank(grid22):
    out, _ = grid22
    files = sorted(p.name for p in out.glob("pred_rank*.pt"))
    assert files == ["pred_rank0.pt", "pred_rank2.pt"]  # MP rank 0 of each group
    parts = [torch.load(out / f, weights_only=True) for f in files]
    idx = torch.cat([p["idx"] for p in parts])
    assert sorted(idx.tolist()) == list(range(64))
    L.seed_everything(0)
    model = W.GatherIndices().double()
    x = W.Indexed().x.double()
    logits = torch.cat([p["logits"] for p in parts])
    assert (logits - model(x[idx])).abs().max().item() <= 1e-12


@pytest.mark.slow
def test_the_mp_broadcast_costs_a_small_part_of_a_step(grid22):
    _, ranks = grid22
    for r in ranks:
        cost = r["cost"]
        step = sorted(cost["step_s"])[len(cost["step_s"]) // 2]
        print(f"broadcast {cost['broadcast_s'] * 1e3:.3f} ms, step {step * 1e3:.2f} ms (median)")
        assert cost["broadcast_s"] > 0 and step > 0


@pytest.mark.slow
def test_steps_that_skip_layers_train_with_find_unused_parameters(grid22):
    _, ranks = grid22
    L.seed_everything(0)
    model = W.StepSkip()
    one_process_trainer(max_steps=W.STEPS).fit(model, reference_loader(make_dataset(), 2 * W.PER_RANK, 0))
    for r in ranks:
        assert _max_diff(r["step_skip_weights"], model.state_dict()) <= 1e-8


@pytest.mark.slow
@pytest.mark.parametrize("name", ["swa", "ema"])
def test_weight_averaging_callbacks_average_the_split_model(grid22, tmp_path, name):
    out, ranks = grid22
    L.seed_everything(0)
    model = ResMLP()
    cb = W.averaging_callbacks()[name]
    trainer = one_process_trainer(max_epochs=3, callbacks=[cb])
    trainer.fit(model, reference_loader(make_dataset(), 2 * W.PER_RANK, 0))
    ref = model.state_dict()
    for r in ranks:
        assert _max_diff(r[f"{name}_weights"], ref) <= 1e-8
    trainer.save_checkpoint(tmp_path / "ref.ckpt")
    ours = torch.load(out / f"{name}.ckpt", weights_only=True)
    theirs = torch.load(tmp_path / "ref.ckpt", weights_only=True)
    entries = ["state_dict"] + (["current_model_state"] if name == "ema" else [])
    states = [(ours[e], theirs[e]) for e in entries]
    if name == "swa":  # the averaged copy lives in the callback's state
        key = next(k for k in theirs["callbacks"] if "StochasticWeightAveraging" in k)
        states.append((ours["callbacks"][key]["average_model_state"], theirs["callbacks"][key]["average_model_state"]))
    for mine, ref_state in states:
        assert mine.keys() == ref_state.keys()
        for k in ref_state:
            if isinstance(ref_state[k], torch.Tensor) and ref_state[k].is_floating_point():
                assert mine[k].shape == ref_state[k].shape, k  # dense, as one process writes it
                assert (mine[k] - ref_state[k]).abs().max().item() <= 1e-8, k


def _our_workers_left(tag: str) -> list[int]:
    """Pids of processes still running this case (their command line names its output folder)."""
    left = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if tag.encode() in f.read():
                        left.append(int(pid))
            except OSError:
                pass
    return left


def _fail(tmp_path, case: str, world: int, launched: bool, timeout: float = 280) -> tuple[str, float]:
    start = time.monotonic()
    args = [WORKER, str(tmp_path), case]
    proc = run_script(args, timeout=timeout) if launched else run_ranks(world, args, timeout=timeout)
    took = time.monotonic() - start
    assert proc.returncode != 0, proc.stdout[-3000:]
    if launched:
        deadline = time.monotonic() + 1  # the same 1 s bound as before, without waiting it out when all are gone
        while _our_workers_left(str(tmp_path)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _our_workers_left(str(tmp_path)), "a rank outlived its job"
    else:  # every rank raised the cause itself (none was cut short by another's failure)
        assert proc.rank_codes == [1] * world, proc.rank_codes
    return proc.stderr, took


@pytest.mark.slow
@pytest.mark.parametrize(
    "case, world, launched, expected",
    [
        ("check", 2, False, "the ranks of a tensor-parallel group hold different batches"),
        ("uneven_dp", 4, False, "different numbers of batches in training epoch 0 (rank 0 (dp_rank 0, mp_rank 0): 4;"),
        ("uneven_mp", 2, False, "rank 1 (dp_rank 0, mp_rank 1): 5)"),
        ("swa", 2, True, "StochasticWeightAveraging keeps a copy of the model to average into, but zero=3 frees"),
        ("unused", 4, False, "strategy=DPMPStrategy(dp=4, mp=1, find_unused_parameters=True)"),
    ],
)
def test_fails_fast_with_the_cause(tmp_path, case, world, launched, expected):
    err, took = _fail(tmp_path, case, world, launched)
    print(f"{case}: failed in {took:.1f} s from {'launch' if launched else 'the start of the pool case'}")
    assert expected in err, err[-4000:]
    assert "Timed out" not in err and took < 200, took  # the cause, long before the process-group timeout (300 s)
