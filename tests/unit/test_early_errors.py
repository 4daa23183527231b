"""Issue 15's bad inputs that fail before any process starts: at construction, or in the launcher before it starts
the children (``fit`` with devices=2 here never launches: starting a child fails the test), and truncated
checkpoints. Each case asserts the exception type, the message's key words, and that it fails within seconds.
The multi-process cases (a ``configure_model`` model, the warnings) are in tests/integration/test_early_errors.py.
"""

from __future__ import annotations

import time
import warnings

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dpmp import DPMPStrategy
from lightning_dpmp.checkpoint.files import load_file
from lightning_dpmp.checkpoint.integrity import IncompleteCheckpointError, checkpoint_problem, load_checked
from lightning_dpmp.integration.launcher import DPMPScriptLauncher
from lightning_dpmp.integration.validate import (
    DataSizeWarning,
    IdleModelParallelWarning,
    check_ckpt_path,
    ddp_kwargs_from_user,
    only_rank_zero_reports,
    warn_if_data_smaller_than_dp,
    warn_if_mp_idle,
)
from tests.support.models import ResMLP, make_dataset

FAST_S = 10  # generous on a loaded 2-core machine; a launch alone takes longer


@pytest.fixture
def no_children(monkeypatch):
    """Starting a child process fails the test: every check here must run before the launch."""

    def refuse(self):
        raise AssertionError("the launcher started child processes: the check did not run before launch")

    monkeypatch.setattr(DPMPScriptLauncher, "_call_children_scripts", refuse)


def _fit(model, strategy, **fit_kwargs):
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    start = time.monotonic()
    try:
        trainer.fit(model, DataLoader(make_dataset(), batch_size=4), **fit_kwargs)
    finally:
        assert time.monotonic() - start < FAST_S


# ---------------------------------------------------------------------------------------------- construction
def test_misspelt_style_fails_at_construction_with_did_you_mean():
    start = time.monotonic()
    with pytest.raises(ValueError) as err:
        DPMPStrategy(dp=1, mp=2, plan_overrides={"x": "colum"})
    msg = str(err.value)
    assert "plan['x'] = 'colum' is not a style" in msg and "did you mean 'column'?" in msg
    assert "column, row, column_gather, vocab, experts, heads, replicate" in msg  # the valid ones
    assert time.monotonic() - start < 1


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"plan_overrides": "column"}, TypeError, "`plan_overrides` must be a mapping of module-name glob -> style"),
        ({"plan_overrides": {"fc1": 1}}, TypeError, "`plan_overrides` entries must be str glob -> str style"),
        ({"plan_overrides": {("fc1",): "row"}}, TypeError, "`plan_overrides` entries must be str glob -> str style"),
        ({"sequence_parallel": "yes"}, TypeError, "`sequence_parallel` must be True or False, got 'yes'"),
        ({"verify_plan": 1}, TypeError, "`verify_plan` must be True or False"),
        ({"consolidate_on_teardown": None}, TypeError, "`consolidate_on_teardown` must be 'rank0', True or False"),
        ({"save_distributed_checkpoint": "false"}, TypeError, "`save_distributed_checkpoint` must be True or False"),
        ({"process_group_backend": 1}, TypeError, "`process_group_backend` must be a backend name"),
        ({"start_method": "popn"}, ValueError, "did you mean 'popen'?"),
    ],
)
def test_every_plain_argument_is_type_checked_at_construction(kwargs, error, words):
    with pytest.raises(error) as err:
        DPMPStrategy(dp=1, mp=2, **kwargs)
    assert words in str(err.value)


