"""What user code reads of the parameters, under DPMPStrategy and on one process: Lightning's ``grad_norm`` logged
from ``on_before_optimizer_step``, the gradients' squares in ``on_after_backward``, a callback's weight norm and
TensorBoard histograms, ``state_dict()`` and torch's DCP ``get_model_state_dict`` (sharded and full), Lightning's
``ModelSummary``, an L2 term in ``training_step``, and the weights trained, in float64.

Run by ``tests/distributed/test_user_view.py`` on pool ranks (``DP MP OUT CASES``) and imported by it for the
one-process reference (:func:`fit_case` with ``dp = mp = 1``). Each rank writes ``OUT/rank<r>.json``:
``{case: {"logged": {key: {step: value}}, "state_sq": ..., "summary": ..., "histograms": ..., "weights": ...,
"plan": ...}}``.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from datetime import timedelta
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch.utilities import grad_norm  # noqa: E402
from lightning.pytorch.utilities.model_summary import ModelSummary  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_dpmp import DPMPStrategy, PlanFallbackWarning, compat  # noqa: E402
from tests.support.models import LMModule, build, reference_loader  # noqa: E402

GLOBAL_BATCH, STEPS, SEED, L2, CLIP = 8, 10, 0, 1e-3, 0.3
LOGGED = ("grad_2.0_norm_total", "grad_sq", "weight_norm", "train_loss")


class Recording(torch.optim.AdamW):
    """AdamW noting the innermost ``TorchFunctionMode`` of its update (after the closure, which runs the step and
    the hooks of user code) and of its ``zero_grad``: the strategy's modes of user code step aside for both, as
    the optimizer holds the plain local parameters."""

    seen: list[Optional[str]] = []  # the running case's list (the strategy may rebuild the optimizer as type(opt))

    def _note(self) -> None:
        mode = compat.current_function_mode()
        Recording.seen.append(type(mode).__name__ if mode is not None else None)

    def step(self, closure: Any = None) -> Any:
        out = super().step(closure)
        self._note()
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._note()
        super().zero_grad(set_to_none)


class Watched(LMModule):
    """An LM whose user code reads its parameters the ways Lightning users do."""

    l2 = 0.0
    clip = 0.0

    def __init__(self, net: Any) -> None:
        super().__init__(net)
        self.micro_sq: list[float] = []
        self.no_grad: list[str] = []
        self.in_optimizer: list[Optional[str]] = []

    def configure_optimizers(self) -> Any:
        # LMModule's optimizer and warm-up, noting the modes (torch's schedule wraps opt.step on the instance)
        Recording.seen = self.in_optimizer
        opt = Recording(self.parameters(), lr=self.lr, weight_decay=0.01)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
        if self.l2:  # an explicit L2 term: reads every parameter outside the layers
            loss = loss + self.l2 * sum(p.pow(2).sum() for p in self.parameters())
        self.log("train_loss", loss, sync_dist=True)  # the DP ranks' mean: the global batch's loss
        return loss

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.log_dict(grad_norm(self, norm_type=2))  # Lightning's documented way to watch gradients
        if self.clip:  # clipping by hand, in place: what the optimizer then steps
            torch.nn.utils.clip_grad_norm_(self.parameters(), self.clip)

    def on_after_backward(self) -> None:
        # which parameters have no gradient (None, as on one process for a parameter nothing reached)
        self.no_grad = sorted(n for n, p in self.named_parameters() if p.grad is None)
        grad_sq = sum(p.grad.pow(2).sum() for p in self.parameters() if p.grad is not None)
        self.log("grad_sq", grad_sq)
        self.micro_sq.append(float(grad_sq))  # every backward's, micro-batches under accumulation included


class Watch(L.Callback):
    """A weight-norm callback (logged); at the start Lightning's ModelSummary counts; at the last step TensorBoard's
    histogram of every parameter and the sum of squares of ``state_dict()``'s full tensors."""

    def __init__(self) -> None:
        self.logged: dict[str, dict[int, float]] = {k: {} for k in LOGGED}
        self.histograms: dict[str, list[float]] = {}
        self.state_sq = self.dcp_sq = self.dcp_full_sq = 0.0
        self.dcp_keys: list[str] = []
        self.summary: list[int] = []

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        summary = ModelSummary(pl_module)  # what Lightning's ModelSummary callback prints when fitting starts
        self.summary = [summary.total_parameters, summary.trainable_parameters]

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        pl_module.log("weight_norm", torch.sqrt(sum(p.pow(2).sum() for p in pl_module.parameters())))
        step = trainer.global_step
        for key in LOGGED:
            if key in trainer.callback_metrics:
                self.logged[key][step] = float(trainer.callback_metrics[key])
        if step == STEPS:
            from tensorboardX.summary import histogram

            for name, p in pl_module.named_parameters():  # what TensorBoardLogger's add_histogram writes
                h = histogram(name, p.detach(), 30).value[0].histo
                self.histograms[name] = [h.min, h.max, h.num, h.sum, h.sum_squares, *h.bucket]
            state = pl_module.state_dict()
            self.state_sq = float(sum(getattr(v, "full_tensor", lambda v=v: v)().double().pow(2).sum()
                                      for v in state.values()))
            # torch's DCP view of the module (torch.distributed.checkpoint.state_dict): its sharded form, each value
            # a DTensor (reduced over its mesh) or a plain tensor, and its full form, every tensor whole on every rank
            sharded = get_model_state_dict(pl_module)
            self.dcp_sq = float(sum(v.double().pow(2).sum() if not isinstance(v, DTensor)
                                    else v.double().pow(2).sum().full_tensor() for v in sharded.values()))
            full = get_model_state_dict(pl_module, options=StateDictOptions(full_state_dict=True))
            self.dcp_full_sq = float(sum(v.double().pow(2).sum() for v in full.values()))
            self.dcp_keys = sorted(full) if sorted(full) == sorted(sharded) else ["(sharded and full keys differ)"]


