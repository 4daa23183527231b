"""Issue 27 items 4, 5 and 8 without processes: the tolerance follows the dtype the step computes in, the trainer's
optimizers and schedulers exist while a step is traced at setup, and a module compiled by the user is refused
(before launch, and at setup on every rank) with its name."""

from __future__ import annotations

import time

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities.compile import from_compiled
from torch import nn
from torch.utils.data import DataLoader

from lightning_dpmp import DPMPStrategy
from lightning_dpmp.integration.launcher import DPMPScriptLauncher
from lightning_dpmp.integration.stepdata import trainer_state
from lightning_dpmp.integration.validate import check_not_compiled, check_plan_at_setup
from lightning_dpmp.integration.verify import LowestFloat, tolerance
from lightning_dpmp.parallel.compiled import compile_blocks, uncompile_blocks
from tests.support.models import ResMLP, make_dataset


# ---------------------------------------------------------------------------------------------- tolerance
@pytest.mark.parametrize(
    "precision, dtype, expected",
    [
        ("64-true", None, 1e-7),
        ("64-true", torch.float64, 1e-7),
        ("64-true", torch.float32, 1e-3),  # transformers' labels= loss inside a float64 model
        ("32-true", torch.float16, 5e-2),  # a .half() model at the Trainer's default precision
        ("32-true", torch.bfloat16, 5e-2),
        ("32-true", torch.float64, 1e-3),  # a higher dtype does not tighten the Trainer's precision
        ("bf16-mixed", torch.float32, 5e-2),
        ("16-mixed", None, 5e-2),
    ],
)
def test_tolerance_follows_the_lowest_precision_computed_in(precision, dtype, expected):
    assert tolerance(precision, dtype) == expected


def _lowest(module: nn.Module, step) -> torch.dtype | None:
    lowest = LowestFloat(module)
    with lowest, torch.enable_grad():
        loss = step()
    lowest.see(loss)
    return lowest.dtype


def test_lowest_float_sees_parameters_and_differentiable_values_not_constants():
    m = ResMLP().double()
    x, y = make_dataset(8).tensors
    assert _lowest(m, lambda: F.cross_entropy(m(x.double()), y)) == torch.float64
    assert _lowest(m, lambda: F.cross_entropy(m(x.double()).float(), y)) == torch.float32

    def with_float32_constant():  # as transformers' rotary frequencies: float32, no gradient, same in both steps
        scale = torch.arange(3, dtype=torch.float32).cos().double()
        return F.cross_entropy(m(x.double()) * scale, y)

    assert _lowest(m, with_float32_constant) == torch.float64
    h = ResMLP().half()
    assert _lowest(h, lambda: h(x.half()).float().sum()) == torch.float16  # the parameters alone decide it


# ---------------------------------------------------------------------------------------------- trainer state
class _Scheduled(ResMLP):
    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}


def test_trainer_state_gives_real_optimizers_and_schedulers_then_restores_them():
    m = _Scheduled()
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    m.trainer = trainer
    assert trainer.optimizers == [] and trainer.lr_scheduler_configs == []
    before = [p.detach().clone() for p in m.parameters()]
    with trainer_state(trainer, m):
        assert trainer.optimizers[0].param_groups[0]["lr"] == 0.1
        assert m.lr_schedulers().get_last_lr() == [0.1]
        assert m.optimizers().param_groups[0]["params"][0] is next(m.parameters())
    assert trainer.optimizers == [] and trainer.lr_scheduler_configs == []
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))  # nothing stepped


# ---------------------------------------------------------------------------------------------- compiled modules
class _Wrapped(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 16), nn.GELU(), nn.Linear(16, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_submodule_compiled_by_the_user_is_refused_by_name():
    m = _Wrapped()
    m.net = torch.compile(m.net)  # lazy: nothing is compiled before the first call
    with pytest.raises(ValueError, match=r"'net' \(OptimizedModule\) was compiled with torch.compile before fit"):
        check_not_compiled(m)
    m = _Wrapped()
    m.net[0].compile()  # in place
    with pytest.raises(ValueError, match=r"'net.0' \(Linear\).*module.compile\(\).*Pass the uncompiled module"):
        check_not_compiled(m)
    m = _Wrapped()
    m.net.forward = torch.compile(m.net.forward)
    with pytest.raises(ValueError, match=r"'net'.*torch.compile\(module.forward\)"):
        check_not_compiled(m)


def test_our_own_block_compilation_is_not_refused():
    m = ResMLP()
    compile_blocks(m)  # DPMPStrategy(compile=True) does this after the split
    check_not_compiled(m)
    uncompile_blocks(m)
    check_not_compiled(m)


def test_a_compiled_lightning_module_is_refused_at_setup_on_every_rank(monkeypatch):
    m = from_compiled(torch.compile(_Wrapped()))  # what Trainer.fit does with a compiled LightningModule
    with pytest.raises(ValueError, match="the LightningModule _Wrapped was compiled with torch.compile before fit"):
        check_plan_at_setup(m, None, 2, 0)
    waits: list[float] = []
    monkeypatch.setattr(time, "sleep", waits.append)  # the grace for rank 0's message, not waited out here
    with pytest.raises(SystemExit):  # another rank: rank 0 reports
        check_plan_at_setup(m, None, 2, 1)
    assert waits == [10.0]


@pytest.mark.parametrize("compiled_what", ["submodule", "lightning_module"])
def test_fit_with_a_user_compiled_model_fails_before_launch(monkeypatch, compiled_what):
    def refuse(self):
        raise AssertionError("the launcher started child processes: the check did not run before launch")

    monkeypatch.setattr(DPMPScriptLauncher, "_call_children_scripts", refuse)
    m = _Wrapped()
    if compiled_what == "submodule":
        m.net = torch.compile(m.net)
    model = torch.compile(m) if compiled_what == "lightning_module" else m
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DPMPStrategy(dp=1, mp=2), max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    start = time.monotonic()
    with pytest.raises(ValueError, match="compiled with torch.compile before fit") as info:
        trainer.fit(model, DataLoader(make_dataset(), batch_size=4))
    assert time.monotonic() - start < 10
    assert "DPMPStrategy(compile=True)" in str(info.value)