def test_ddp_defaults_are_accepted_and_dropped_a_real_group_is_refused():
    # What LightningCLI passes behind **ddp_kwargs: DistributedDataParallel's and DDPStrategy's own defaults.
    assert ddp_kwargs_from_user({"process_group": None, "dim": 0, "broadcast_buffers": None, "static_graph": False,
                                 "bucket_cap_mb": None, "ddp_comm_hook": None}) == {}
    cli = {"ddp_comm_state": None, "ddp_comm_hook": None, "ddp_comm_wrapper": None, "model_averaging_period": None}
    assert DPMPStrategy(dp=2, mp=2, **cli)._ddp_kwargs == {}  # (with mp > 1 DDP's options are refused: none here)
    with pytest.raises(ValueError, match=r"\['ddp_comm_hook'\] do not apply"):
        DPMPStrategy(dp=2, mp=2, ddp_comm_hook=print)
    user = {"static_graph": True, "bucket_cap_mb": 50}
    assert ddp_kwargs_from_user(user) == {"static_graph": True, "bucket_cap_mb": 50}
    assert DPMPStrategy(dp=1, mp=2, process_group=None, find_unused_parameters=False)._ddp_kwargs == {}
    with pytest.raises(ValueError, match="do not pass `process_group`"):
        DPMPStrategy(dp=1, mp=2, process_group=object())
    with pytest.raises(ValueError, match="do not pass `device_mesh`"):
        DPMPStrategy(dp=1, mp=2, device_mesh=object())


# ---------------------------------------------------------------------------------------------- before launch
@pytest.mark.parametrize(
    "plan, words",
    [
        ({"blocks.*.fc3": "column"}, ["'blocks.*.fc3' matches no module of ResMLP", "did you mean 'blocks.*.fc"]),
        ({"decoder.*": "row"}, ["'decoder.*' matches no module of ResMLP", "refused rather than ignored"]),
        ({"blocks.0.ln": "column"}, ["'blocks.0.ln', a LayerNorm, and no nn.Linear"]),
        ({"head": "column"}, ["plan forces 'head' to 'column'", "out_features=3 is not divisible by mp=2"]),
        ({"norm": "vocab"}, ["'norm', a LayerNorm"]),
    ],
)
def test_plan_against_the_model_fails_before_launch(no_children, plan, words):
    with pytest.raises(ValueError) as err:
        _fit(ResMLP(), DPMPStrategy(dp=1, mp=2, plan_overrides=plan))
    for w in words:
        assert w in str(err.value)


def test_a_valid_plan_reaches_the_launch(no_children):
    with pytest.raises(AssertionError, match="started child processes"):
        _fit(ResMLP(), DPMPStrategy(dp=1, mp=2, plan_overrides={"blocks.*.fc1": "column", "blocks.*.fc2": "row"}))


class _BuiltLater(ResMLP):
    def __init__(self) -> None:
        super().__init__()
        self.extra = None

    def configure_model(self) -> None:
        if self.extra is None:
            self.extra = nn.Linear(16, 16)


def test_a_configure_model_model_defers_the_glob_check_to_setup(no_children):
    # `extra` only exists after configure_model: refusing 'extra' before launch would be wrong.
    with pytest.raises(AssertionError, match="started child processes"):
        _fit(_BuiltLater(), DPMPStrategy(dp=1, mp=2, plan_overrides={"extra": "column"}))


def test_missing_ckpt_path_fails_before_launch_and_suggests_the_near_name(no_children, tmp_path):
    (tmp_path / "epoch=1.ckpt").write_bytes(b"")
    with pytest.raises(FileNotFoundError) as err:
        _fit(ResMLP(), DPMPStrategy(dp=1, mp=2), ckpt_path=str(tmp_path / "epoch=2.ckpt"))
    assert "epoch=2.ckpt' does not exist" in str(err.value) and "Did you mean" in str(err.value)
    with pytest.raises(FileNotFoundError, match="the folder .* does not exist either"):
        check_ckpt_path(str(tmp_path / "nowhere" / "last.ckpt"))
    for special in ("last", "best", "hpc", "registry", "registry:model:latest", "s3://bucket/x.ckpt", None):
        check_ckpt_path(special)  # resolved by Lightning or a remote filesystem: not checked here


def _truncated(tmp_path, fraction: float = 0.5):
    full = tmp_path / "full.ckpt"
    torch.save({"state_dict": ResMLP().state_dict(), "epoch": 1}, full)
    data = full.read_bytes()
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(data[: int(len(data) * fraction)])
    return full, cut


