"""Checkpoint save/load time and memory per rank: consolidated file vs sharded folder (not a timed test).

One Lightning launch at (dp, mp) = (1, 4) by default, a ~103M-parameter residual MLP (float32, AdamW: weights plus
two moments, ~1.2 GB of state in all). After one training step, ``on_train_end`` (layers still sharded) saves the
state both ways; two more fits resume from each. For every rank it reports wall time and the peak growth of the
process's memory during the operation: ``anon`` is private memory (what the rank itself allocated: gathered
tensors, shards read back), ``rss`` adds file pages mapped in (a memory-mapped checkpoint counts here, shared and
reclaimable). "own share" is the rank's model + optimizer shard bytes; "full" the dense state's.

Usage (from the repo root; ~2-4 minutes on 2 CPU cores, ~6 GB of RAM):
    python benchmarks/checkpoint_bench.py [--dp 1] [--mp 4] [--width 2048] [--hidden 8192] [--blocks 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Iterator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_dpmp import DPMPStrategy  # noqa: E402
from tests.support.models import ResMLP  # noqa: E402

MB = 2**20


def _mem() -> dict[str, int]:
    """RssAnon and VmRSS of this process, in bytes (Linux /proc)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "VmRSS:")):
                key, value = line.split(":")
                out["anon" if key == "RssAnon" else "rss"] = int(value.split()[0]) * 1024
    return out


class PeakMemory:
    """Samples this process's memory every ``period`` seconds between ``start()`` and ``stop()``."""

    def __init__(self, period: float = 0.002) -> None:
        self.period, self.base, self.peak = period, _mem(), _mem()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            now = _mem()
            self.peak = {k: max(self.peak[k], now[k]) for k in now}
            time.sleep(self.period)

    def start(self) -> "PeakMemory":
        self.base = self.peak = _mem()
        self._thread.start()
        return self

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        now = _mem()
        self.peak = {k: max(self.peak[k], now[k]) for k in now}
        return {f"{k}_mb": (self.peak[k] - self.base[k]) / MB for k in self.base}


@contextmanager
def measure(results: dict[str, Any], name: str) -> Iterator[None]:
    probe = PeakMemory().start()
    t0 = time.perf_counter()
    yield
    results[name] = {"seconds": time.perf_counter() - t0, **probe.stop()}


class InstrumentedStrategy(DPMPStrategy):
    """Times the restore: from ``load_checkpoint`` to the end of ``load_optimizer_state_dict``."""

    results: dict[str, Any]
    tag = ""

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Any = None) -> dict[str, Any]:
        self._probe, self._t0 = PeakMemory().start(), time.perf_counter()
        return super().load_checkpoint(checkpoint_path, weights_only)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        super().load_optimizer_state_dict(checkpoint)
        self.results[f"load_{self.tag}"] = {"seconds": time.perf_counter() - self._t0, **self._probe.stop()}


class SaveBoth(L.Callback):
    def __init__(self, folder: str, results: dict[str, Any]) -> None:
        self.folder, self.results = folder, results

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        local = sum(t.numel() * t.element_size() for t in pl_module.state_dict().values())
        opt = trainer.optimizers[0]
        local += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
        self.results["own_share_mb"] = local / MB
        for sharded, name in ((False, "consolidated"), (True, "sharded")):
            strategy.checkpointer.distributed = sharded
            dist.barrier()
            with measure(self.results, f"save_{name}"):
                trainer.save_checkpoint(os.path.join(self.folder, f"{name}.ckpt"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--mp", type=int, default=4)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--out", default=None, help="folder for the checkpoints (default: a temporary one)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    folder = args.out or os.environ.get("DPMP_BENCH_DIR") or tempfile.mkdtemp(prefix="dpmp_ckpt_bench_")
    os.environ["DPMP_BENCH_DIR"] = folder  # the launched ranks write into the same folder
    d_in = 1024
    data = TensorDataset(torch.randn(64, d_in), torch.randint(0, 3, (64,)))
    results: dict[str, Any] = {}

    def trainer(steps: int, callbacks: list, tag: str = "") -> L.Trainer:
        strategy = InstrumentedStrategy(
            dp=args.dp, mp=args.mp, verify_plan=False, consolidate_on_teardown=False, timeout=timedelta(minutes=30)
        )
        strategy.results, strategy.tag = results, tag
        return L.Trainer(accelerator="cpu", devices=args.dp * args.mp, strategy=strategy, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=callbacks)

    def model() -> ResMLP:
        return ResMLP(d_in=d_in, width=args.width, hidden=args.hidden, n_blocks=args.blocks, lr=1e-4)

    L.seed_everything(0)
    m = model()
    n_params = sum(p.numel() for p in m.parameters())
    trainer(1, [SaveBoth(folder, results)]).fit(m, DataLoader(data, batch_size=2))
    for name in ("consolidated", "sharded"):
        ckpt_path = os.path.join(folder, f"{name}.ckpt")
        trainer(1, [], tag=name).fit(model(), DataLoader(data, batch_size=2), ckpt_path=ckpt_path)
    rank = dist.get_rank()
    results["rank"] = rank
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if rank == 0:
        full = n_params * 4 * 3 / MB  # float32 weights + AdamW exp_avg + exp_avg_sq
        print(f"\ncheckpoint benchmark: {n_params / 1e6:.1f}M parameters, dp={args.dp} x mp={args.mp}, full state"
              f" {full:.0f} MB (weights + 2 AdamW moments, float32); CPU/gloo, {torch.get_num_threads()} thread/rank")
        print(f"{'rank':>4} {'own share MB':>12} | {'operation':<18} {'seconds':>8} {'peak +anon MB':>14}"
              f" {'peak +rss MB':>13}")
        for r in gathered:
            for op in ("save_consolidated", "save_sharded", "load_consolidated", "load_sharded"):
                x = r[op]
                print(f"{r['rank']:>4} {r['own_share_mb']:>12.0f} | {op:<18} {x['seconds']:>8.2f}"
                      f" {x['anon_mb']:>14.0f} {x['rss_mb']:>13.0f}")
        sizes = {n: sum(os.path.getsize(os.path.join(dp_, f))
                        for dp_, _, fs in os.walk(os.path.join(folder, f"{n}.ckpt")) for f in fs)
                 if os.path.isdir(os.path.join(folder, f"{n}.ckpt"))
                 else os.path.getsize(os.path.join(folder, f"{n}.ckpt")) for n in ("consolidated", "sharded")}
        print("on disk: " + ", ".join(f"{n} {s / MB:.0f} MB" for n, s in sizes.items()))
        with open(os.path.join(folder, "results.json"), "w") as f:
            summary = {"n_params": n_params, "dp": args.dp, "mp": args.mp, "full_mb": full, "ranks": gathered,
                       "disk": sizes}
            json.dump(summary, f, indent=1)
        if args.out is None:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
