"""ZeRO-2/3 flat-shard layout and engine in one process (a world-size-1 gloo group): the math, not the launch."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_dpmp.parallel.zero_engine import ZeroEngine, find_units
from lightning_dpmp.parallel.zero_shard import FlatLayout, rebuild_optimizer, storage_bytes


@pytest.mark.parametrize("numels,dp", [([3, 4], 2), ([5], 4), ([1, 1, 1], 3), ([7, 2, 9], 4), ([16], 1)])
def test_layout_pads_to_a_multiple_of_dp_and_slices_cover_each_element_once(numels, dp):
    layout = FlatLayout.of(numels, dp)
    assert layout.total % dp == 0 and layout.total - sum(numels) < dp and layout.shard * dp == layout.total
    hits = [torch.zeros(n, dtype=torch.int64) for n in numels]
    for r in range(dp):
        lo, hi = layout.owned(r)
        assert hi - lo == layout.shard
        for i, a, b, s in layout.pieces(r):
            assert 0 <= s and s + (b - a) <= layout.shard
            assert layout.offsets[i] + a == lo + s  # where the piece sits in the flat buffer
            hits[i][a:b] += 1
    assert all(bool((h == 1).all()) for h in hits)


def test_optimizers_whose_update_depends_on_shape_are_refused():
    p = nn.Parameter(torch.ones(4, 4))
    if hasattr(torch.optim, "Adafactor"):
        with pytest.raises(ValueError, match="Adafactor"):
            rebuild_optimizer(torch.optim.Adafactor([p]), [[p]])
    opt = rebuild_optimizer(torch.optim.AdamW([p], lr=0.1, weight_decay=0.3), [[p]])
    assert type(opt) is torch.optim.AdamW and opt.param_groups[0]["weight_decay"] == 0.3


class Net(nn.Module):
    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.emb = nn.Linear(6, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)) for _ in range(3))
        self.act = nn.ModuleList([nn.GELU()])  # owns no parameters: not a unit
        self.head = nn.Linear(8, 2)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        if tied:
            self.blocks[2][1].weight = self.blocks[0][1].weight  # reached from two units: the root's

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = h + b(h)
        h = self.blocks[1](h)  # a unit called twice in one step
        return self.head(self.act[0](h) + self.frozen(h))


def test_units_are_the_parameterised_children_of_module_lists():
    assert [n for n, _ in find_units(Net())] == ["blocks.0", "blocks.1", "blocks.2"]


@pytest.mark.parametrize("level", [2, 3])
@pytest.mark.parametrize("tied", [False, True])
def test_engine_steps_like_the_plain_optimizer(world1, level, tied):
    torch.manual_seed(0)
    ref = Net(tied).double()
    net = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    split = {id(net.emb.weight)}  # kinds only change the bucketing here (mp=1)
    engine = ZeroEngine(net, [torch.optim.AdamW(net.parameters(), lr=0.05)], level, world1, split, set())
    opt = engine.optimizers[0]
    if level == 3:
        assert all(p.untyped_storage().nbytes() == 0 for p in net.parameters())  # freed between steps
        units = {b.unit for b in engine.buckets}
        assert units == {-1, 0, 1, 2}
        if tied:
            tied_w = net.blocks[0][1].weight
            assert next(b for b in engine.buckets if any(p is tied_w for p in b.params)).unit == -1
    x = torch.randn(5, 6, dtype=torch.float64)
    for _ in range(3):
        for micro in range(2):  # gradient accumulation: the first micro-batch keeps gradients local (zero=2)
            ref(x[micro:]).square().mean().backward()
            engine.gather_root()
            if micro == 0:
                with engine.no_sync():
                    net(x[micro:]).square().mean().backward()
            else:
                net(x[micro:]).square().mean().backward()
        assert all(p.grad is None for p in net.parameters())  # reduce-scattered into the shards, freed
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
        engine.after_step()
    with engine.gathered():
        for (n, a), b in zip(net.named_parameters(), ref.parameters()):
            assert torch.allclose(a, b, atol=1e-12), n
    plain = engine.plain_optimizer(0)
    for pa, pb in zip(plain.param_groups[0]["params"], ref_opt.param_groups[0]["params"]):
        if pb in ref_opt.state:
            assert torch.allclose(plain.state[pa]["exp_avg"], ref_opt.state[pb]["exp_avg"], atol=1e-12)
    for p in plain.param_groups[0]["params"]:  # what checkpoints write from and load into: views of the shards
        with engine.gathered():
            whole = p.detach().reshape(-1).clone()
        pieces = engine.param_pieces(p)
        assert (pieces is None) == (level == 2 and not p.requires_grad)  # zero=2 leaves frozen ones whole
        for lo, hi, view in pieces or []:
            assert torch.equal(view, whole[lo:hi])
        for key in ("exp_avg", "exp_avg_sq"):
            pieces = engine.state_pieces(0, p, key)
            assert (pieces is None) == (p not in plain.state)
            for lo, hi, view in pieces or []:
                assert torch.equal(view, plain.state[p][key].reshape(-1)[lo:hi])
    report = storage_bytes(engine.shard_params())
    assert report == sum(b.layout.shard * 8 for b in engine.buckets if b.trainable)
    released = engine.release()
    assert all(p.untyped_storage().nbytes() == p.numel() * 8 for p in net.parameters())
    for (n, a), b in zip(net.named_parameters(), ref.parameters()):
        assert torch.allclose(a, b, atol=1e-12), n
    assert len(released[0].state) == len(ref_opt.state)


def test_zero3_without_resharding_keeps_units_gathered_until_the_synchronised_backward(world1):
    """``reshard_after_forward=False``: a unit stays gathered after its forward (not under ``no_grad``), and while
    accumulating (``no_sync``) after its backward too, its gradients stashed whole; the synchronised backward
    reduce-scatters and frees. Per optimizer step of two micro-batches: 4 all-gathers (root + 3 units, each once)
    and 4 reduce-scatters, against 15 and 8 with resharding (measured); the weights are the plain optimizer's."""
    from lightning_dpmp.integration.accounting import CommCounter

    torch.manual_seed(0)
    ref = Net().double()
    net = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    engine = ZeroEngine(net, [torch.optim.AdamW(net.parameters(), lr=0.05)], 3, world1, set(), set(),
                        reshard_after_forward=False)
    opt = engine.optimizers[0]

    def gathered(u):
        return all(p.untyped_storage().nbytes() > 0 for p in net.blocks[u].parameters())

    x = torch.randn(5, 6, dtype=torch.float64)
    engine.gather_root()
    with torch.no_grad():
        net(x)
    # no backward to come: freed after each forward (unit 2 stays prefetched by blocks[1]'s second call)
    assert not gathered(0) and not gathered(1)
    engine.after_step()
    for step in range(3):
        counter = CommCounter({"dp": world1})
        with counter:
            for micro in range(2):
                ref(x[micro:]).square().mean().backward()
                engine.gather_root()
                if micro == 0:
                    with engine.no_sync():
                        loss = net(x[micro:]).square().mean()
                        assert all(gathered(u) for u in range(3))  # kept for the backward
                        loss.backward()
                    assert all(gathered(u) for u in range(3))  # kept for the next micro-batch
                    assert all(p.grad is None for p in net.parameters())  # stashed whole in the buckets
                else:
                    net(x[micro:]).square().mean().backward()
                    assert not any(gathered(u) for u in range(3))
            assert all(p.grad is None for p in net.parameters())
            ref_opt.step()
            ref_opt.zero_grad()
            opt.step()
            opt.zero_grad()
            engine.after_step()
        assert (counter.counts[("dp", "all_gather")], counter.counts[("dp", "reduce_scatter")]) == (4, 4), step
    with engine.gathered():
        for (n, a), b in zip(net.named_parameters(), ref.parameters()):
            assert torch.allclose(a, b, atol=1e-12), n


