"""A Lightning callback that measures what the run summary reports: throughput, parameters per rank, memory, loss."""

from __future__ import annotations

import resource
import sys
import time
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

__all__ = ["RunStats"]


def _peak_memory_mb(device: torch.device) -> float:
    """Peak CUDA memory allocated by this process, or its peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB on Linux


class RunStats(Callback):
    """Times the training steps and collects the figures of ``summary.json``.

    Throughput counts the *global* batch (``dp`` x the local batch; MP ranks share a batch) over the time spent inside
    training steps (forward, backward, optimizer), leaving out the first ``warmup_steps`` steps (fewer in a very short
    run: at least one step is always timed); data loading and validation are excluded. Figures that differ per rank
    (memory, parameters) are reduced to the max over all ranks. ``first_loss`` is the first training step's loss,
    ``final_loss`` the mean over the last ``min(10, steps // 2)`` steps (the last step alone in a 1-step run); both
    are averaged over the DP replicas.

    Args:
        dp: data-parallel size (the number of distinct batches per step).
        warmup_steps: first steps left out of the timing.
    """

    def __init__(self, dp: int, warmup_steps: int = 3) -> None:
        self.dp = dp
        self.warmup_steps = warmup_steps
        self.stats: dict[str, Any] = {}
        self._t0 = 0.0
        self._steps: list[tuple[float, int, int]] = []  # (seconds, global samples, global tokens) per batch
        self._losses: list[float] = []

    def _sync(self, trainer: "pl.Trainer") -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._fit_start = time.perf_counter()
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)

    @override
    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int
    ) -> None:
        self._sync(trainer)
        self._t0 = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._sync(trainer)
        elapsed = time.perf_counter() - self._t0
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self._losses.append(float(loss.detach()))
        x = batch[0] if isinstance(batch, (list, tuple)) else batch
        tokens = x.numel() * self.dp if not torch.is_floating_point(x) and x.ndim == 2 else 0  # token ids (B, T)
        self._steps.append((elapsed, int(x.shape[0]) * self.dp, tokens))

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        device = trainer.strategy.root_device
        params = sum(p.numel() for p in pl_module.parameters())
        # first_loss is the first step's loss; final_loss the mean of the last steps, at most 10 and at most half of
        # the run, so the two never share a step unless the run has one (a shared 10-step window made them equal).
        n = min(10, max(1, len(self._losses) // 2)) if self._losses else 0
        first = self._losses[0] if n else 0.0
        last = sum(self._losses[-n:]) / max(1, n)
        local = torch.tensor([params, _peak_memory_mb(device), first, last], dtype=torch.float64, device=device)
        maxed = trainer.strategy.reduce(local.clone(), reduce_op="max")
        meaned = trainer.strategy.reduce(local.clone(), reduce_op="mean")  # MP ranks agree: mean over DP
        # Leave out the warm-up steps, but always keep at least one timed step.
        timed_steps = self._steps[min(self.warmup_steps, max(0, len(self._steps) - 1)) :]
        timed = sum(t for t, _, _ in timed_steps)
        samples = sum(s for _, s, _ in timed_steps)
        tokens = sum(k for _, _, k in timed_steps)
        val = trainer.callback_metrics.get("val/loss")
        self.stats = {
            "steps": int(trainer.global_step),
            "timed_steps": len(timed_steps),
            "step_time_s": timed / len(timed_steps) if timed_steps else None,
            "samples_per_s": samples / timed if timed > 0 else None,
            "tokens_per_s": tokens / timed if timed > 0 and tokens else None,
            "params_per_rank": int(maxed[0].item()),
            "peak_mem_mb": round(float(maxed[1].item()), 1),
            "first_loss": float(meaned[2].item()) if n else None,
            "final_loss": float(meaned[3].item()) if n else None,
            "final_val_loss": float(val) if val is not None else None,
            "fit_s": time.perf_counter() - self._fit_start,
        }

    def result(self) -> Optional[dict[str, Any]]:
        return self.stats or None
