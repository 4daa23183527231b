"""Where a rank's memory goes from the load to the end of the first training batch (issue 42 item 3; not a test).

transformers' Llama (16,384 vocabulary, hidden 256, 4 layers, GQA 8/4 heads, untied: 11.3 M parameters, 86.9 MB in
float64), saved locally with ``save_pretrained`` and fine-tuned with its own ``labels=`` loss under
``precision="64-true"``, global batch 8 x 16 tokens, AdamW, on 4 CPU processes, three ways in separate launches:

- ``lazy``: ``lightning_dpmp.from_pretrained`` (each rank reads only its slices; the plan is traced on the meta
  device, so nothing is verified densely), ``DPMPStrategy(dp=2, mp=2)``;
- ``naive``: transformers' ``from_pretrained`` on every rank, ``DPMPStrategy(dp=2, mp=2)`` (verification's dense
  step runs on the whole model);
- ``ddp``: transformers' ``from_pretrained``, Lightning's ``DDPStrategy`` at world 4 (the peer: every rank holds
  the whole model).

Per rank, the peak growth of private memory (``RssAnon``, sampled every 2 ms) in each phase, from the phase's
start (and over the whole first batch, from its start): the setup (model built, traced, split, read: up to
``on_fit_start``), the first batch's forward, backward and optimizer step; and the bytes of tensors the rank holds
after the step: its parameters, their gradients, AdamW's state, and the largest single tensor it computes (the
logits' shard). Within setup, ``lazy`` and ``naive`` also record the peak of each of its parts (the plan and its
dense step, the materialisation, the read).

Usage (from the repo root; ~3 minutes on 2 CPU cores, ~4 GB of RAM):
    python benchmarks/first_batch_memory.py [--out benchmarks/results/first_batch_memory]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from datetime import timedelta
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import lightning_dpmp  # noqa: E402
from benchmarks.checkpoint_bench import PeakMemory  # noqa: E402
from lightning_dpmp import DPMPStrategy  # noqa: E402
from lightning_dpmp.integration import firststep as firststep_mod  # noqa: E402
from lightning_dpmp.integration import split as split_mod  # noqa: E402
from tests.support.models import make_lm_dataset  # noqa: E402

MB = 2**20
VOCAB, HIDDEN, INTER, LAYERS, SEQ, GLOBAL_BATCH = 16384, 256, 688, 4, 16, 8
MODES = ("lazy", "naive", "ddp")
PHASES = ("setup", "forward", "backward", "optimizer")


class LabelsLM(L.LightningModule):
    """transformers' own ``labels=`` loss; records the largest tensor of the step (the logits)."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net, self.logits_mb = net, 0.0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, targets = batch
        out = self.net(input_ids=ids, labels=targets)
        logits = out.logits
        local = logits.local() if hasattr(logits, "local") else logits  # a vocab-parallel head's shard
        self.logits_mb = max(self.logits_mb, local.numel() * local.element_size() / MB)
        return out.loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


class Phases(L.Callback):
    """The peak growth of each phase of the first batch, and the tensors held after it."""

    def __init__(self, results: dict, setup: PeakMemory) -> None:
        self.results, self.probe, self.batch = results, setup, None

    def _next(self, name: str) -> None:
        self.results[name] = self.probe.stop()
        self.probe = PeakMemory().start()

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._next("setup")

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.probe.stop()
        self.probe, self.batch = PeakMemory().start(), PeakMemory().start()

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        self._next("forward")

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self._next("backward")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.results["optimizer"] = self.probe.stop()
        self.results["batch"] = self.batch.stop()
        params = list(pl_module.parameters())
        optimizer = trainer.optimizers[0]
        optimizer = getattr(optimizer, "optimizer", optimizer)
        state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        self.results["held"] = {
            "params_mb": sum(_local_bytes(p) for p in params) / MB,
            "grads_mb": sum(_local_bytes(p.grad) for p in params if p.grad is not None) / MB,
            "adam_mb": sum(_local_bytes(v) for v in state) / MB,
            "largest_param_mb": max(_local_bytes(p) for p in params) / MB,
            "logits_mb": pl_module.logits_mb,
        }