def fit_case(case: str, dp: int, mp: int, **strategy_kwargs: Any) -> dict[str, Any]:
    """Train the case's model for ``STEPS`` steps at ``dp x mp`` (one process: ``dp = mp = 1``, the sampler's
    permutation drawn as Lightning draws it for many) and return what its user code saw."""
    L.seed_everything(SEED, workers=True)
    # "acc": 2 accumulated micro-batches per step (the same global batch): before the last one user code reads each
    # rank's local accumulation, as DDP shows inside no_sync, at every zero level
    accumulate = 2 if case == "acc" else 1
    # "gpt": the watched model on GPT (tied table and head, LayerNorm weights and biases), which sequence
    # parallelism takes (the Llama's attention reads the sequence length inline)
    base, dataset = build("gpt" if case == "gpt" else "llama")
    global_batch = GLOBAL_BATCH // accumulate
    model = Watched(base.net)
    model.l2 = L2 if case == "l2" else 0.0
    model.clip = CLIP if case == "clip" else 0.0
    if case == "unused":  # a parameter nothing reaches: no gradient on one process, so AdamW never steps it
        base.net.register_parameter("unused", torch.nn.Parameter(torch.linspace(-1.0, 1.0, 6, dtype=torch.float32)))
    watch = Watch()
    kwargs: dict[str, Any] = dict(accelerator="cpu", precision="64-true", max_steps=STEPS, logger=False,
                                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                  callbacks=[watch], accumulate_grad_batches=accumulate)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PlanFallbackWarning)
        if dp * mp == 1:
            trainer = L.Trainer(devices=1, **kwargs)
            loader = reference_loader(dataset, global_batch, SEED)
        else:
            strategy = DPMPStrategy(dp=dp, mp=mp, timeout=timedelta(minutes=3), **strategy_kwargs)
            trainer = L.Trainer(devices=dp * mp * strategy_kwargs.get("pp", 1), strategy=strategy, **kwargs)
            loader = DataLoader(dataset, batch_size=global_batch // dp)
        trainer.fit(model, loader)
        plan = trainer.strategy.applied_plan.text if dp * mp > 1 else ""
    left = compat.current_function_mode()  # the strategy's modes are gone with its teardown
    weights = {}
    if trainer.global_rank == 0:  # consolidate_on_teardown="rank0": rank 0 holds the plain model
        weights = {k: v.double().reshape(-1).tolist() for k, v in model.state_dict().items()}
    return {
        "logged": watch.logged, "histograms": watch.histograms, "state_sq": watch.state_sq, "weights": weights,
        "no_grad": model.no_grad, "dcp_sq": watch.dcp_sq, "dcp_full_sq": watch.dcp_full_sq, "dcp_keys": watch.dcp_keys,
        "summary": watch.summary, "plan": plan, "micro_sq": model.micro_sq,
        "fallback": [str(w.message) for w in caught if issubclass(w.category, PlanFallbackWarning)],
        "mode_left": type(left).__name__ if left is not None else None,
        "in_optimizer": sorted(set(map(str, model.in_optimizer))),
        "schedule_wraps_step": hasattr(trainer.optimizers[0].step, "_wrapped_by_lr_sched"),
    }


if __name__ == "__main__":
    torch.set_num_threads(1)
    dp, mp, out, cases = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4].split(",")
    extra = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
    # a case may name its own strategy arguments: "l2:zero=3" (integers; sp=1: sequence_parallel=True)
    result = {}
    for spec in cases:
        case, _, opts = spec.partition(":")
        own: dict[str, Any] = {k: int(v) for k, v in (o.split("=") for o in opts.split(";") if o)}
        if "sp" in own:
            own["sequence_parallel"] = bool(own.pop("sp"))
        result[spec] = fit_case(case, dp, mp, **{**extra, **own})
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)
