"""The first step recorded once per setup (issue 43 item 4): one run of ``training_step`` gives the trace, the dense
loss and gradients and the pipeline probe, each equal to what its own run gives; the batch is read once; what the
dense run did not watch runs alone, once.

The setup-level counts (``training_step`` runs per rank before training starts: pp=2, 1; pp/zero "auto", 2; before
this record 2 and 3 to 4) are asserted in the pooled launches of ``tests/distributed/test_pipeline.py`` and
``tests/distributed/test_layout_search.py``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch.trainer.states import TrainerFn

import lightning_dpmp.integration.firststep as firststep
from lightning_dpmp.integration.firststep import FirstStep
from lightning_dpmp.integration.stepdata import isolated
from lightning_dpmp.integration.verify import record_dense
from lightning_dpmp.planner.stages import StageCutError, probe_stack
from tests.support.models import build


def _record(monkeypatch: pytest.MonkeyPatch, name: str, fn: TrainerFn = TrainerFn.FITTING, stack: bool = True
            ) -> tuple[FirstStep, Any, dict[str, int]]:
    torch.manual_seed(0)
    model, data = build(name)
    batch = data[0:4]
    counts = {"batch": 0, "step": 0}

    def fetch(trainer: Any, module: Any, global_rank: int) -> tuple[Any, list[str]]:
        counts["batch"] += 1
        return batch, []

    def runner(trainer: Any, module: Any, plugin: Any, device: torch.device, b: Any, meta: bool = False) -> Any:
        def run() -> Any:
            counts["step"] += 1
            return model.training_step(b, 0)

        return run

    monkeypatch.setattr(firststep, "first_batch", fetch)
    monkeypatch.setattr(firststep, "step_runner", runner)
    trainer = SimpleNamespace(state=SimpleNamespace(fn=fn))
    first = FirstStep(trainer, model, None, torch.device("cpu"), 0, meta=False, stack_wanted=stack)
    return first, model, counts


@pytest.mark.parametrize("name", ["gpt4", "llama", "moe_list"])
def test_one_training_step_gives_the_trace_the_dense_gradients_and_the_stage_probe(monkeypatch, name) -> None:
    first, model, counts = _record(monkeypatch, name)
    profile, dense, run = first.stack(), first.dense(), first.runner()
    assert first.dense() is dense and first.stack() is profile  # kept, not run again
    assert counts == {"batch": 1, "step": 1}
    assert run is not None and dense.trace is not None and dense.note == ""
    # each equals its own run: the probe only watches (its bookkeeping is no op of the traced step)
    alone = record_dense(model, run, True)
    assert alone.trace is not None and dense.trace.events == alone.trace.events
    assert dense.trace.data_dependent == alone.trace.data_dependent
    assert torch.equal(dense.loss, alone.loss) and dense.grads.keys() == alone.grads.keys()
    assert all(torch.equal(dense.grads[k], alone.grads[k]) for k in alone.grads)
    with isolated(model):  # (silences self.log, as the record's runs are)
        assert profile == probe_stack(model, run, 4)


def test_what_the_dense_run_did_not_watch_runs_alone_once(monkeypatch) -> None:
    first, _, counts = _record(monkeypatch, "gpt4", stack=False)
    first.dense()
    first.stack()
    first.stack()
    assert counts == {"batch": 1, "step": 2}
    # outside fitting the probe is never carried by the trace (an evaluation step is traced in eval mode)
    first, _, counts = _record(monkeypatch, "gpt4", fn=TrainerFn.VALIDATING)
    first.stack()
    first.dense()
    assert counts == {"batch": 1, "step": 2}


def test_a_step_that_cannot_be_cut_keeps_its_trace_and_raises_when_asked(monkeypatch) -> None:
    first, model, counts = _record(monkeypatch, "resmlp")
    model.blocks = torch.nn.ModuleList([model.blocks[0]])  # one block: no cut, and nothing runs for the probe
    with pytest.raises(StageCutError, match="1"):
        first.stack()
    assert first.dense().trace is not None and counts["step"] == 1
