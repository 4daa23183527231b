"""Layer checks on 4 gloo processes: mp=4 (the whole world) and mp=2 (two subgroups), bias on and off.

Every rank compares its gathered outputs and gradients with a dense nn.Linear built from the same seed, and counts
the collectives of a column->row pair with torch's CommDebugMode and with lightning_dpmp's CommCounter.
Usage: python tests/distributed/layers_worker.py OUT_JSON
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning_dpmp.integration.accounting import CommCounter  # noqa: E402
from lightning_dpmp.parallel.comm import gather_from_group  # noqa: E402
from lightning_dpmp.parallel.embeddings import vocab_parallel  # noqa: E402
from lightning_dpmp.parallel.entry import SharedInputCopy  # noqa: E402
from lightning_dpmp.parallel.grid import build_grid  # noqa: E402
from lightning_dpmp.parallel.layers import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from lightning_dpmp.parallel.loss import vocab_parallel_cross_entropy  # noqa: E402
from lightning_dpmp.parallel.sharding import gather_tensor, shard_tensor  # noqa: E402
from lightning_dpmp.parallel.topology import Topology  # noqa: E402
from lightning_dpmp.planner.apply_plan import consolidated_state_dict  # noqa: E402
from tests.support.pool import run_world  # noqa: E402


class _Scaled(nn.Embedding):
    """A token table scaling its lookup, as Gemma's ``GemmaTextScaledWordEmbedding`` does."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scale = 2.5

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.scale


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def check(group, mp: int, bias: bool) -> dict:
    torch.manual_seed(0)
    d_in, hidden, d_out = 8, 16, 12
    fc1, fc2 = nn.Linear(d_in, hidden, bias=bias).double(), nn.Linear(hidden, d_out, bias=bias).double()
    x = torch.randn(5, 3, d_in, dtype=torch.float64, requires_grad=True)
    y_ref = fc2(F.gelu(fc1(x)))
    y_ref.square().sum().backward()
    out = {}

    # column (sharded) -> row: the Megatron MLP
    col = ColumnParallelLinear.from_dense(fc1, group)
    row = RowParallelLinear.from_dense(fc2, group)
    xp = x.detach().clone().requires_grad_(True)
    with CommDebugMode() as torch_count, CommCounter({"mp": group}) as ours:
        y = row(F.gelu(col(xp)))
        y.square().sum().backward()
    out["pair_forward_err"] = _err(y, y_ref)
    out["pair_input_grad_err"] = _err(xp.grad, x.grad)
    out["pair_weight_grad_err"] = max(
        _err(gather_from_group(col.weight.grad, group, 0), fc1.weight.grad),
        _err(gather_from_group(row.weight.grad, group, 1), fc2.weight.grad),
    )
    if bias:
        out["pair_bias_grad_err"] = max(
            _err(gather_from_group(col.bias.grad, group, 0), fc1.bias.grad), _err(row.bias.grad, fc2.bias.grad)
        )
    out["pair_counts_torch"] = {str(k): v for k, v in torch_count.get_comm_counts().items()}
    out["pair_counts_ours"] = {f"{g}/{op}": n for (g, op), n in ours.counts.items()}
    out["to_dense_equal"] = bool(
        torch.equal(col.to_dense().weight, fc1.weight) and torch.equal(row.to_dense().weight, fc2.weight)
    )

    # column with gathered output: a self-contained layer
    gcol = ColumnParallelLinear.from_dense(fc1, group, gather_output=True)
    xg = x.detach().clone().requires_grad_(True)
    with CommCounter({"mp": group}) as c:
        yg = gcol(xg)
        (yg * 3).sum().backward()
    xr = x.detach().clone().requires_grad_(True)
    fc1.zero_grad()
    (fc1(xr) * 3).sum().backward()
    out["gather_forward_err"] = _err(yg, fc1(x))
    out["gather_input_grad_err"] = _err(xg.grad, xr.grad)
    out["gather_weight_grad_err"] = _err(gather_from_group(gcol.weight.grad, group, 0), fc1.weight.grad)
    out["gather_counts"] = {f"{g}/{op}": n for (g, op), n in c.counts.items()}

    # row with a replicated input, split locally
    srow = RowParallelLinear.from_dense(fc2, group, input_is_parallel=False)
    h = torch.randn(5, 3, hidden, dtype=torch.float64, requires_grad=True)
    with CommCounter({"mp": group}) as c:
        ys = srow(h)
        ys.sum().backward()
    hr = h.detach().clone().requires_grad_(True)
    fc2.zero_grad()
    fc2(hr).sum().backward()
    out["scatter_row_forward_err"] = _err(ys, fc2(h))
    out["scatter_row_input_grad_err"] = _err(h.grad, hr.grad)
    out["scatter_row_counts"] = {f"{g}/{op}": n for (g, op), n in c.counts.items()}

    # fan-out: two column layers reading one input share one backward all-reduce
    entry = SharedInputCopy(group)
    a = ColumnParallelLinear.from_dense(fc1, group, shared_input=entry)
    b = ColumnParallelLinear.from_dense(fc1, group, shared_input=entry)
    r = RowParallelLinear.from_dense(fc2, group)
    xf = x.detach().clone().requires_grad_(True)
    with CommCounter({"mp": group}) as c:
        r(a(xf) * b(xf)).sum().backward()
    xr = x.detach().clone().requires_grad_(True)
    fc2(fc1(xr) * fc1(xr)).sum().backward()
    out["fanout_input_grad_err"] = _err(xf.grad, xr.grad)
    out["fanout_counts"] = {f"{g}/{op}": n for (g, op), n in c.counts.items()}

    # a fused projection (q|k|v) is split block by block; its consolidated state is the dense one, bias included
    fused = nn.Linear(d_in, 3 * hidden, bias=bias).double()
    holder = nn.Sequential(ColumnParallelLinear.from_dense(fused, group, blocks=3))
    dense_state = consolidated_state_dict(holder, group)
    out["fused_state_equal"] = all(torch.equal(dense_state[f"0.{k}"], v) for k, v in fused.state_dict().items())

    # an nn.Embedding subclass whose forward scales the lookup (Gemma's, BART's): split by rows, it keeps its class
    # and code; the padding row (on rank 1 at mp=2, in the middle of the table) gets no gradient
    emb = _Scaled(4 * mp, 6, padding_idx=2 * mp + 1).double()
    ids = torch.tensor([[0, 2 * mp + 1, 4 * mp - 1], [3, 2 * mp + 1, mp]])
    (emb(ids) * torch.arange(6.0, dtype=torch.float64)).sum().backward()
    split = vocab_parallel(emb, group)
    with CommCounter({"mp": group}) as c:
        ye = split(ids)
        (ye * torch.arange(6.0, dtype=torch.float64)).sum().backward()
    out["scaled_emb_forward_err"] = _err(ye, emb(ids))
    out["scaled_emb_weight_grad_err"] = _err(gather_from_group(split.weight.grad, group, 0), emb.weight.grad)
    out["scaled_emb_counts"] = {f"{g}/{op}": n for (g, op), n in c.counts.items()}
    back = split.to_dense()
    out["scaled_emb_class"] = [type(split).__name__, type(back).__name__, isinstance(split, _Scaled)]
    out["scaled_emb_to_dense_equal"] = bool(torch.equal(back.weight, emb.weight) and back.scale == emb.scale)

    # vocab-parallel cross-entropy against F.cross_entropy: values and gradients, ignore_index, smoothing
    logits = torch.randn(6, 5, 8 * mp, dtype=torch.float64)
    target = torch.randint(0, 8 * mp, (6, 5))
    target[0, :2] = -100
    rank, errs, counts = dist.get_rank(group), [], set()
    for reduction in ("mean", "sum", "none"):
        for smoothing in (0.0, 0.1):
            full = logits.clone().requires_grad_(True)
            ref = F.cross_entropy(
                full.view(-1, 8 * mp), target.view(-1), reduction=reduction, label_smoothing=smoothing
            )
            (ref.sum() * 1.7).backward()
            local = logits.chunk(mp, dim=-1)[rank].clone().requires_grad_(True)
            with CommCounter({"mp": group}) as cc:
                ours = vocab_parallel_cross_entropy(
                    local, target, group, reduction=reduction, label_smoothing=smoothing
                )
                (ours.sum() * 1.7).backward()
            counts.add(tuple(sorted((f"{g}/{op}", n) for (g, op), n in cc.counts.items())))
            errs.append(_err(ours.reshape(-1), ref.reshape(-1)))
            errs.append(_err(local.grad, full.grad.chunk(mp, dim=-1)[rank]))
    out["vocab_ce_err"] = max(errs)
    out["vocab_ce_counts"] = [dict(c) for c in counts]
    out.update(_padded_vocabulary(group, mp, bias))
    return out


