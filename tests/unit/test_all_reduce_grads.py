"""comm.all_reduce_grads in one process: ``in_place`` keeps each gradient tensor (a DTensor gradient wrapping it
stays valid, no re-wrapping per step), a parameter without a gradient on any rank keeps ``None``, and buckets do
not change the values."""

from __future__ import annotations

import torch
from torch import nn

from lightning_dpmp.parallel.comm import all_reduce_grads


def _params() -> list[nn.Parameter]:
    ps = [nn.Parameter(torch.zeros(3, dtype=torch.float64)) for _ in range(3)]
    ps[0].grad = torch.arange(3.0, dtype=torch.float64)
    ps[1].grad = torch.full((3,), 2.0, dtype=torch.float64)
    return ps  # ps[2]: no gradient here (nor, with one process, anywhere)


def test_in_place_keeps_each_gradient_tensor() -> None:
    ps = _params()
    before = [p.grad for p in ps]
    all_reduce_grads(ps, None, average=True, keep_unused=True, bucket_bytes=16, in_place=True)
    assert ps[0].grad is before[0] and ps[1].grad is before[1] and ps[2].grad is None
    assert ps[0].grad.tolist() == [0.0, 1.0, 2.0] and ps[1].grad.tolist() == [2.0, 2.0, 2.0]


def test_out_of_place_gives_new_tensors_of_the_same_values() -> None:
    ps, ref = _params(), _params()
    before = [p.grad for p in ps]
    all_reduce_grads(ps, None, average=True, keep_unused=True)
    all_reduce_grads(ref, None, average=True, keep_unused=True, in_place=True)
    assert ps[0].grad is not before[0] and ps[2].grad is None
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ps[:2], ref[:2]))