def _timed(name: str, parts: dict, fn: Callable) -> Callable:
    """``fn`` recording the peak growth of private memory while it runs into ``parts[name]``."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        probe = PeakMemory().start()
        try:
            return fn(*args, **kwargs)
        finally:
            parts[name] = probe.stop()["anon_mb"]

    return wrapper


def worker(mode: str, path: str, out: str) -> None:
    from transformers import LlamaForCausalLM

    torch.set_num_threads(1)
    results: dict = {"setup_parts": {}}
    parts = results["setup_parts"]
    for name in ("plan_module", "materialize", "load_deferred"):  # the parts of the split
        setattr(split_mod, name, _timed(name, parts, getattr(split_mod, name)))
    # (read once per setup by the record of the first step, which the split uses)
    firststep_mod.first_batch = _timed("first_batch", parts, firststep_mod.first_batch)
    if mode == "ddp":
        strategy: Any = DDPStrategy(timeout=timedelta(minutes=30))
    else:
        strategy = DPMPStrategy(dp=2, mp=2, timeout=timedelta(minutes=30))
    setup = PeakMemory().start()
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, precision="64-true", max_steps=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Phases(results, setup)])
    load = lightning_dpmp.from_pretrained if mode == "lazy" else LlamaForCausalLM.from_pretrained
    net = load(LlamaForCausalLM, path) if mode == "lazy" else load(path)
    model = LabelsLM(net)
    dp = 4 if mode == "ddp" else 2
    trainer.fit(model, DataLoader(make_lm_dataset(n=64, vocab=VOCAB, seq=SEQ), batch_size=GLOBAL_BATCH // dp))
    with open(os.path.join(out, f"{mode}_rank{dist.get_rank()}.json"), "w") as f:
        json.dump(results, f)


def _row(mode: str, r: int, res: dict) -> str:
    held = res["held"]
    phases = " | ".join(f"{res[p]['anon_mb']:.0f}" for p in PHASES)
    first = res["batch"]["anon_mb"]
    state = held["grads_mb"] + held["adam_mb"]
    return (f"| {mode} | {r} | {phases} | {first:.0f} | {held['params_mb']:.1f} | {held['grads_mb']:.1f} |"
            f" {held['adam_mb']:.1f} | {first - state:.0f} | {held['largest_param_mb']:.1f} |"
            f" {held['logits_mb']:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/first_batch_memory")
    parser.add_argument("--mode", choices=MODES)  # internal: one launch
    parser.add_argument("--path")
    args = parser.parse_args()
    if args.mode:
        worker(args.mode, args.path, args.out)
        return
    from transformers import LlamaConfig, LlamaForCausalLM

    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "llama")
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                          num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=SEQ,
                          tie_word_embeddings=False, dtype="float64")
        net = LlamaForCausalLM(cfg).double()
        n_params = sum(p.numel() for p in net.parameters())
        net.save_pretrained(path)
        del net
        for mode in MODES:
            env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
            subprocess.run([sys.executable, __file__, "--mode", mode, "--path", path, "--out", args.out],
                           check=True, env=env)
    rows = [f"Llama {n_params / 1e6:.1f}M parameters ({n_params * 8 / MB:.1f} MB float64), labels= loss, "
            f"global batch {GLOBAL_BATCH} x {SEQ}, AdamW, 4 CPU ranks; peak growth of private memory per phase (MB)"
            " and tensors held after the first step (MB)",
            "| mode | rank | setup | forward | backward | optimizer | first batch | params | grads | AdamW |"
            " first batch - grads - AdamW | largest param | logits |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    summary: dict = {"parameters": n_params, "modes": {}}
    for mode in MODES:
        for r in range(4):
            with open(os.path.join(args.out, f"{mode}_rank{r}.json")) as f:
                res = json.load(f)
            summary["modes"].setdefault(mode, []).append(res)
            rows.append(_row(mode, r, res))
    rows.append("")
    rows.append("Setup's parts, peak growth of private memory (MB), rank 0: " + "; ".join(
        f"{mode}: " + ", ".join(f"{k} {v:.0f}" for k, v in summary["modes"][mode][0]["setup_parts"].items())
        for mode in MODES if summary["modes"][mode][0]["setup_parts"]))
    text = "\n".join(rows)
    print(text)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(summary, f, indent=1)
    for name in os.listdir(args.out):
        if "_rank" in name:
            os.remove(os.path.join(args.out, name))


if __name__ == "__main__":
    main()
