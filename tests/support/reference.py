"""Single-process Lightning reference runs for the parity tests (same seed, same global batch, same permutation)."""

from __future__ import annotations

import lightning as L
import torch

from tests.distributed import parity_worker as W
from tests.support.models import build, reference_loader

#: (model name, precision) -> the reference checkpoint: each reference is trained once per test session.
_REFERENCES: dict[tuple[str, str], dict] = {}


def reference_run(name: str, precision: str, path) -> dict:
    """Train ``name`` on one process exactly as the workers do on many; return its saved checkpoint (also written
    to ``path``). Trained once per session and model/precision: later calls reuse it (the run is deterministic)."""
    key = (name, precision)
    if key not in _REFERENCES:
        _REFERENCES[key] = _train_reference(name, precision, path)
    torch.save(_REFERENCES[key], path)
    return torch.load(path, weights_only=True)  # a copy: a caller that edits it cannot change the next one's


def _train_reference(name: str, precision: str, path) -> dict:
    L.seed_everything(W.SEED, workers=True)
    model, dataset = build(name)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, precision=precision, max_steps=W.STEPS, gradient_clip_val=W.CLIP,
        gradient_clip_algorithm="norm", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, reference_loader(dataset, W.GLOBAL_BATCH, W.SEED))
    trainer.save_checkpoint(path)
    return torch.load(path, weights_only=True)


def one_process_trainer(**kwargs) -> L.Trainer:
    """The single-process reference Trainer: CPU, one device, float64, nothing logged or saved; ``kwargs`` add to
    or override those (``max_steps``, ``callbacks``, clipping, ...)."""
    defaults = dict(accelerator="cpu", devices=1, precision="64-true", logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
    return L.Trainer(**{**defaults, **kwargs})


def max_json_diff(ours: dict, ref: dict) -> float:
    """Largest difference between weights a worker wrote as JSON lists and a reference ``state_dict``."""
    return max((torch.tensor(ours[k], dtype=torch.float64) - ref[k].double()).abs().max().item() for k in ref)


def max_weight_diff(ckpt: dict, ref: dict) -> float:
    ours, theirs = ckpt["state_dict"], ref["state_dict"]
    assert ours.keys() == theirs.keys(), set(ours) ^ set(theirs)
    return max((ours[k] - theirs[k]).abs().max().item() for k in theirs)
