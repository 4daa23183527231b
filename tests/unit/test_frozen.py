"""requires_grad survives every conversion of a layer: split, meta materialisation and consolidation back."""

from __future__ import annotations

import torch
from torch import nn

from lightning_dpmp.parallel.embeddings import VocabParallelEmbedding
from lightning_dpmp.parallel.layers import ColumnParallelLinear, RowParallelLinear
from lightning_dpmp.planner.materialize import materialize


def _frozen_linear(bias_trainable: bool) -> nn.Linear:
    lin = nn.Linear(8, 4)
    lin.weight.requires_grad_(False)
    lin.bias.requires_grad_(bias_trainable)
    return lin


def test_split_and_dense_layers_keep_each_parameters_flag():
    for cls in (ColumnParallelLinear, RowParallelLinear):
        for bias_trainable in (True, False):
            layer = cls.from_dense(_frozen_linear(bias_trainable), None)
            assert (layer.weight.requires_grad, layer.bias.requires_grad) == (False, bias_trainable), cls
            dense = layer.to_dense()
            assert (dense.weight.requires_grad, dense.bias.requires_grad) == (False, bias_trainable), cls
    emb = nn.Embedding(8, 4).requires_grad_(False)
    layer = VocabParallelEmbedding.from_dense(emb, None)
    assert not layer.weight.requires_grad and not layer.to_dense().weight.requires_grad


def test_a_frozen_layer_gets_no_gradient_and_a_trainable_one_does():
    layer = ColumnParallelLinear.from_dense(_frozen_linear(True), None)
    layer(torch.randn(3, 8, requires_grad=True)).sum().backward()
    assert layer.weight.grad is None and layer.bias.grad is not None


def test_meta_materialisation_keeps_the_flag():
    with torch.device("meta"):
        dense = _frozen_linear(True)
    holder = nn.Module()
    holder.layer = ColumnParallelLinear.from_dense(dense, None)
    assert holder.layer.weight.is_meta and not holder.layer.weight.requires_grad
    materialize(holder, torch.device("cpu"), seed=0, mp_rank=0)
    assert not holder.layer.weight.is_meta
    assert (holder.layer.weight.requires_grad, holder.layer.bias.requires_grad) == (False, True)
