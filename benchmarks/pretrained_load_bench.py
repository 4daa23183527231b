"""Memory per rank while loading a pretrained Hugging Face checkpoint and at the end of fit (not a timed test).

A Llama of ~82M parameters (float32, ~330 MB of safetensors, saved locally, no download) fine-tuned for one step at
(dp, mp) = (2, 2) on 4 CPU processes, three ways in separate launches, side by side:

- ``naive``: transformers' ``from_pretrained`` in the LightningModule's constructor on every rank (what users do
  today), ``consolidate_on_teardown=True`` (every rank gathers the model at the end);
- ``lazy_all``: ``lightning_dpmp.from_pretrained`` (each rank reads only its slices), ``consolidate_on_teardown=True``;
- ``lazy_rank0``: ``lightning_dpmp.from_pretrained`` and the default ``consolidate_on_teardown="rank0"``.

For each rank it reports the peak growth of private memory (``anon``) and of the resident set (``rss``, which adds
file pages mapped in), from just before the model is built to the start of training (the load: build, split,
read) and from the end of training to after ``fit`` returns (the teardown), next to the rank's own share.

Usage (from the repo root; ~3 minutes on 2 CPU cores, ~7 GB of RAM):
    python benchmarks/pretrained_load_bench.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import lightning_dpmp  # noqa: E402
from benchmarks.checkpoint_bench import PeakMemory  # noqa: E402
from lightning_dpmp import DPMPStrategy  # noqa: E402
from tests.support.models import make_lm_dataset  # noqa: E402
from tests.support.real_models import CausalLM  # noqa: E402

MB = 2**20
VOCAB, SEQ = 32000, 16
MODES = ("naive", "lazy_all", "lazy_rank0")


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=640, intermediate_size=1792, num_hidden_layers=8,
                       num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=SEQ,
                       tie_word_embeddings=False)


class Probe(L.Callback):
    def __init__(self, load: PeakMemory, results: dict) -> None:
        self.load, self.results, self.teardown = load, results, None

    def on_fit_start(self, trainer, pl_module):
        self.results["load"] = self.load.stop()
        self.results["own_share_mb"] = sum(t.numel() * t.element_size() for t in pl_module.state_dict().values()) / MB

    def on_train_end(self, trainer, pl_module):
        self.teardown = PeakMemory().start()


def worker(mode: str, path: str, out: str) -> None:
    from transformers import LlamaForCausalLM

    torch.set_num_threads(1)
    results: dict = {}
    strategy = DPMPStrategy(dp=2, mp=2, verify_plan=False, timeout=timedelta(minutes=30),
                            consolidate_on_teardown="rank0" if mode == "lazy_rank0" else True)
    load = PeakMemory().start()
    probe = Probe(load, results)
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[probe])
    if mode == "naive":
        net = LlamaForCausalLM.from_pretrained(path)
    else:
        net = lightning_dpmp.from_pretrained(LlamaForCausalLM, path)
    model = CausalLM(net, vocab=VOCAB)
    trainer.fit(model, DataLoader(make_lm_dataset(n=16, vocab=VOCAB, seq=SEQ), batch_size=2))
    results["teardown"] = probe.teardown.stop()
    with open(os.path.join(out, f"{mode}_rank{dist.get_rank()}.json"), "w") as f:
        json.dump(results, f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/pretrained_load")
    parser.add_argument("--mode", choices=MODES)  # internal: one launch
    parser.add_argument("--path")
    args = parser.parse_args()
    if args.mode:
        worker(args.mode, args.path, args.out)
        return
    from transformers import LlamaForCausalLM

    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "llama")
        torch.manual_seed(0)
        net = LlamaForCausalLM(_config())
        n_params = sum(p.numel() for p in net.parameters())
        net.save_pretrained(path)
        del net
        file_mb = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)) / MB
        for mode in MODES:
            env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
            subprocess.run([sys.executable, __file__, "--mode", mode, "--path", path, "--out", args.out],
                           check=True, env=env)
    rows = [f"Llama {n_params / 1e6:.1f}M parameters, {file_mb:.0f} MB of safetensors; (dp, mp) = (2, 2), 4 CPU ranks",
            "| mode | rank | own share MB | load: anon MB | load: rss MB | teardown: anon MB | teardown: rss MB |",
            "|---|---|---|---|---|---|---|"]
    summary: dict = {"parameters": n_params, "file_mb": file_mb, "modes": {}}
    for mode in MODES:
        for r in range(4):
            with open(os.path.join(args.out, f"{mode}_rank{r}.json")) as f:
                res = json.load(f)
            summary["modes"].setdefault(mode, []).append(res)
            rows.append(f"| {mode} | {r} | {res['own_share_mb']:.0f} | {res['load']['anon_mb']:.0f} |"
                        f" {res['load']['rss_mb']:.0f} | {res['teardown']['anon_mb']:.0f} |"
                        f" {res['teardown']['rss_mb']:.0f} |")
    text = "\n".join(rows)
    print(text)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
