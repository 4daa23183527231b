"""Training throughput of the example GPT under DPMPStrategy on one device type, for ``benchmarks/gpu_check.sh``.

Every rank may sit on the *same* device (``--ranks-per-device``): NCCL refuses two ranks on one GPU, so on a one-GPU
machine the multi-rank layouts run over gloo with CUDA tensors (each rank's ``parallel_devices`` entry is
``cuda:0``). Writes one JSON line of figures (``--out``)::

    python benchmarks/gpu_bench.py --layout 1x1 --device cuda --out r.json             # world size 1
    python benchmarks/gpu_bench.py --layout 1x2 --device cuda --backend gloo --out r.json   # 2 ranks, one GPU
    python benchmarks/gpu_bench.py --layout 1x1 --device cuda --compile --out r.json   # DPMPStrategy(compile=True)
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from examples.models.gpt import GPT  # noqa: E402
from lightning_dpmp import DPMPStrategy  # noqa: E402


def compile_supported() -> bool:
    """Whether this DPMPStrategy takes ``compile=`` (issue 16, part 1)."""
    return "compile" in inspect.signature(DPMPStrategy.__init__).parameters


class LM(L.LightningModule):
    def __init__(self, net: GPT) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Timer(L.Callback):
    def __init__(self, warmup: int) -> None:
        self.warmup, self.times, self.t0 = warmup, [], 0.0

    def _sync(self, trainer):
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)

    def on_train_batch_start(self, trainer, *args):
        self._sync(trainer)
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, *args):
        self._sync(trainer)
        if trainer.global_step > self.warmup:
            self.times.append(time.perf_counter() - self.t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layout", default="1x1", help="DPxMP, e.g. 1x2")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--backend", default=None, help="process group backend (gloo for several ranks on one GPU)")
    p.add_argument("--compile", action="store_true", help="DPMPStrategy(compile=True), where supported")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dp, mp = (int(v) for v in args.layout.split("x"))
    world = dp * mp
    torch.manual_seed(0)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    extra = {"compile": True} if args.compile else {}
    if args.compile and not compile_supported():
        raise SystemExit("DPMPStrategy has no compile= argument yet (issue 16, part 1)")
    # Every rank on the same device: one GPU cannot hold two NCCL ranks, gloo carries CUDA tensors instead.
    strategy = DPMPStrategy(dp=dp, mp=mp, parallel_devices=[device] * world, process_group_backend=args.backend,
                            timeout=timedelta(minutes=5), **extra)
    net = GPT(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.hidden)
    data = torch.randint(0, 256, (args.batch * dp * (args.steps + 2), args.seq + 1))
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=args.batch)
    timer = Timer(args.warmup)
    trainer = L.Trainer(accelerator="gpu" if args.device == "cuda" else "cpu", devices=1, strategy=strategy,
                        max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[timer])
    trainer.fit(LM(net), loader)
    if trainer.global_rank == 0:
        step = sorted(timer.times)[len(timer.times) // 2] if timer.times else float("nan")
        row = {"layout": args.layout, "device": args.device, "backend": args.backend or "default",
               "compile": args.compile, "world": world, "step_s": step,
               "tokens_per_s": args.batch * dp * args.seq / step if step == step else None,
               "peak_mem_mb": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
               "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else None}
        Path(args.out).write_text(json.dumps(row) + "\n")
        print(json.dumps(row))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
