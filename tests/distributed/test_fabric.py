"""Lightning Fabric under FabricDPMPStrategy (issue 21, item 6): transformers' Llama, float64, at (2,2) and (1,2).

One launch per layout (``fabric_worker.py``) trains three runs; each is compared with the same loop on one process
(global batch 8, the same sample order):
- 10 AdamW steps with norm clipping: weights within 1e-8 of one process, the plan split (head-parallel attention,
  every block Linear column or row) and verified at the model's first call;
- 6 steps, ``fabric.save``, a fresh model and optimizer, ``fabric.load`` before their first call, 4 steps: the
  10-step single-process weights (the optimizer state is sliced when the model splits);
- 5 steps of 2 accumulated micro-batches under ``fabric.no_backward_sync``: the single-process weights;
- the same model saved with ``save_pretrained`` and read by ``lightning_dpmp.from_pretrained`` (on the meta device
  until its first call, then each rank reads only its slices): the 10-step weights;
- the collectives of one training step, counted: the plan's MP all-reduces, one for the clipping norm, the batch's
  broadcast, and exactly one DP all-reduce for the gradients;
- ``fabric.all_gather`` / ``all_reduce`` default to the DP group;
- 4 steps with an L2 term in the loss, reading the weight and gradient norms and ``state_dict()`` each step (the
  parameters are DTensors at mp > 1): the single-process values on every rank and its weights.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from tests.conftest import run_layout
from tests.distributed import fabric_worker as W
from tests.support.models import make_lm_dataset

pytest.importorskip("transformers")

LAYOUTS = [(2, 2), (1, 2), (2, 1)]


def _reference(steps: int, micro: int = 1, l2: float = 0.0, watch=None) -> dict:
    """The same loop on one process: Fabric on one device, "64-true" (its forward context makes float64 the
    default dtype, which transformers' rotary embedding follows)."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, precision="64-true")
    net = W.llama()
    optimizer = torch.optim.AdamW(net.parameters(), lr=W.LR, weight_decay=0.01)
    model, optimizer = fabric.setup(net, optimizer)
    data = iter(DataLoader(make_lm_dataset(vocab=W.VOCAB, seq=W.SEQ), batch_size=W.GLOBAL_BATCH // micro))
    for _ in range(steps):
        W.one_step(fabric, model, optimizer, data, micro, l2, watch)
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


@pytest.fixture(scope="module")
def references():
    watched: dict = {}
    return {"straight": _reference(10), "accumulated": _reference(5, micro=2),
            "watched": _reference(W.WATCHED_STEPS, l2=W.L2, watch=watched), "watched_values": watched}


@pytest.fixture(scope="module", params=LAYOUTS, ids=lambda layout: f"dp{layout[0]}_mp{layout[1]}")
def run(request, tmp_path_factory):
    dp, mp = request.param
    out = tmp_path_factory.mktemp(f"fabric_dp{dp}_mp{mp}")
    _, ranks = run_layout("tests/distributed/fabric_worker.py", dp, mp, out, timeout=600)
    return dp, mp, out, ranks


def _worst(path, ref) -> float:
    ours = torch.load(path, weights_only=True)["model"]
    assert ours.keys() == ref.keys(), set(ours) ^ set(ref)
    return max((ours[k] - ref[k]).abs().max().item() for k in ref)


@pytest.mark.slow
@pytest.mark.parametrize("name,ref", [("straight", "straight"), ("resumed", "straight"),
                                      ("accumulated", "accumulated"), ("pretrained", "straight"),
                                      ("watched", "watched")])
def test_fabric_training_matches_one_process(run, references, name, ref):
    dp, mp, out, _ = run
    worst = _worst(out / f"{name}.ckpt", references[ref])
    print(f"fabric parity {name} dp={dp} mp={mp} float64: {worst:.2e}")
    assert worst <= 1e-8, f"{name} at dp={dp} mp={mp}: {worst:.3e}"


@pytest.mark.slow
def test_user_code_reads_the_dense_model(run, references):
    """At mp > 1 the parameters are DTensors: ``model.parameters()``' weight and gradient norms (read after
    ``fabric.clip_gradients``, which reduces the gradients), ``model.state_dict()`` and an L2 term in the loss see
    one process's model on every rank (before: each rank's MP shards, the L2 term a partial sum)."""
    dp, mp, _, ranks = run
    want = references["watched_values"]
    for rank in ranks:
        assert rank["modes"] == (1 if mp > 1 else 0)  # one bridge for the 5 models split, none at mp=1
        got = rank["watched"]
        assert got.keys() == want.keys()
        for key, values in want.items():
            assert len(got[key]) == W.WATCHED_STEPS, key
            worst = max(abs(a - b) / max(abs(b), 1.0) for a, b in zip(got[key], values))
            assert worst < 1e-10, (dp, mp, key, got[key], values)


@pytest.mark.slow
def test_the_model_is_split_at_its_first_call(run):
    dp, mp, _, ranks = run
    got = ranks[0]
    if mp == 1:
        assert got["split"] == 0 and "mp=1" in got["text"]
        return
    styles = got["styles"]
    assert got["verified"], got["text"]
    for b in (0, 1):
        assert {styles[f"model.layers.{b}.self_attn.{p}_proj"] for p in "qkv"} == {"column"}, styles
        assert {styles[f"model.layers.{b}.mlp.{p}_proj"] for p in ("gate", "up")} == {"column"}, styles
        assert {styles[f"model.layers.{b}.{p}"] for p in ("self_attn.o_proj", "mlp.down_proj")} == {"row"}, styles
    assert got["split"] >= 14, got["split"]  # 7 Linears per block, 2 blocks, plus what else the plan split


@pytest.mark.slow
def test_a_steps_collectives_are_counted_exactly(run):
    dp, mp, _, ranks = run
    counts, comm = ranks[0]["counts"], ranks[0]["comm"]
    if mp == 1:
        assert counts == {"dp/all_reduce": 1}, counts  # DP only: the gradients' one all-reduce, nothing else
        return
    planned = comm["forward"]["all_reduce"] + comm["backward"]["all_reduce"]
    # the plan's all-reduces, one more for the clipping norm (shards' squares summed over MP)
    assert counts["mp/all_reduce"] == planned + 1 + 1, (counts, comm)  # + the batch's 2-int layout check
    assert counts.get("mp/broadcast", 0) == 1, counts  # the MP group's first rank sends its batch
    assert counts.get("mp/all_gather", 0) == comm["forward"].get("all_gather", 0), (counts, comm)
    if dp > 1:
        assert counts["dp/all_reduce"] == 1, counts  # every gradient, presence flags included, in one float64 buffer


@pytest.mark.slow
def test_user_collectives_default_to_the_dp_group(run):
    dp, mp, _, ranks = run
    for rank in ranks:
        assert rank["pretrained_lazy"]
        assert rank["gathered"] == [float(r) for r in range(dp)]
        assert rank["summed"] == float(dp)


def test_a_bad_grid_fails_before_launch():
    from lightning.fabric import Fabric

    from lightning_dpmp import FabricDPMPStrategy

    with pytest.raises(ValueError, match="3"):
        Fabric(accelerator="cpu", devices=3, strategy=FabricDPMPStrategy(dp=2, mp=2))
    with pytest.raises(ValueError, match="zero=3"):
        FabricDPMPStrategy(dp=2, mp=2, zero=3)


