"""Checkpoint building blocks without processes: mismatch errors, atomic replacement, RNG states, safe loading."""

from __future__ import annotations

import io
import os
import pickle
import random
from unittest import mock

import numpy as np
import pytest
import torch

from lightning_dpmp import DPMPStrategy
from lightning_dpmp.checkpoint.consolidated import CheckpointMismatchError, check_state_matches
from lightning_dpmp.checkpoint.files import (
    atomic_save,
    load_file,
    make_weights_only_safe,
    recover_path,
    replace_path,
)
from lightning_dpmp.checkpoint.rng_states import collect_rng_states, restore_rng_states
from lightning_dpmp.checkpoint.sharded import _SafeReader
from lightning_dpmp.parallel.grid import Grid
from lightning_dpmp.parallel.topology import Topology
from tests.support.models import ResMLP

MODEL = {"a.weight": (4, 2), "a.bias": (4,), "b.weight": (3, 4)}


@pytest.mark.parametrize(
    ("found", "strict", "message"),
    [
        ({"a.weight": (4, 2), "b.weight": (3, 4)}, True, "missing key 'a.bias' (shape (4,) in the model)."),
        ({**MODEL, "c.weight": (1,)}, True, "unexpected key 'c.weight' (shape (1,) in the checkpoint)."),
        ({**MODEL, "a.weight": (8, 2)}, True, "'a.weight' has shape (8, 2) in the checkpoint but (4, 2) in the model."),
        ({"a.weight": (8, 2), "z": (1,)}, False,
         "'a.weight' has shape (8, 2) in the checkpoint but (4, 2) in the model."),
        ({"x": (1,), "a.weight": (5, 2)}, True, "missing key 'a.bias' (shape (4,) in the model). (3 more differences)"),
    ],
)
def test_mismatch_names_the_first_difference(found, strict, message):
    with pytest.raises(CheckpointMismatchError) as err:
        check_state_matches(MODEL, found, strict)
    assert str(err.value) == f"Checkpoint does not match the model: {message}"


def test_matching_and_non_strict_subsets_pass():
    check_state_matches(MODEL, dict(MODEL), strict=True)
    check_state_matches(MODEL, {"a.weight": (4, 2), "extra": (7,)}, strict=False)


def test_strategy_refuses_a_consolidated_checkpoint_of_another_model():
    strategy = DPMPStrategy(dp=1, mp=1)
    strategy._grid = Grid(Topology(), rank=0)  # as after setup_environment, without a process group
    strategy._lightning_module = ResMLP(hidden=48)
    expected = r"'blocks.0.fc1.weight' has shape \(32, 16\) in the checkpoint but \(48, 16\)"
    with pytest.raises(CheckpointMismatchError, match=expected):
        strategy.load_model_state_dict({"state_dict": ResMLP().state_dict()})


def test_atomic_save_replaces_files_and_folders(tmp_path):
    path = str(tmp_path / "last.ckpt")
    atomic_save({"v": torch.tensor(1)}, path)
    atomic_save({"v": torch.tensor(2)}, path)
    assert load_file(path)["v"].item() == 2
    os.remove(path)
    os.makedirs(os.path.join(path, "inner"))  # a sharded folder of the same name: a file may replace it
    atomic_save({"v": torch.tensor(3)}, path)
    assert os.path.isfile(path) and load_file(path)["v"].item() == 3
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]


def test_a_crash_between_the_two_renames_is_recoverable(tmp_path):
    path, new = str(tmp_path / "last.ckpt"), str(tmp_path / "new")
    os.makedirs(os.path.join(path, "old_marker"))
    os.makedirs(new)
    real = os.replace
    calls = []

    def crash_on_second(src, dst):
        calls.append(src)
        if len(calls) == 2:
            raise OSError("simulated crash")
        real(src, dst)

    with mock.patch("lightning_dpmp.checkpoint.files.os.replace", crash_on_second), pytest.raises(OSError):
        replace_path(new, path)
    found = recover_path(path)
    assert found != path and os.path.isdir(os.path.join(found, "old_marker"))
    assert recover_path(str(tmp_path / "other.ckpt")) == str(tmp_path / "other.ckpt")


def test_rng_states_survive_weights_only():
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    buf = io.BytesIO()
    torch.save({"rng": collect_rng_states()}, buf)
    expected = (torch.rand(3), np.random.rand(3), random.random())
    buf.seek(0)
    restore_rng_states(torch.load(buf, weights_only=True)["rng"])
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(expected[0], again[0]) and np.array_equal(expected[1], again[1]) and expected[2] == again[2]


def test_omegaconf_hyperparameters_become_weights_only_loadable(tmp_path):
    from omegaconf import OmegaConf

    hparams = OmegaConf.create({"lr": 0.1, "sizes": [1, 2]})
    ckpt = {"hyper_parameters": hparams, "hparams_type": type(OmegaConf.create())}
    atomic_save(make_weights_only_safe(ckpt), str(tmp_path / "h.ckpt"))
    assert load_file(str(tmp_path / "h.ckpt")) == {"hyper_parameters": {"lr": 0.1, "sizes": [1, 2]}}


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_sharded_metadata_is_not_unpickled_blindly(tmp_path):
    with open(tmp_path / ".metadata", "wb") as f:
        pickle.dump(_Evil(), f)
    with pytest.raises(pickle.UnpicklingError, match="refusing to unpickle posix.system"):
        _SafeReader(str(tmp_path)).read_metadata()
