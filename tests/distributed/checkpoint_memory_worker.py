"""Checkpoint memory at zero=3 (issue 22 item 3), for tests/distributed/test_checkpoint_memory.py.

Usage: python tests/distributed/checkpoint_memory_worker.py OUT_DIR    (4 processes: dp=2 x mp=2, zero=3)

Trains a 16-layer GPT (width 256, float64; 12.6 M parameters, AdamW; with a 0-d logit scale) for 2 steps, then
in ``on_train_end``, while every rank holds only its shards, saves a consolidated file and a sharded folder and
loads each back (``load_checkpoint`` + ``load_model_state_dict`` + ``load_optimizer_state_dict``). Around each, the
kernel's peak RSS mark (``VmHWM``) is reset (``/proc/self/clear_refs``), so ``peak - before`` is the most the call
held at once (with glibc's mmap threshold fixed, so that RSS follows live memory: see the end of this file). Each
rank writes ``rank<r>.json``: those deltas, the bytes it holds (parameter and optimizer-state shards), its largest
bucket (one unit's MP-local copy of one flat tensor), its largest dense tensor, what gathering the model and
optimizer state whole would take, and whether each load gave back exactly the shards it saved; rank 0 also whether
a save through another ``CheckpointIO`` (every held tensor fetched first) wrote the same tensors; and the
collectives one more save of each format issues, by group.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.fabric.plugins import TorchCheckpointIO  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from examples.models.gpt import GPT  # noqa: E402
from lightning_dpmp import CommCounter, DPMPStrategy  # noqa: E402
from lightning_dpmp.parallel.sharding import shard_dims  # noqa: E402
from tests.support.models import LMModule, make_lm_dataset  # noqa: E402

DP, MP, VOCAB, SEQ = 2, 2, 512, 16


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def peak_during(fn) -> tuple[int, int]:
    """``(peak RSS, peak anonymous RSS)`` above their values at the start that ``fn()`` reached: the kernel's
    high-water mark (reset first), and the anonymous part sampled every millisecond (a memory-mapped checkpoint's
    pages are file-backed: they count in RSS while mapped, yet the kernel can drop them at any time)."""
    dist.barrier()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        hwm = True
    except OSError:  # (a kernel or container that refuses it: the sampled RSS stands in for the mark)
        hwm = False
    before, anon0 = _status("VmRSS"), _status("RssAnon")
    top, done = [anon0, before], threading.Event()

    def sample() -> None:
        while not done.wait(0.001):
            top[0], top[1] = max(top[0], _status("RssAnon")), max(top[1], _status("VmRSS"))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        fn()
    finally:
        done.set()
        sampler.join()
    peak = (_status("VmHWM") if hwm else max(top[1], _status("VmRSS"))) - before
    dist.barrier()
    return peak, max(top[0], _status("RssAnon")) - anon0


def shards(engine) -> list[torch.Tensor]:
    """Copies of everything this rank holds: parameter shards and optimizer-state shards, in a fixed order."""
    out = [b.shard.detach().clone() for b in engine.buckets]
    for opt in engine.optimizers:
        for b in engine.buckets:
            for _, v in sorted(opt.state.get(b.shard, {}).items()):
                out.append(v.detach().clone())
    return out


def same_tensors(a: dict, b: dict) -> bool:
    """The same keys (in any order: a load rebuilds AdamW's state in another order) and equal tensors."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)


class PlainIO(TorchCheckpointIO):
    """torch.save through Lightning's own plugin, as a user's CheckpointIO subclass would."""


class Measure(L.Callback):
    def __init__(self, out: str) -> None:
        self.out = out
        self.res: dict = {}

    def on_train_end(self, trainer, pl_module):
        st = trainer.strategy
        engine = st.zero_engine
        elem = 8
        states = sum(v.numel() * v.element_size() for o in engine.optimizers for s in o.state.values()
                     for v in s.values() if torch.is_tensor(v) and v.dim())
        held = sum(b.shard.numel() * elem for b in engine.buckets) + states
        n_states = 2  # AdamW: exp_avg, exp_avg_sq
        self.res.update(
            held=held,
            unit=max(b.layout.total for b in engine.buckets) * elem,
            dense_max=max(p.numel() for p in pl_module.parameters()) * elem * MP,
            whole=sum(b.layout.total for b in engine.buckets) * elem * (1 + n_states),
        )
        saved = shards(engine)
        for fmt, sharded in (("consolidated", False), ("sharded", True)):
            path = os.path.join(self.out, f"{fmt}.ckpt")
            st.checkpointer.distributed = sharded
            self.res[f"save_{fmt}"] = peak_during(lambda path=path: trainer.save_checkpoint(path))

            def load(path=path):
                ckpt = st.load_checkpoint(path)
                st.load_model_state_dict(ckpt)
                st.load_optimizer_state_dict(ckpt)

            with torch.no_grad():  # something else in the shards first: the load must overwrite all of it
                for p in pl_module.parameters():
                    for _, _, view in engine.param_pieces(p) or []:
                        view.add_(1.0)
                    for key in ("exp_avg", "exp_avg_sq"):
                        for _, _, view in engine.state_pieces(0, p, key) or []:
                            view.add_(1.0)
            self.res[f"load_{fmt}"] = peak_during(load)
            self.res[f"roundtrip_{fmt}"] = all(torch.equal(a, b) for a, b in zip(saved, shards(engine)))
        # the collectives of a save: a consolidated one gathers each bucket over DP once per flat tensor (parameters,
        # then each AdamW moment), a sharded one never gathers over DP
        self.res["expected_dp_gathers"] = len(engine.buckets) + sum(
            1 for o in engine.optimizers for b in engine.buckets for v in o.state.get(b.shard, {}).values()
            if torch.is_tensor(v) and v.shape == b.shard.shape)
        # and gathers each MP-split tensor onto MP rank 0 once: the parameter and its two AdamW moments
        self.res["expected_mp_gathers"] = 3 * len(shard_dims(pl_module))
        for fmt, sharded in (("consolidated", False), ("sharded", True)):
            st.checkpointer.distributed = sharded
            counter = CommCounter({"dp": st.grid.dp_group, "mp": st.grid.mp_group})
            with counter:
                trainer.save_checkpoint(os.path.join(self.out, f"counted_{fmt}.ckpt"))
            self.res[f"counts_{fmt}"] = {f"{g}/{op}": n for (g, op), n in counter.counts.items()}
        st.checkpointer.distributed = False
        # another CheckpointIO needs the whole checkpoint in memory: every held tensor fetched first, same contents
        io_path = os.path.join(self.out, "io.ckpt")
        st.checkpoint_io, before = PlainIO(), st.checkpoint_io
        trainer.save_checkpoint(io_path)
        st.checkpoint_io = before
        if trainer.is_global_zero:
            a, b = (torch.load(p, weights_only=True) for p in (io_path, os.path.join(self.out, "consolidated.ckpt")))
            self.res["io_equal"] = same_tensors(a["state_dict"], b["state_dict"]) and all(
                same_tensors(sa["state"][i], sb["state"][i])
                for sa, sb in zip(a["optimizer_states"], b["optimizer_states"]) for i in sa["state"])


class ScaledLM(LMModule):
    """The GPT with a learnable 0-d logit scale: its AdamW moments are 0-d like its ``step``, which the checkpoint
    must still tell apart (moments into the flat shards, the step once per bucket)."""

    def __init__(self, net) -> None:
        super().__init__(net)
        self.scale = torch.nn.Parameter(torch.tensor(1.0))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.net(ids) * self.scale


def main(out: str) -> dict:
    L.seed_everything(0, workers=True)
    net = GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=16, n_head=8, n_embd=256, dropout=0.0, tie_embeddings=True)
    measure = Measure(out)
    trainer = L.Trainer(
        accelerator="cpu", devices=DP * MP, precision="64-true", max_steps=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[measure],
        strategy=DPMPStrategy(dp=DP, mp=MP, zero=3, timeout=timedelta(minutes=3)),
    )
    trainer.fit(ScaledLM(net), DataLoader(make_lm_dataset(n=16, vocab=VOCAB, seq=SEQ), batch_size=4 // DP))
    return measure.res


if __name__ == "__main__":
    torch.set_num_threads(1)
    # RSS as live memory: glibc raises its mmap threshold to the size of each large block freed, after which such
    # blocks come from the heap and stay in the process when freed (malloc_trim hands them back). A fixed threshold
    # returns every block of 128 KiB or more to the kernel when it is freed (M_MMAP_THRESHOLD is -3).
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 17)
    except OSError:
        pass  # not glibc: its allocator's own policy applies
    out = sys.argv[1]
    results = main(out)
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(results, f, indent=1)
