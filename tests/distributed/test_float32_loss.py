"""A float32 loss inside a float64 model, judged against DDP at the same world size and against the loss's own
rounding (issue 42 item 3).

transformers' ``labels=`` loss computes in float32 (``logits.float()``) inside a ``precision="64-true"`` model, so
the 1e-8 float64 oracle cannot hold: AdamW carries every float32 rounding of the loss's gradient into the weights
(an entry whose gradient nearly cancels moves by ``lr`` times a noisy sign). Two references, trained in the same
session on the same global batch:

- Lightning's DDP at the same world size, in the same launch. Measured: it is one process bit for bit, because each
  rank's mean over its slice of a power-of-two split is an exact power-of-two scaling of one process's, and the
  softmax is per row. A bound of "2x DDP" would demand bitwise equality, which no vocab-parallel loss can give (its
  row sums add per-rank partial sums);
- the float32 loss's own effect on one process: the same run with the loss in float64 (transformers' loss written
  out without ``logits.float()``). Any float32 evaluation of the loss is that far from the exact one, so two
  valid evaluations may differ by about twice as much.

DPMP's distance from one process must be at most twice the larger of the two, per parameter class (token table,
LM head, attention, MLP, norms): the overall maximum alone would let a layer DPMP computes differently hide behind
the LM head's noise, which dominates every run. With the loss in float64 the same layouts equal one process to 1e-8
(parity holds on everything but the island).

Measured at the issue's size (``float32_loss_worker.py OUT CASES issue``: 11.3 M parameters, vocabulary 16,384,
8 steps, (2, 2)): before the vocab-parallel loss rounded as torch does, DPMP ended 1.5e-4 from one process at the
LM head, 4x the float32 loss's own effect (3.7e-5); see docs/design.md for the figures after.

One pooled launch of 4 ranks (``tests/distributed/float32_loss_worker.py``) trains DDP at world size 4 and DPMP at
(2, 2), (4, 1) and (1, 4) with the float32 loss, and (2, 2) with the float64 one; the one-process references train
in this process.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import run_ranks
from tests.distributed.float32_loss_worker import fit_case, save_model

pytest.importorskip("transformers")

WORKER = "tests/distributed/float32_loss_worker.py"
LAYOUTS = ["22", "41", "14"]
CASES = ["ddp", *LAYOUTS, "22-64"]
RATIO = 2.0
# a class whose distance from one process, under both strategies, is below this is float64 rounding alone:
# the ratio of two such numbers says nothing
FLOOR = 1e-10


def parameter_class(name: str) -> str:
    """The class a weight is judged in: what it computes, read from its place in transformers' Llama."""
    for key, cls in (("embed_tokens", "embedding"), ("lm_head", "head"), ("self_attn", "attention"),
                     ("mlp", "mlp"), ("norm", "norm")):
        if key in name:
            return cls
    return "other"


def distances(weights: dict, ref: dict) -> dict[str, float]:
    """Largest |w - w_ref| per parameter class."""
    out: dict[str, float] = {}
    for name, want in ref.items():
        got = torch.tensor(weights[name], dtype=torch.float64)
        d = (got - torch.tensor(want, dtype=torch.float64)).abs().max().item()
        cls = parameter_class(name)
        out[cls] = max(out.get(cls, 0.0), d)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("float32_loss")
    save_model(str(out))
    proc = run_ranks(4, [WORKER, str(out), ",".join(CASES)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    references = {case: json.loads(json.dumps(fit_case(case, str(out)))) for case in ("ref", "ref-64")}
    return ranks, references


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_dpmp_within_twice_the_float32_noise_of_one_process(runs, layout):
    ranks, refs = runs
    ref = refs["ref"]
    ddp = distances(ranks[0]["ddp"]["weights"], ref["weights"])
    island = distances(refs["ref-64"]["weights"], ref["weights"])  # what the float32 loss alone moves
    ours = distances(ranks[0][layout]["weights"], ref["weights"])
    moved = max(abs(a - b) for k, w in ref["weights"].items() for a, b in zip(w, ref["initial"][k]))
    print(f"float32 loss, dp={layout[0]} mp={layout[1]}: " + ", ".join(
        f"{c} {ours[c]:.2e} (ddp {ddp[c]:.2e}, float32 loss {island[c]:.2e})" for c in sorted(ddp))
        + f"; the weights moved by {moved:.2e}")
    for cls in ddp:
        noise = max(ddp[cls], island[cls])
        if max(ours[cls], noise) <= FLOOR:
            continue
        assert ours[cls] <= RATIO * noise, (layout, cls, ours[cls], ddp[cls], island[cls])


@pytest.mark.slow
def test_ddp_at_a_power_of_two_world_is_one_process_to_float64_rounding(runs):
    ranks, refs = runs
    assert max(distances(ranks[0]["ddp"]["weights"], refs["ref"]["weights"]).values()) <= 1e-12


@pytest.mark.slow
def test_with_the_loss_in_float64_dpmp_equals_one_process(runs):
    ranks, refs = runs
    worst = max(distances(ranks[0]["22-64"]["weights"], refs["ref-64"]["weights"]).values())
    print(f"float64 loss, dp=2 mp=2: {worst:.2e}")
    assert worst <= 1e-8, worst


@pytest.mark.slow
def test_logged_losses_close_to_one_process(runs):
    """Each step's logged loss: the float32 loss's rounding, 1e-6 relative, on every rank and layout."""
    ranks, refs = runs
    ref = refs["ref"]
    for case in ["ddp", *LAYOUTS]:
        for rank in ranks:
            got = rank[case]["logged"]
            assert got.keys() == ref["logged"].keys()
            worst = max(abs(got[s] - v) / abs(v) for s, v in ref["logged"].items())
            assert worst <= 1e-6, (case, worst)
