"""Linear-like and attention layers on 4 gloo processes (mp = 2 and 4) against their dense modules, float64.

- GPT-2 ``Conv1D`` (weight stored (in, out)): column (plain and fused q|k|v in 3 blocks) -> row pair, outputs and
  gradients, collectives, ``to_dense`` giving back a ``Conv1D``, consolidated state loading into the dense module;
- ``HeadParallelMultiheadAttention`` vs ``nn.MultiheadAttention``: batch_first both ways, no mask / causal /
  key padding / per-head 3-D mask, need_weights False and True, collectives, ``to_dense`` and consolidated state.

Usage: python tests/distributed/linear_like_worker.py OUT_JSON
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from transformers.pytorch_utils import Conv1D  # noqa: E402

from lightning_dpmp.integration.accounting import CommCounter  # noqa: E402
from lightning_dpmp.parallel.attention_layer import HeadParallelMultiheadAttention  # noqa: E402
from lightning_dpmp.parallel.grid import build_grid  # noqa: E402
from lightning_dpmp.parallel.layers import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from lightning_dpmp.parallel.sharding import gather_tensor  # noqa: E402
from lightning_dpmp.parallel.topology import Topology  # noqa: E402
from lightning_dpmp.planner.apply_plan import consolidate, consolidated_state_dict  # noqa: E402
from tests.support.pool import run_world  # noqa: E402


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _counts(c: CommCounter) -> dict:
    return {f"{g}/{op}": n for (g, op), n in c.counts.items()}


def check_conv1d(group, blocks: int) -> dict:
    torch.manual_seed(0)
    d, hidden = 8, 16
    fc1, fc2 = Conv1D(blocks * hidden, d).double(), Conv1D(d, hidden).double()
    with torch.no_grad():
        fc1.bias.normal_(), fc2.bias.normal_()  # Conv1D starts with zero bias: make the bias paths visible
    x = torch.randn(5, 3, d, dtype=torch.float64, requires_grad=True)

    def mix(h: torch.Tensor) -> torch.Tensor:  # blocks=3: q, k, v pieces combined element-wise, like attention
        parts = h.split(h.shape[-1] // blocks, dim=-1)
        return F.gelu(parts[0]) * (parts[1] if blocks > 1 else 1) + (parts[2] if blocks > 1 else 0)

    y_ref = fc2(mix(fc1(x)))
    y_ref.square().sum().backward()
    col = ColumnParallelLinear.from_dense(fc1, group, out_dim=1, blocks=blocks)
    row = RowParallelLinear.from_dense(fc2, group, out_dim=1)
    xp = x.detach().clone().requires_grad_(True)
    with CommCounter({"mp": group}) as c:
        y = row(mix(col(xp)))
        y.square().sum().backward()
    out = {
        "forward_err": _err(y, y_ref),
        "input_grad_err": _err(xp.grad, x.grad),
        "weight_grad_err": max(_err(gather_tensor(col.weight.grad, 1, group, blocks), fc1.weight.grad),
                               _err(gather_tensor(row.weight.grad, 0, group), fc2.weight.grad)),
        "bias_grad_err": max(_err(gather_tensor(col.bias.grad, 0, group, blocks), fc1.bias.grad),
                             _err(row.bias.grad, fc2.bias.grad)),
        "counts": _counts(c),
        "local_shapes": [list(col.weight.shape), list(row.weight.shape)],
    }
    holder = nn.Sequential(col, row)
    state = consolidated_state_dict(holder, group)
    out["state_equal"] = all(
        torch.equal(state[f"{i}.{k}"], v) for i, m in enumerate((fc1, fc2)) for k, v in m.state_dict().items()
    )
    consolidate(holder)
    out["to_dense_class"] = [type(m).__name__ for m in holder]
    out["to_dense_equal"] = all(torch.equal(holder[i].state_dict()[k], v)
                                for i, m in enumerate((fc1, fc2)) for k, v in m.state_dict().items())
    return out


def check_attention(group, mp_size: int, batch_first: bool) -> dict:
    torch.manual_seed(1)
    e, heads, n, t = 16, 4, 3, 5
    mha = nn.MultiheadAttention(e, heads, batch_first=batch_first).double()
    with torch.no_grad():
        mha.in_proj_bias.normal_(), mha.out_proj.bias.normal_()
    layer = HeadParallelMultiheadAttention.from_dense(mha, group)
    shape = (n, t, e) if batch_first else (t, n, e)
    causal = nn.Transformer.generate_square_subsequent_mask(t, dtype=torch.float64)
    padding = torch.zeros(n, t, dtype=torch.bool)
    padding[0, -2:] = True
    cases = {
        "plain": {},
        "causal": {"attn_mask": causal, "is_causal": True},
        "padding": {"key_padding_mask": padding},
        "per_head_mask": {"attn_mask": torch.randn(n * heads, t, t, dtype=torch.float64)},
    }
    errs, counts = {}, {}
    for name, kwargs in cases.items():
        for need_weights in (False, True):
            x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
            mha.zero_grad()
            a, wa = mha(x, x, x, need_weights=need_weights, **kwargs)
            (a.square().sum() + (wa.square().sum() if wa is not None else 0)).backward()
            xp = x.detach().clone().requires_grad_(True)
            layer.zero_grad()
            with CommCounter({"mp": group}) as c:
                b, wb = layer(xp, xp, xp, need_weights=need_weights, **kwargs)
                (b.square().sum() + (wb.square().sum() if wb is not None else 0)).backward()
            err = max(_err(b, a), _err(xp.grad, x.grad),
                      _err(gather_tensor(layer.in_proj_weight.grad, 0, group, 3), mha.in_proj_weight.grad),
                      _err(gather_tensor(layer.in_proj_bias.grad, 0, group, 3), mha.in_proj_bias.grad),
                      _err(gather_tensor(layer.out_proj.weight.grad, 1, group), mha.out_proj.weight.grad),
                      _err(layer.out_proj.bias.grad, mha.out_proj.bias.grad))
            if need_weights:
                err = max(err, _err(wb, wa))
            errs[f"{name}_w{int(need_weights)}"] = err
            counts[f"{name}_w{int(need_weights)}"] = _counts(c)
    holder = nn.ModuleDict({"attn": layer})
    state = consolidated_state_dict(holder, group)
    out = {"errs": errs, "counts": counts, "local_heads": layer.local_heads,
           "state_equal": all(torch.equal(state[f"attn.{k}"], v) for k, v in mha.state_dict().items())}
    consolidate(holder)
    dense = holder["attn"]
    out["to_dense_class"] = [type(dense).__name__, type(dense.out_proj).__name__]
    out["to_dense_equal"] = all(torch.equal(dense.state_dict()[k], v) for k, v in mha.state_dict().items())
    fresh = nn.MultiheadAttention(e, heads, batch_first=batch_first).double()
    fresh.load_state_dict(dense.state_dict(), strict=True)
    out["mp"] = mp_size
    return out


def worker(rank: int, world: int, port: int, path: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    for mp_size in (2, 4):
        grid = build_grid(Topology(dp=world // mp_size, mp=mp_size))
        for blocks in (1, 3):
            results[f"mp{mp_size}_conv1d_blocks{blocks}"] = check_conv1d(grid.mp_group, blocks)
        for batch_first in (True, False):
            results[f"mp{mp_size}_mha_bf{int(batch_first)}"] = check_attention(grid.mp_group, mp_size, batch_first)
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(path, "w") as f:
            json.dump(gathered, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    run_world(worker, sys.argv[1])
