"""Case runner for the property tests: a pool of gloo ranks that receive cases from the test process.

Hypothesis draws (and shrinks) the examples in the test process; every example is sent to all ranks, which run it
against their MP group and answer with the largest differences from a dense float64 reference, or with the
``ValueError`` the layers documented. ``run_case`` also runs in the test process itself (no process group: mp=1).

Example:
    >>> run_case({"kind": "layer", "style": "column", "d_in": 3, "d_out": 4, "lead": [2], "bias": True,
    ...           "gather": True, "seed": 0}, group=None)["max_err"] < 1e-12
    True
"""

from __future__ import annotations

import traceback
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_dpmp.parallel.comm import group_rank, group_size
from lightning_dpmp.parallel.layers import ColumnParallelLinear, RowParallelLinear
from lightning_dpmp.parallel.sharding import Blocks, shard_dims, shard_tensor

ACTS = {"relu": F.relu, "gelu": F.gelu, "tanh": torch.tanh}


def _shard(t: Tensor, dim: int, group: Any, blocks: Blocks = 1) -> Tensor:
    return shard_tensor(t, dim, group_size(group), group_rank(group), blocks)


def _err(a: Tensor, b: Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item() if a.numel() else 0.0


def _layer_case(c: dict, group: Any) -> dict:
    """One Column/Row layer against ``nn.Linear``: output, input gradient, weight and bias gradients."""
    torch.manual_seed(c["seed"])
    dense = nn.Linear(c["d_in"], c["d_out"], bias=c["bias"]).double()
    x = torch.randn(*c["lead"], c["d_in"], dtype=torch.float64)
    upstream = torch.randn(*c["lead"], c["d_out"], dtype=torch.float64)
    xr = x.clone().requires_grad_(True)
    (dense(xr) * upstream).sum().backward()
    y_ref = dense(x).detach()
    column = c["style"] == "column"
    if column:
        layer: nn.Module = ColumnParallelLinear.from_dense(dense, group, gather_output=c["gather"])
        xin, out_sharded, in_sharded = x, not c["gather"], False
    else:  # "gather" means here: the input arrives already sharded (input_is_parallel)
        layer = RowParallelLinear.from_dense(dense, group, input_is_parallel=c["gather"])
        xin, out_sharded, in_sharded = (_shard(x, -1, group) if c["gather"] else x), False, c["gather"]
    xp = xin.clone().requires_grad_(True)
    y = layer(xp)
    (y * (_shard(upstream, -1, group) if out_sharded else upstream)).sum().backward()
    blocks = layer.blocks  # a gathered column layer pads a width mp does not divide (zero rows, stripped on gather)
    errs = {
        "out": _err(y, _shard(y_ref, -1, group) if out_sharded else y_ref),
        "input_grad": _err(xp.grad, _shard(xr.grad, -1, group) if in_sharded else xr.grad),
        "weight_grad": _err(layer.weight.grad, _shard(dense.weight.grad, 0 if column else 1, group, blocks)),
    }
    if c["bias"]:
        errs["bias_grad"] = _err(layer.bias.grad,
                                 _shard(dense.bias.grad, 0, group, blocks) if column else dense.bias.grad)
    return {"max_err": max(errs.values()), "errs": errs}


class RandomMLP(nn.Module):
    """A small MLP graph from a spec: blocks of ``linear`` (Linear + activation), ``residual`` (pre-LN MLP with a
    skip connection) or ``gated`` (down(silu(gate(x)) * up(x))), then a head."""

    def __init__(self, spec: dict) -> None:
        super().__init__()
        width = spec["d_in"]
        self.blocks = nn.ModuleList()
        self.kinds: list[str] = []
        for kind, hidden, act in spec["blocks"]:
            block = nn.Module()
            if kind == "linear":
                block.fc = nn.Linear(width, hidden)
                width = hidden
            elif kind == "residual":
                block.ln, block.fc1, block.fc2 = nn.LayerNorm(width), nn.Linear(width, hidden), nn.Linear(hidden, width)
            else:
                block.gate, block.up = nn.Linear(width, hidden), nn.Linear(width, hidden)
                block.down = nn.Linear(hidden, width)
            block.act = act
            self.blocks.append(block)
            self.kinds.append(kind)
        self.head = nn.Linear(width, spec["d_out"])

    def forward(self, x: Tensor) -> Tensor:
        for kind, b in zip(self.kinds, self.blocks):
            if kind == "linear":
                x = ACTS[b.act](b.fc(x))
            elif kind == "residual":
                x = x + b.fc2(ACTS[b.act](b.fc1(b.ln(x))))
            else:
                x = x + b.down(F.silu(b.gate(x)) * b.up(x))
        return self.head(x)


def _mlp_case(c: dict, grid: Any) -> dict:
    """Plan and parallelise a random MLP with the automatic planner (no verification, so no fallback can hide a
    wrong plan), then compare output and every gradient with the dense model."""
    from lightning_dpmp.integration.autoplan import plan_module  # late: only the pool needs the planner's collectives

    torch.manual_seed(c["seed"])
    model = RandomMLP(c).double()
    x = torch.randn(c["batch"], c["d_in"], dtype=torch.float64)
    upstream = torch.randn(c["batch"], c["d_out"], dtype=torch.float64)
    ref = RandomMLP(c).double()
    ref.load_state_dict(model.state_dict())
    y_ref = ref(x)
    (y_ref * upstream).sum().backward()
    dense_grads = {n: p.grad for n, p in ref.named_parameters()}

    result = plan_module(model, grid, lambda: (model(x) * upstream).sum(), None, False, torch.device("cpu"))
    y = model(x)
    (y * upstream).sum().backward()
    split = shard_dims(model)
    errs = {"out": _err(y, y_ref.detach())}
    for n, p in model.named_parameters():
        expect = _shard(dense_grads[n], split[n], grid.mp_group) if n in split else dense_grads[n]
        errs[n] = _err(p.grad, expect)
    styles = sorted({lp.style for lp in result.plan.layers.values()})
    return {"max_err": max(errs.values()), "errs": errs, "styles": styles}


def run_case(case: dict, group: Any = None, grid: Any = None) -> dict:
    """Run one case; a documented ``ValueError`` is returned as ``{"error": message}``."""
    try:
        return _layer_case(case, group) if case["kind"] == "layer" else _mlp_case(case, grid)
    except ValueError as exc:
        return {"error": str(exc)}


def serve(rank: int, world: int, init_file: str, inbox: Any, outbox: Any) -> None:
    """Pool rank: join the gloo group, build the mp=1, 2 and 4 grids once, answer cases until ``None`` arrives."""
    from lightning_dpmp.parallel.grid import build_grid
    from lightning_dpmp.parallel.topology import Topology

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    grids = {mp: build_grid(Topology(dp=world // mp, mp=mp)) for mp in (1, 2, 4)}  # same order on every rank
    outbox.put((rank, "ready"))
    while True:
        case: Optional[dict] = inbox.get()
        if case is None:
            break
        grid = grids[case["mp"]]
        try:
            outbox.put((rank, run_case(case, grid.mp_group, grid)))
        except Exception:  # anything else is a bug: report it rather than hang the test
            outbox.put((rank, {"crash": traceback.format_exc()}))
    dist.destroy_process_group()
