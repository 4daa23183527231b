"""Pipeline planning without processes: the grid's third axis, the balanced cut, micro-batches, the probe's
refusals (each names the layer and the reason) and the constructor's checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_dpmp import DPMPStrategy
from lightning_dpmp.integration.pipeline import (
    batch_shapes,
    check_batch_shapes,
    reading_ranks,
    split_microbatches,
)
from lightning_dpmp.parallel.grid import Grid
from lightning_dpmp.parallel.stage_runner import bubble_fraction
from lightning_dpmp.parallel.topology import Topology
from lightning_dpmp.planner.stages import StageCutError, balance, probe_stack, stand_in_shape


# ---------------------------------------------------------------------------------------------- the grid
def test_ranks_put_mp_innermost_then_pp_then_dp():
    dp, pp, mp = 2, 2, 2
    topology = Topology(dp=dp, mp=mp, pp=pp)
    seen = set()
    for rank in range(dp * pp * mp):
        d, s, m = topology.coords(rank)
        assert rank == (d * pp + s) * mp + m == topology.rank_of(d, s, m)
        seen.add((d, s, m))
    assert len(seen) == 8
    assert topology.mp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]  # consecutive: one node
    assert topology.dp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topology.pp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topology.rows() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    grid = Grid(topology, rank=6)
    assert (grid.dp_rank, grid.pp_rank, grid.mp_rank, grid.world_size) == (1, 1, 0, 8)
    assert (grid.batch_src, grid.batch_width) == (4, 4)  # the row of DP replica 1 starts at rank 4
    assert "pp_rank=1" in str(grid)


def test_without_a_pipeline_the_grid_is_unchanged():
    topology = Topology(dp=2, mp=2)
    assert (topology.mp_groups(), topology.dp_groups()) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    grid = Grid(topology, rank=3)
    assert (grid.dp_rank, grid.mp_rank, grid.pp_rank, grid.batch_src, grid.batch_width) == (1, 1, 0, 2, 2)


def test_world_size_mismatch_names_every_number():
    with pytest.raises(ValueError, match=r"DPMPStrategy\(dp=1, pp=2, mp=2\) needs dp\*pp\*mp = 4 processes, but "
                                         r"devices=2 x num_nodes=1 = 2"):
        Topology(dp=1, mp=2, pp=2).check_world(2, devices=2)


# ---------------------------------------------------------------------------------------------- the cut
def test_balance_minimises_the_largest_stage():
    assert balance([1.0] * 8, 0, 0, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # a heavy head (the vocabulary projection) pulls blocks off the last stage
    assert balance([1.0] * 6, 0, 3.0, 2) == [(0, 4), (4, 6)]
    assert balance([1.0] * 6, 3.0, 0, 2) == [(0, 1), (1, 6)]  # 4 and 5 (a tie with 5 and 4: the earlier cut)
    # uneven blocks: the cut follows the cost, not the count
    assert balance([5.0, 1.0, 1.0, 1.0, 1.0, 1.0], 0, 0, 2) == [(0, 1), (1, 6)]
    with pytest.raises(StageCutError, match="4 pipeline stages need at least 4 repeated blocks; the model has 3"):
        balance([1.0] * 3, 0, 0, 4)


def test_bubble_fraction():
    assert bubble_fraction("gpipe", 4, 4) == pytest.approx(3 / 7)
    assert bubble_fraction("interleaved", 2, 4, stages_per_rank=2) == pytest.approx(1 / 9)
    assert bubble_fraction("1f1b", 1, 4) == 0.0


def test_microbatches_split_every_tensor_along_dim0():
    batch = (torch.arange(8).view(4, 2), {"mask": torch.ones(4, 3), "n": 7})
    parts = split_microbatches(batch, 2)
    assert [p[0].tolist() for p in parts] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert all(p[1]["n"] == 7 and p[1]["mask"].shape == (2, 3) for p in parts)
    with pytest.raises(ValueError, match=r"pp_microbatches=3 must divide the batch: a batch tensor has 4 rows"):
        split_microbatches(batch, 3)


def test_microbatches_keep_a_mapping_type_and_its_tensors_count():
    """transformers' ``BatchEncoding`` is one leaf to torch's pytree: it must still be cut, and stay itself."""
    from transformers import BatchEncoding

    batch = BatchEncoding({"input_ids": torch.arange(8).view(4, 2), "attention_mask": torch.ones(4, 2)})
    parts = split_microbatches(batch, 2)
    assert all(isinstance(p, BatchEncoding) for p in parts)
    assert [p["input_ids"].tolist() for p in parts] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert batch_shapes(batch) == [(2,), (2,)]


def test_stand_in_shapes_follow_the_input():
    recorded = ((8, 16), (8, 16, 32), torch.float64)
    assert stand_in_shape(recorded, torch.zeros(2, 16, dtype=torch.long)) == (2, 16, 32)
    assert stand_in_shape(((16,), (16, 32), torch.float32), torch.arange(16)) == (16, 32)
    assert stand_in_shape(((8, 16), (4, 32), torch.float32), torch.zeros(8, 16)) is None  # not a prefix: run it


def test_a_batch_of_another_shape_is_refused_before_any_send():
    planned = batch_shapes((torch.zeros(8, 16, dtype=torch.long), torch.zeros(8, 16, dtype=torch.long)))
    check_batch_shapes(planned, (torch.zeros(4, 16), torch.zeros(4, 16)))  # a smaller batch: fine
    with pytest.raises(ValueError, match=r"had shapes \(past the batch dim\) \[\(16,\), \(16,\)\]; this batch has "
                                         r"\[\(12,\), \(12,\)\]"):
        check_batch_shapes(planned, (torch.zeros(8, 12), torch.zeros(8, 12)))


# ---------------------------------------------------------------------------------------------- the probe
class Block(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x, mask=None):
        h = self.fc(x)
        return x + torch.tanh(h if mask is None else h * mask)


class Net(nn.Module):
    """Embedding, a stack of blocks, a head; ``mode`` breaks the cut in one of the ways the probe must catch."""

    def __init__(self, mode: str = "", n: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(n))
        self.head = nn.Linear(8, 10)
        self.mode = mode

    def forward(self, ids):
        x = self.emb(ids)
        mask = (ids > 0).unsqueeze(-1).to(x.dtype)  # from the batch: every stage recomputes it
        kept, first = [], x
        for i, block in enumerate(self.blocks):
            if self.mode == "order" and i == 1:
                x = self.blocks[3](x)
            x = block(x, mask=first if self.mode == "side" and i == 2 else mask)
            kept.append(x)
            if self.mode == "between":
                x = x * 2
        loss = F.cross_entropy(self.head(x).view(-1, 10), ids.view(-1))
        if self.mode == "reads":
            loss = loss + kept[1].pow(2).mean()
        return loss


def _probe(mode: str, n: int = 4):
    torch.manual_seed(0)
    net = Net(mode, n)
    ids = torch.randint(0, 10, (4, 5))
    return probe_stack(net, lambda: net(ids), batch_size=4)


def test_probe_records_the_stream_costs_and_parameter_regions():
    profile = _probe("")
    assert profile.names == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert profile.stream == 0 and profile.stream_shape == (4, 5, 8) and profile.output_arity == 0
    assert profile.flops == [2.0 * 4 * 5 * 8 * 8] * 4 and profile.post_flops == 2.0 * 4 * 5 * 8 * 10
    assert profile.params == [72] * 4 and profile.pre_params == 80 and profile.post_params == 90
    assert list(profile.pre_modules) == ["emb"] and profile.pre_modules["emb"][1] == (4, 5, 8)
    assert not profile.pre_direct


def test_a_parameter_inside_a_block_belongs_to_its_stage_even_unread():
    """A block parameter the probed step never read (an expert no token chose on the first batch) goes to its
    block's stage, where a later batch reads it, not to the first stage; one no block holds and no code read goes
    to the first."""
    torch.manual_seed(0)
    net = Net("", 4)
    net.blocks[3].spare = nn.Linear(8, 8)  # never called: unread in the probe
    net.unused = nn.Linear(2, 2)  # outside every block, never read
    ids = torch.randint(0, 10, (4, 5))
    profile = probe_stack(net, lambda: net(ids), batch_size=4)
    ranks = reading_ranks(net, profile, [(0, 2), (2, 4)], 2)
    assert ranks[id(net.blocks[3].spare.weight)] == {1}
    assert ranks[id(net.blocks[0].fc.weight)] == {0} and ranks[id(net.head.weight)] == {1}
    assert ranks[id(net.unused.weight)] == {0}


@pytest.mark.parametrize("mode,words", [
    ("reads", "the code after the block stack reads the output of block blocks.1"),
    ("side", "block blocks.2 reads a tensor that the code before the block stack computed and that carries "
             "gradients"),
    ("between", "code between two blocks reads the output of block blocks.0 (mul"),
    ("order", "the repeated blocks ran in the order"),
])
def test_probe_refuses_a_step_that_cannot_be_cut_and_says_where(mode, words):
    with pytest.raises(StageCutError, match=words.replace("(", r"\(").replace(")", r"\)")):
        _probe(mode)


def test_probe_needs_a_stack():
    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x).sum()

    flat = Flat()
    with pytest.raises(StageCutError, match="Flat has 0"):
        probe_stack(flat, lambda: flat(torch.ones(2, 4)), batch_size=2)


# ---------------------------------------------------------------------------------------------- arguments
@pytest.mark.parametrize("kwargs,words", [
    (dict(pp=0), "`pp` must be a positive integer, got 0"),
    (dict(pp=2, pp_schedule="zb"), "`pp_schedule` must be one of"),
    (dict(pp=2, pp_schedule="interleaved"), "set pp_stages_per_rank >= 2"),
    (dict(pp=2, pp_stages_per_rank=2), "needs pp_schedule='interleaved'"),
    (dict(pp=2, pp_schedule="interleaved", pp_stages_per_rank=2, pp_microbatches=3), "a multiple of pp"),
    (dict(pp=2, pp_microbatches=0), "`pp_microbatches` must be a positive integer, got 0"),
])
def test_bad_pipeline_arguments_are_refused_at_construction(kwargs, words):
    with pytest.raises(ValueError, match=words):
        DPMPStrategy(**{"dp": 1, "mp": 1, **kwargs})


def test_a_pipeline_with_dp_and_mp_chosen_at_setup():
    # Issue 44 item 3 lifted the refusal of DPMPStrategy(pp=2) with dp="auto", mp="auto": the layout estimator
    # now chooses (dp, mp) at setup with pp fixed, so the layout is pending until then.
    import lightning as L

    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=DPMPStrategy(pp=2), logger=False)
    assert trainer.strategy.layout_pending and trainer.strategy.chooses_layout


def test_default_microbatches_one_per_stage():
    config = Topology(pp=2, schedule="interleaved", stages_per_rank=2)
    assert (config.microbatches, config.stages) == (4, 4)
    assert Topology(pp=1, microbatches=3) == Topology()  # no pipeline: its settings are unused
