"""Stage-by-stage evaluation's pieces in one process: micro-batches of a short batch,
metric updates taken on one copy of a module and given to another, and metrics silenced for a meta-tensor probe."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torchmetrics.aggregation import CatMetric, MeanMetric, SumMetric

from lightning_dpmp.integration.metrics import MetricUpdates, shapes_only
from lightning_dpmp.integration.pipeline import evaluation_microbatches
from lightning_dpmp.parallel.stage_runner import PipelineRunner


def test_a_short_batch_is_cut_into_the_most_equal_micro_batches():
    assert evaluation_microbatches(8, 4) == 4
    assert evaluation_microbatches(6, 4) == 3
    assert evaluation_microbatches(5, 4) == 1
    assert evaluation_microbatches(2, 4) == 2


class _Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mean, self.cat, self.total = MeanMetric(), CatMetric(), SumMetric()


def test_metric_updates_taken_on_one_copy_give_the_other_the_same_state():
    here, there = _Holder(), _Holder()
    for step in range(3):
        watch, other = MetricUpdates(here), MetricUpdates(there)
        values = torch.arange(4.0) + step
        here.mean.update(values)
        here.cat.update(values)
        if step != 1:  # a metric the step did not update travels not at all
            here.total.update(values)
        taken = watch.taken()
        assert ("total" in taken) == (step != 1)
        assert len(taken["cat"]["value"][1]) == 1  # only the new element of the list state
        other.give(copy.deepcopy(taken))
    for name in ("mean", "cat", "total"):
        ours, theirs = getattr(here, name), getattr(there, name)
        assert torch.equal(ours.compute(), theirs.compute()), name
        assert ours._update_count == theirs._update_count


def test_metrics_update_nothing_during_a_meta_probe_and_work_after():
    holder = _Holder()
    wrapped = holder.mean.update
    with shapes_only(holder):
        holder.mean.update(torch.ones(3, device="meta"))
        assert holder.cat(torch.ones(2, device="meta")).is_meta
    assert holder.mean.update is wrapped
    holder.mean.update(torch.tensor([2.0, 4.0]))
    assert holder.mean.compute().item() == 3.0 and holder.mean._update_count == 1


def test_a_step_that_runs_the_stack_twice_is_refused_on_the_later_stage():
    """Generation in a validation step loops over the blocks: the stage receiving the activation refuses the second
    pass with the reason (the received activation belongs to one pass)."""
    blocks = [nn.Linear(2, 2) for _ in range(2)]
    runner = PipelineRunner(blocks, [(0, 1), (1, 2)], 0, 0, (4, 2), torch.float32, None, 1, 2, 1, "gpipe",
                            torch.device("cpu"))
    with runner._stand_ins(1, torch.ones(4, 2)):
        assert torch.equal(blocks[0](torch.zeros(4, 2)), torch.ones(4, 2))
        with pytest.raises(RuntimeError, match="more than once"):
            blocks[0](torch.zeros(4, 2))
