"""A finished job's DTensor parameters are freed with everything they reach (the mesh and its process groups), in
one process (a world-size-1 gloo group): a process that runs jobs one after another (a Hydra multirun, a test
pool) must not keep each job's gloo threads alive."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from lightning_dpmp import compat
from lightning_dpmp.parallel.dtensor_params import DTensorParams


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def _job(release: bool) -> tuple[weakref.ref, weakref.ref, list[float]]:
    """Parameters read outside the layers (an L2 term) while the forwards compute on the local parameters, as under
    the ZeRO engine: the gradient of each DTensor parameter is handed over to its local one."""
    net = _net()
    mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("dp", "pp", "mp"))
    params = DTensorParams(net, mesh, 1)
    handed: list[float] = []

    def accumulate(local: nn.Parameter, grad: torch.Tensor) -> None:
        handed.append(float(grad.double().pow(2).sum()))
        local.grad = grad if local.grad is None else local.grad + grad

    params.compute_on_locals(accumulate)
    assert all(isinstance(p, DTensor) for p in net.parameters())
    loss = 1e-3 * sum(p.pow(2).sum() for p in net.parameters())  # user code's L2 term: the DTensor parameters
    loss.backward()
    if release:
        params.release()
    return weakref.ref(params), weakref.ref(mesh), handed


@pytest.mark.parametrize("release", [True, False], ids=["released", "not_released"])
def test_parameters_hand_over_their_gradients_and_are_freed_after_the_job(world1, release):
    params, mesh, handed = _job(release)
    dense = _net()
    # each DTensor parameter's gradient reached its local parameter once (backward order): 2e-3 p, squared and summed
    assert sorted(handed) == sorted(float((2e-3 * p.detach()).pow(2).sum()) for p in dense.parameters())
    compat.clear_dtensor_sharding_cache()  # as the next job does: DTensor's caches hold the meshes they saw
    gc.collect()
    # the hand-over hook lives in the parameter's C++ autograd metadata, out of the collector's sight: a strong
    # reference from it to DTensorParams kept the whole job (mesh and process groups included) alive for good
    assert params() is None and mesh() is None
