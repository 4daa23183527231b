"""Single-process Lightning reference runs for the parity tests (same seed, same global batch, same permutation)."""

from __future__ import annotations

import lightning as L
import torch

from tests.distributed import parity_worker as W
from tests.support.models import build, reference_loader

#: (model name, precision, extra Trainer arguments) -> the reference checkpoint: each reference is trained once per
#: test session.
_REFERENCES: dict[tuple, dict] = {}
#: the same key -> the ``train_loss`` logged at each optimizer step (``{global_step: value}``)
LOGGED: dict[tuple, dict[int, float]] = {}


def reference_run(name: str, precision: str, path, **trainer_kwargs) -> dict:
    """Train ``name`` on one process exactly as the workers do on many; return its saved checkpoint (also written
    to ``path``). Trained once per session and model/precision/``trainer_kwargs`` (e.g. ``max_steps``,
    ``accumulate_grad_batches``): later calls reuse it (the run is deterministic)."""
    key = (name, precision, tuple(sorted(trainer_kwargs.items())))
    if key not in _REFERENCES:
        _REFERENCES[key] = _train_reference(name, precision, path, key, **trainer_kwargs)
    torch.save(_REFERENCES[key], path)
    return torch.load(path, weights_only=True)  # a copy: a caller that edits it cannot change the next one's


class _Logged(L.Callback):
    def __init__(self, into: dict[int, float]) -> None:
        self.into = into

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if "train_loss" in trainer.callback_metrics:
            self.into[trainer.global_step] = float(trainer.callback_metrics["train_loss"])


def _train_reference(name: str, precision: str, path, key: tuple = (), **trainer_kwargs) -> dict:
    L.seed_everything(W.SEED, workers=True)
    model, dataset = build(name)
    settings = dict(max_steps=W.STEPS, gradient_clip_val=W.CLIP, gradient_clip_algorithm="norm")
    trainer = L.Trainer(
        accelerator="cpu", devices=1, precision=precision, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[_Logged(LOGGED.setdefault(key, {}))],
        **{**settings, **trainer_kwargs},
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
