"""FusedOutput without processes: the cuts a model makes in dense coordinates (split sizes, slice bounds, narrow)
are read as this rank's; shape-keeping ops keep the reading, others return plain tensors; a cut inside a block is
refused with the blocks named."""

from __future__ import annotations

import pytest
import torch

from lightning_dpmp.parallel.fused import FusedOutput, FusedOutputError

BLOCKS, MP = (8, 4, 4), 2  # q | k | v dense widths; this rank holds 4 | 2 | 2


@pytest.fixture
def dense():
    torch.manual_seed(0)
    return torch.randn(3, 2, 16, dtype=torch.float64)


def local(dense: torch.Tensor, rank: int = 1) -> FusedOutput:
    """Rank ``rank``'s share, cut as the layer's weight is: its half of each block."""
    parts = [b.chunk(MP, -1)[rank] for b in dense.split(list(BLOCKS), -1)]
    return FusedOutput.wrap(torch.cat(parts, -1), BLOCKS, MP)


def expected(dense: torch.Tensor, rank: int = 1) -> list[torch.Tensor]:
    return [b.chunk(MP, -1)[rank] for b in dense.split(list(BLOCKS), -1)]


CUTS = {
    "split(list, -1)": lambda t: t.split([8, 4, 4], dim=-1),
    "torch.split(tuple, dim=2)": lambda t: torch.split(t, (8, 4, 4), dim=2),
    "split_with_sizes": lambda t: t.split_with_sizes([8, 4, 4], -1),
    "slices with ...": lambda t: (t[..., :8], t[..., 8:12], t[..., 12:]),
    "full-index slices": lambda t: (t[:, :, 0:8], t[:, :, 8:12], t[:, :, 12:16]),
    "negative bounds": lambda t: (t[..., :-8], t[..., -8:-4], t[..., -4:]),
    "narrow": lambda t: (t.narrow(-1, 0, 8), t.narrow(2, 8, 4), t.narrow(-1, 12, 4)),
    "after clamp": lambda t: t.clamp(-1, 1).split([8, 4, 4], -1),
}


@pytest.mark.parametrize("cut", sorted(CUTS))
def test_dense_cuts_give_this_ranks_blocks(dense, cut):
    got = CUTS[cut](local(dense))
    want = expected(dense) if cut != "after clamp" else expected(dense.clamp(-1, 1))
    assert len(got) == 3
    for g, w in zip(got, want):
        assert type(g) is torch.Tensor and torch.equal(g, w)


def test_other_ops_see_a_plain_tensor(dense):
    t = local(dense)
    assert type(t * 2) is FusedOutput and type(t.sum(-1)) is torch.Tensor and t.shape == (3, 2, 8)
    assert type(t.view(3, 2, 4, 2)) is torch.Tensor and t[0].shape == (2, 8)  # (no cut of the last dim)
    assert t.split(4, -1)[0].shape == (3, 2, 4)  # an int size is the code's own per-rank reading


def test_a_cut_inside_a_block_is_refused_naming_the_blocks(dense):
    with pytest.raises(FusedOutputError, match=r"blocks are \[8, 4, 4\].*holds \[4, 2, 2\]"):
        local(dense)[..., :6]
    with pytest.raises(FusedOutputError, match="column_gather"):
        local(dense).split([6, 6, 4], -1)