def test_reshard_after_forward_false_is_zero3s():
    from lightning_dpmp import DPMPStrategy
    from lightning_dpmp.parallel.zero_engine import ZeroEngine as Engine

    for zero in (0, 1, 2):
        with pytest.raises(ValueError, match=rf"reshard_after_forward=False applies to zero=3 .*got zero={zero}"):
            DPMPStrategy(dp=2, mp=1, pp=2, zero=zero, reshard_after_forward=False)
    with pytest.raises(TypeError, match=r"`reshard_after_forward` must be True or False, got 'no' \(str\)"):
        DPMPStrategy(dp=2, mp=1, zero=3, reshard_after_forward="no")
    strategy = DPMPStrategy(dp=2, mp=1, pp=2, zero=3, reshard_after_forward=False)
    assert strategy.parallel_config.reshard_after_forward is False
    assert DPMPStrategy(dp=2, mp=1, zero=3, reshard_after_forward=False).parallel_config.reshard_after_forward is False
    with pytest.raises(ValueError, match=r"zero=2 never frees"):
        Engine(Net(), [], 2, None, set(), set(), reshard_after_forward=False)


def test_zero_argument_errors_name_the_values():
    from lightning_dpmp import DPMPStrategy

    with pytest.raises(ValueError, match=r"got 4"):
        DPMPStrategy(dp=2, mp=1, zero=4)
    with pytest.raises(ValueError, match=r"zero=1 .*\['find_unused_parameters'\]"):
        DPMPStrategy(dp=2, mp=1, zero=1, find_unused_parameters=True)  # no DDP at zero>=1
    DPMPStrategy(dp=2, mp=1, zero=1, save_distributed_checkpoint=True)  # zero=1 shares zero=2's schedule and formats
    with pytest.raises(ValueError, match=r"zero=3 .*\['static_graph'\]"):
        DPMPStrategy(dp=2, mp=1, zero=3, static_graph=True)
    DPMPStrategy(dp=2, mp=2, zero=3, save_distributed_checkpoint=True)  # both formats at every level


def test_storage_bytes_counts_a_dtensors_local_shard(world1):
    """A parameter torch's FSDP2 sharded is a DTensor, whose own storage cannot be read: its local shard counts."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    dt = distribute_tensor(torch.zeros(6, 4), mesh, [Shard(0)])
    assert storage_bytes([dt]) == 6 * 4 * 4
    assert storage_bytes([dt, dt.to_local()]) == 6 * 4 * 4  # one storage, counted once


def test_a_block_without_a_forward_gives_its_called_members_as_units():
    """A ModuleDict block (``b["attn"](b["norm"](h))``) is never called itself: its members are the units, so each
    is gathered by its own forward at zero=3."""
    from torch import nn

    blocks = nn.ModuleList(nn.ModuleDict({"norm": nn.LayerNorm(4), "act": nn.GELU(), "mlp": nn.Linear(4, 4)})
                           for _ in range(2))
    model = nn.ModuleDict({"blocks": blocks, "head": nn.Linear(4, 2)})
    assert [n for n, _ in find_units(model)] == ["blocks.0.norm", "blocks.0.mlp", "blocks.1.norm", "blocks.1.mlp"]