def test_truncated_ckpt_fails_before_launch_naming_the_file(no_children, tmp_path):
    _, cut = _truncated(tmp_path)
    with pytest.raises(IncompleteCheckpointError) as err:
        _fit(ResMLP(), DPMPStrategy(dp=1, mp=2), ckpt_path=str(cut))
    assert str(cut) in str(err.value) and "incomplete" in str(err.value) and "cut short" in str(err.value)


@pytest.mark.parametrize("fraction", [0.5, 0.999, 0.01])
def test_truncated_checkpoint_load_names_the_file_instead_of_errno_22(tmp_path, fraction):
    # Cut 10 bytes from the end gave `OSError: [Errno 22] Invalid argument`; in half, a miniz RuntimeError.
    full, cut = _truncated(tmp_path, fraction)
    with pytest.raises(IncompleteCheckpointError, match=r"cut\.ckpt'.*incomplete") as err:
        load_checked(str(cut), load_file)
    assert isinstance(err.value.__cause__, (RuntimeError, OSError, EOFError))
    assert checkpoint_problem(str(full)) is None and "state_dict" in load_checked(str(full), load_file)


def test_empty_garbage_and_legacy_files(tmp_path):
    (tmp_path / "empty.ckpt").write_bytes(b"")
    (tmp_path / "notes.ckpt").write_text("not a checkpoint")
    torch.save({"a": torch.ones(2)}, tmp_path / "legacy.ckpt", _use_new_zipfile_serialization=False)
    assert "empty" in checkpoint_problem(str(tmp_path / "empty.ckpt"))
    with pytest.raises(IncompleteCheckpointError, match="not a checkpoint written by torch.save"):
        load_checked(str(tmp_path / "notes.ckpt"), load_file)
    assert checkpoint_problem(str(tmp_path / "legacy.ckpt")) is None
    assert torch.equal(load_checked(str(tmp_path / "legacy.ckpt"), load_file)["a"], torch.ones(2))


class _Pickled:
    pass


def test_a_weights_only_refusal_is_not_called_corrupt(tmp_path):
    torch.save({"obj": _Pickled()}, tmp_path / "obj.ckpt")
    with pytest.raises(Exception) as err:
        load_checked(str(tmp_path / "obj.ckpt"), load_file)
    assert not isinstance(err.value, IncompleteCheckpointError)


def test_only_rank_zero_reports_others_exit_quietly():
    with pytest.raises(ValueError, match="bad"):
        with only_rank_zero_reports(0):
            raise ValueError("bad")
    with pytest.raises(SystemExit) as exit_:
        with only_rank_zero_reports(3, grace_s=0.0):
            raise ValueError("bad")
    assert exit_.value.code == 1 and exit_.value.__cause__ is None and exit_.value.__suppress_context__
    with pytest.raises(RuntimeError):  # not an input error: every rank reports it
        with only_rank_zero_reports(3, grace_s=0.0):
            raise RuntimeError("collective failed")


# ---------------------------------------------------------------------------------------------- warnings
def test_idle_mp_warning_names_mp_and_suggests_dp_world():
    with pytest.warns(IdleModelParallelWarning) as rec:
        warn_if_mp_idle(0, dp=1, mp=2)
    msg = str(rec[0].message)
    assert "mp=2" in msg and "splits no parameter" in msg and "Use mp=1 and dp=2" in msg
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_if_mp_idle(4, dp=1, mp=2) is None and warn_if_mp_idle(0, dp=4, mp=1) is None


def test_data_smaller_than_dp_warns_with_length_and_dp():
    tiny = DataLoader(TensorDataset(torch.zeros(3, 2)), batch_size=1)
    with pytest.warns(DataSizeWarning) as rec:
        warn_if_data_smaller_than_dp({"a": tiny}, True, dp=4)
    msg = str(rec[0].message)
    assert "has 3 sample(s), fewer than dp=4" in msg and "repeating 1 of them" in msg and "dp <= 3" in msg
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_if_data_smaller_than_dp(tiny, True, dp=3) is None
        assert warn_if_data_smaller_than_dp(tiny, False, dp=4) is None  # not sharded by Lightning: other warning