def _padded_vocabulary(group, mp: int, bias: bool) -> dict:
    """A vocabulary of 5 (no mp > 1 divides it; at mp=4 rank 3 holds only padding): the loss, the gathered head,
    the table and the consolidated state against dense layers, and the padding rows at zero."""
    torch.manual_seed(1)
    vocab, rank, out, errs = 5, dist.get_rank(group), {}, []
    logits = torch.randn(6, 4, vocab, dtype=torch.float64)
    target = torch.randint(0, vocab, (6, 4))
    target[1, 0] = -100
    for smoothing in (0.0, 0.1):
        full = logits.clone().requires_grad_(True)
        ref = F.cross_entropy(full.view(-1, vocab), target.view(-1), label_smoothing=smoothing)
        ref.backward()
        local = shard_tensor(logits, -1, mp, rank, (vocab,)).clone().requires_grad_(True)
        with CommCounter({"mp": group}) as cc:
            ours = vocab_parallel_cross_entropy(local, target, group, label_smoothing=smoothing, vocab=vocab)
            ours.backward()
        errs += [_err(ours, ref), _err(local.grad, shard_tensor(full.grad, -1, mp, rank, (vocab,)))]
        out["padded_ce_counts"] = {f"{g}/{op}": n for (g, op), n in cc.counts.items()}
    head = nn.Linear(8, vocab, bias=bias).double()
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    (head(x) * torch.arange(vocab)).sum().backward()
    split = ColumnParallelLinear.from_dense(head, group, gather_output=True)
    xs = x.detach().clone().requires_grad_(True)
    y = split(xs)
    (y * torch.arange(vocab)).sum().backward()
    each = -(-vocab // mp)
    errs += [_err(y, head(x)), _err(xs.grad, x.grad),
             _err(gather_tensor(split.weight.grad, 0, group, (vocab,)), head.weight.grad)]
    emb = nn.Embedding(vocab, 6).double()
    ids = torch.tensor([[0, 4, 2], [3, 1, 4]])
    (emb(ids) * torch.arange(6.0, dtype=torch.float64)).sum().backward()
    table = vocab_parallel(emb, group)
    ye = table(ids)
    (ye * torch.arange(6.0, dtype=torch.float64)).sum().backward()
    errs += [_err(ye, emb(ids)), _err(gather_tensor(table.weight.grad, 0, group, (vocab,)), emb.weight.grad)]
    real = min(max(vocab - rank * each, 0), each)
    out["padded_shapes"] = [list(split.weight.shape), list(table.weight.shape)]
    out["padded_rows_zero"] = bool(split.weight[real:].eq(0).all() and table.weight[real:].eq(0).all()
                                   and table.weight.grad[real:].eq(0).all())
    state = consolidated_state_dict(nn.ModuleDict({"head": split, "emb": table}), group)
    out["padded_state_equal"] = bool(torch.equal(state["head.weight"], head.weight)
                                     and torch.equal(state["emb.weight"], emb.weight))
    out["padded_err"] = max(errs)
    return out


def count_every_call(group: dist.ProcessGroup, rank: int) -> dict:
    """Each ``torch.distributed`` call (and three functional collectives) once on ``group`` (the whole world), then
    one all-reduce on the default group, counted by :class:`CommCounter`: what every call is labelled, so that
    exact counts can name any collective."""
    import torch.distributed._functional_collectives as funcol

    world = dist.get_world_size(group)
    t = torch.ones(4)
    counter = CommCounter({"g": group})
    with counter:
        dist.all_reduce(t, group=group)
        dist.all_gather([torch.empty(4) for _ in range(world)], t, group=group)
        dist.all_gather_into_tensor(torch.empty(4 * world), t, group=group)
        dist.reduce_scatter_tensor(torch.empty(1), torch.ones(world), group=group)
        dist.broadcast(t, src=0, group=group)
        dist.reduce(t, dst=0, group=group)
        dist.gather(t, [torch.empty(4) for _ in range(world)] if rank == 0 else None, dst=0, group=group)
        dist.scatter(t, [torch.ones(4) for _ in range(world)] if rank == 0 else None, src=0, group=group)
        dist.all_to_all_single(torch.empty(world), torch.ones(world), group=group)
        dist.barrier(group=group)
        peer = rank ^ 1  # 0<->1, 2<->3: one send and one receive per rank
        if rank % 2 == 0:
            dist.send(t, peer, group=group)
            dist.irecv(t, peer, group=group).wait()
        else:
            dist.recv(t, peer, group=group)
            dist.isend(t, peer, group=group).wait()
        funcol.all_reduce(t, "sum", group).wait()  # the traceable collectives (DTensor, compiled graphs)
        funcol.all_gather_tensor(t, 0, group).wait()
        with warnings.catch_warnings():  # renamed reduce_scatter_single in newer torch; the op is the same
            warnings.simplefilter("ignore", FutureWarning)
            funcol.reduce_scatter_tensor(torch.ones(world), "sum", 0, group).wait()
        dist.all_reduce(t)  # the default group, unlabelled
    return {f"{g}/{op}": n for (g, op), n in sorted(counter.counts.items())}


def worker(rank: int, world: int, port: int, path: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    for mp_size in (2, 4):
        grid = build_grid(Topology(dp=world // mp_size, mp=mp_size))
        for bias in (True, False):
            results[f"mp{mp_size}_bias{int(bias)}"] = check(grid.mp_group, mp_size, bias)
    results["counted_calls"] = count_every_call(dist.new_group(list(range(world))), rank)
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(path, "w") as f:
            json.dump(gathered, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    run_world(worker, sys.argv[1])
