"""One launch per layout for the speed features: ``compile=True`` against eager (float32, graph breaks counted),
``compile=True`` trained in float64 for the pytest side to compare with single-process training (transformers
Llamas, the cases of ``EXACT_CASES``, their dense weights saved), ``async_grad_allreduce=True`` against the
synchronous path (float64, with gradient accumulation), and the tensor collectives against the list ones (bitwise).

Usage (from the repo root): python tests/distributed/compile_worker.py DP MP OUT_DIR [MODEL,MODEL,...]
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_dpmp import DPMPStrategy  # noqa: E402
from lightning_dpmp.parallel import comm  # noqa: E402
from lightning_dpmp.parallel.compiled import repeated_blocks  # noqa: E402
from lightning_dpmp.parallel.layers import ColumnParallelLinear  # noqa: E402
from tests.support.models import build  # noqa: E402
from tests.support.real_models import COMPILE_LLAMAS, build_llama  # noqa: E402

GLOBAL_BATCH, SEED, EXACT_STEPS = 8, 0, 10

# (model, strategy flags) trained compiled in float64 at each layout: Llamas of COMPILE_LLAMAS, and the project's GPT
# for sequence parallelism (the planner refuses it on CausalLM, whose loss slices the logits along the sequence).
# The stock Llama computes its RMSNorm in float32 (its blocks take the aot_eager path); the others are float64
# throughout (Inductor). The wide one at dp=2 has its compiled block graphs split at DDP bucket boundaries unless
# compile_blocks prevents it.
EXACT_CASES: dict[tuple[int, int], list[tuple[str, dict]]] = {
    (1, 2): [("llama", {}), ("gpt", {"sequence_parallel": True})],
    (2, 2): [("llama_wide_norm64", {}), ("llama", {"zero": 3}), ("gpt", {"sequence_parallel": True})],
    (1, 4): [("llama", {}), ("gpt", {"sequence_parallel": True})],
}


def case_name(model: str, flags: dict) -> str:
    """``llama``, ``llama_norm64-sequence_parallel``, ``llama-zero3``: the key of a case's results and weights."""
    parts = [model] + [k if v is True else f"{k}{v}" for k, v in sorted(flags.items())]
    return "-".join(parts)


class CountOverlapped(L.Callback):
    """How many column layers of the split model overlap their input-gradient all-reduce."""

    def __init__(self) -> None:
        self.overlapped = 0
        self.vocab_split = False

    def on_train_start(self, trainer, pl_module):
        self.overlapped = sum(int(getattr(m, "overlaps_input_grad", False)) for m in pl_module.modules())
        self.vocab_split = any(isinstance(m, ColumnParallelLinear) and m.vocab_logits for m in pl_module.modules())


def fit(dp: int, mp: int, name: str, precision: str, steps: int, accumulate: int = 1, **flags) -> dict:
    L.seed_everything(SEED, workers=True)
    model, dataset = build_llama(name) if name in COMPILE_LLAMAS else build(name)
    strategy = DPMPStrategy(dp=dp, mp=mp, timeout=timedelta(minutes=5), verify_plan=False, consolidate_on_teardown=True,
                            **flags)
    probe = CountOverlapped()
    trainer = L.Trainer(
        accelerator="cpu", devices=dp * mp, strategy=strategy, precision=precision, max_steps=steps,
        accumulate_grad_batches=accumulate, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[probe],
    )
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, DataLoader(dataset, batch_size=GLOBAL_BATCH // dp))
    counters = torch._dynamo.utils.counters
    return {
        "seconds": time.perf_counter() - start,
        "aot_eager_warnings": sum("'aot_eager' backend instead" in str(w.message) for w in caught),
        "vocab_split": probe.vocab_split,
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},  # dense again after teardown
        "graph_breaks": dict(counters["graph_break"]),
        "unique_graphs": int(counters["stats"]["unique_graphs"]),
        "blocks": len(repeated_blocks(model)),
        "overlapped": probe.overlapped,
    }


def worst(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def collectives(group) -> dict:
    """Tensor collectives vs list collectives on the same inputs, along every dim: gathers bitwise equal (and
    contiguous); reduce-scatters bitwise equal on 2 ranks, and the largest difference to the float64 sum of each."""
    n, rank = comm.group_size(group), dist.get_rank()
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(4 * n, 6 * n, 2 * n, generator=gen, dtype=torch.float32)
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x, group=group)
    out: dict = {"size": n, "supported_cpu_gloo": comm.tensor_collectives_supported(group, torch.device("cpu"))}
    for d in (0, 1, 2, -1):
        g_t, g_l = comm._gather(x, d, group, tensor_api=True), comm._gather(x, d, group, tensor_api=False)
        r_t, r_l = comm._reduce_scatter(x, d, group, True), comm._reduce_scatter(x, d, group, False)
        exact = torch.stack(parts).double().sum(0).chunk(n, d)[comm.group_rank(group)]
        out[f"gather_dim{d}"] = bool(torch.equal(g_t, g_l)) and g_t.is_contiguous()
        out[f"reduce_scatter_dim{d}"] = bool(torch.equal(r_t, r_l)) and r_t.is_contiguous()
        out[f"reduce_scatter_dim{d}_err"] = max((r - exact).abs().max().item() for r in (r_t.double(), r_l.double()))
    return out


def main() -> None:
    torch.set_num_threads(1)
    dp, mp, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    names = sys.argv[4].split(",") if len(sys.argv) > 4 else ["gpt"]
    results: dict = {}
    for name in names:
        eager = fit(dp, mp, name, "32-true", steps=4)
        compiled = fit(dp, mp, name, "32-true", steps=4, compile=True)
        results[name] = {
            "compiled_vs_eager": worst(compiled["state"], eager["state"]),
            "graph_breaks": compiled["graph_breaks"], "unique_graphs": compiled["unique_graphs"],
            "blocks": compiled["blocks"],
        }
    for model, flags in EXACT_CASES[dp, mp]:  # compiled, float64: weights for the single-process comparison
        key = case_name(model, flags)
        r = fit(dp, mp, model, "64-true", steps=EXACT_STEPS, compile=True, **flags)
        if dist.get_rank() == 0:
            torch.save(r["state"], os.path.join(out, f"{key}.pt"))
        results[key] = {k: r[k] for k in ("graph_breaks", "blocks", "vocab_split", "aot_eager_warnings", "seconds")}
    if dp > 1:  # ZeRO-3's gather/free hooks run eagerly around the compiled blocks
        zero3 = fit(dp, mp, "gpt", "32-true", steps=4, compile=True, zero=3)
        results["zero3_compiled_vs_eager"] = worst(zero3["state"], fit(dp, mp, "gpt", "32-true", steps=4)["state"])
        results["zero3_graph_breaks"] = zero3["graph_breaks"]
    sync = fit(dp, mp, "gpt", "64-true", steps=6, accumulate=2, async_grad_allreduce=False)
    overlapped = fit(dp, mp, "gpt", "64-true", steps=6, accumulate=2, async_grad_allreduce=True)
    L.seed_everything(SEED)
    results["async_vs_sync_float64"] = worst(overlapped["state"], sync["state"])
    results["overlapped_layers"] = [sync["overlapped"], overlapped["overlapped"]]
    results["moved"] = worst(sync["state"], build("gpt")[0].double().state_dict())
    mp_groups = [dist.new_group(list(range(d * mp, (d + 1) * mp))) for d in range(dp)]  # every rank builds each
    results["collectives_mp"] = collectives(mp_groups[dist.get_rank() // mp])
    results["collectives_world"] = collectives(None)
    rank = dist.get_rank()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
