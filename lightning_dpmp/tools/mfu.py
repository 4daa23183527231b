"""Measured throughput while training: tokens/s, model TFLOP/s per device and MFU, beside the estimator's prediction.

:class:`MFUMonitor` is a Lightning callback. Each optimizer step it measures the wall time between two step starts
(on rank 0's clock), counts the tokens of the global batch (this rank's token tensor x the DP degree) and logs:

* ``perf/tokens_per_s``;
* ``perf/tflops_per_device``: model FLOPs (forward + backward, recomputation not counted) per second per device;
* ``perf/mfu``: that over the device's dense peak in the run's precision (Megatron's convention, as torchtitan
  logs it);
* with a :class:`~lightning_dpmp.tools.profile.ModelProfile`: ``perf/predicted_step_s`` and ``perf/predicted_mfu``,
  what :func:`~lightning_dpmp.tools.estimate.predict` says for the running layout (read from the strategy's
  ``dp``/``pp``/``mp``/``zero``, one process = (1, 1, 1)).

Model FLOPs per token come from the profile, else ``flops_per_token``, else ``6 x`` the parameters' element count
(their global count under DTensor parameters; pass ``flops_per_token`` or a profile where parameters are plain
shards: ZeRO, a pipeline).

Example:
    >>> monitor = MFUMonitor(device="cpu", flops_per_token=6 * 8e6)
    >>> trainer = L.Trainer(callbacks=[monitor], ...)           # doctest: +SKIP
    >>> monitor.summary()["mfu"]                                # the median over the measured steps  # doctest: +SKIP
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Optional, Union

from lightning.pytorch.callbacks import Callback

from lightning_dpmp.tools.estimate import DEVICES, PRECISIONS, Device, LayoutSpec, predict
from lightning_dpmp.tools.profile import ModelProfile, token_tensor

__all__ = ["MFUMonitor"]


class MFUMonitor(Callback):
    """Log tokens/s, model TFLOP/s per device, MFU and the estimator's prediction every optimizer step.

    Args:
        device: a preset name of :data:`~lightning_dpmp.tools.estimate.DEVICES` or a
            :class:`~lightning_dpmp.tools.estimate.Device` (its dense peak is the MFU's denominator).
        flops_per_token: model FLOPs per token, forward + backward; ``None``: from ``profile``, else 6 x parameters.
        profile: the model's profile (:func:`~lightning_dpmp.tools.profile.profile_config` or
            ``profile_step``); gives the FLOPs and the predicted step.
        warmup_steps: steps not measured (compilation, allocator warm-up).
    """

    def __init__(self, device: Union[str, Device] = "h100", flops_per_token: Optional[float] = None,
                 profile: Optional[ModelProfile] = None, warmup_steps: int = 1) -> None:
        if isinstance(device, str) and device not in DEVICES:
            raise ValueError(f"MFUMonitor(device={device!r}): known presets are {sorted(DEVICES)}")
        self.device = DEVICES[device] if isinstance(device, str) else device
        self.flops_per_token = flops_per_token
        self.profile = profile
        self.warmup_steps = warmup_steps
        self.history: list[dict[str, float]] = []
        self._start: Optional[float] = None
        self._tokens = 0

    def _layout(self, trainer: Any) -> tuple[int, int, int, int]:
        s = trainer.strategy
        world = trainer.world_size
        dp = int(getattr(s, "dp", world) or world)
        return dp, int(getattr(s, "pp", 1) or 1), int(getattr(s, "mp", 1) or 1), int(getattr(s, "zero", 0) or 0)

    def _model_flops_per_token(self, pl_module: Any) -> float:
        if self.flops_per_token is not None:
            return self.flops_per_token
        if self.profile is not None:
            return self.profile.model_flops_per_token()
        return 6.0 * sum(p.numel() for p in pl_module.parameters())

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        now = time.perf_counter()
        if self._start is not None and self._tokens and trainer.global_step > self.warmup_steps:
            self._record(trainer, pl_module, now - self._start)
        self._start = now
        try:
            self._tokens = token_tensor(batch).numel()
        except ValueError:
            self._tokens = 0

    def _record(self, trainer: Any, pl_module: Any, step_s: float) -> None:
        dp, pp, mp, zero = self._layout(trainer)
        precision = str(trainer.precision)
        dtype = PRECISIONS[precision][0] if precision in PRECISIONS else "fp32"
        tokens = self._tokens * dp
        flops = self._model_flops_per_token(pl_module) * tokens
        peak = self.device.peak_flops[dtype]
        row = {"step_s": step_s, "tokens_per_s": tokens / step_s,
               "tflops_per_device": flops / step_s / trainer.world_size / 1e12,
               "mfu": flops / (step_s * trainer.world_size * peak)}
        if self.profile is not None and precision in PRECISIONS:
            seqs = tokens // self.profile.seq
            if seqs > 0 and seqs % dp == 0:
                spec = LayoutSpec(dp, pp, mp, zero, microbatches=pp if pp > 1 else 1,
                                  schedule="1f1b" if pp > 1 else "none")
                est = predict(self.profile, self.device, trainer.world_size, seqs, spec, precision)
                row.update(predicted_step_s=est.step_s, predicted_mfu=est.mfu)
        self.history.append(row)
        for k, v in row.items():
            pl_module.log(f"perf/{k}", v, on_step=True, on_epoch=False, sync_dist=False, rank_zero_only=True)

    def summary(self) -> dict[str, float]:
        """Medians over the measured steps (empty before any)."""
        if not self.history:
            return {}
        return {k: statistics.median(r[k] for r in self.history if k in r) for k in self.history[-1]}
