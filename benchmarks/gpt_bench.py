"""GPT training throughput, memory and communication: DPMPStrategy vs Lightning's ModelParallelStrategy vs DDP.

One command runs every layout, interleaved round by round (A B C ... A B C ...), so that a machine whose speed
drifts slows all layouts alike, and writes a markdown table, a CSV, a JSON of every measurement and a PNG::

    python benchmarks/gpt_bench.py                       # default sweep, 2 rounds, ~6 min on 2 CPU cores
    python benchmarks/gpt_bench.py --configs dpmp_2x2,mps_2x2 --rounds 3 --steps 14
    python benchmarks/gpt_bench.py --configs dpmp_2x2,dpmp_2x2_async,dpmp_2x2_compiled

Each layout is one ``Trainer.fit`` in a fresh process group of ``--world`` CPU processes (gloo), same GPT, same
global batch, AdamW, no gradient clipping (ModelParallelStrategy cannot clip by norm), no logger. Per step:

* step time: time between successive ``on_train_batch_start`` on rank 0 (forward, backward, DP and MP
  communication, optimizer); the median over steps after ``--warmup``; tokens/s = global batch tokens / that.
* per-rank parameter, gradient and optimizer-state bytes (local shards; DTensors counted by their local part);
  peak RSS of every rank (``ru_maxrss``, mostly the Python runtime). Memory of the tensors, measured on the second of
  two extra, untimed steps: *held* = parameters + gradients + optimizer state (+ DDP's gradient buckets, added as one
  more gradient's bytes where DDP wraps the model) when the step ends; *peak* = what was held when the step began
  plus the highest running total of allocations minus frees during it (``torch.profiler`` memory events:
  activations, gathered parameters, communication buffers, the optimizer's temporaries). The profiler starts with
  the first extra step, so that the frees of the last step's gradients are among its events (it reports none for a
  block allocated before it started).
* MP and DP bytes per step: the collectives that second extra (untimed) step issues from Python/autograd, by group,
  sized as the full tensor of the collective (all-reduce: the tensor; all-gather: the output; reduce-scatter: the
  input). DDP's C++ reducer is invisible there: where DDP wraps the model (mp = 1, zero=0, no pipeline) its bucket
  all-reduces are not counted (the DP columns read 0); the strategy's own flat all-reduce elsewhere is.

Configs: ``dpmp_<dp>x<mp>`` (DPMPStrategy, eager, ``async_grad_allreduce=False``), ``..._sp`` (sequence
parallel), ``..._async`` (``async_grad_allreduce=True``: the input-gradient all-reduce overlapped with the
weight-gradient matmul), ``..._compiled`` (``compile=True``: each transformer block ``torch.compile``d after the
split), ``..._zero<k>`` (``zero=k``: 1 and 2 optimizer state and gradients, 3 + parameters sharded over
DP; ``..._zero3_noreshard``: ``reshard_after_forward=False``, FSDP2's trade),
``..._zero<k>_fsdp2`` (the same sharding over DP done by torch's FSDP2 ``fully_shard`` per repeated block and
root instead of our ZeRO engine: issue 22's side-by-side), ``mps_<dp>x<mp>`` (ModelParallelStrategy:
ColwiseParallel q/k/v/fc1, RowwiseParallel out_proj/fc2, FSDP2 ``fully_shard`` over the data-parallel axis),
``ddp_<n>`` (DDPStrategy), ``dpmp_<dp>x<mp>_pp<k>[_gpipe|_interleaved]`` (DPMPStrategy(pp=k): pipeline stages,
``--pp-microbatches`` per step, 1F1B by default; ``_interleaved`` runs 2 stages per rank). Pipeline layouts also
report each rank's held bytes (the stages differ) and the schedule's bubble fraction. ``..._plainparams`` keeps the
split parameters as plain shards (DDP at zero=0), as before DTensor parameters (issue 41's side-by-side).
``..._ac`` adds ``activation_checkpointing="blocks"`` (every block recomputed in the backward); the report then puts
each ``X_ac`` beside ``X``: measured peak and step time as ratios, and the layout estimator's predicted peak of both
(issue 44 item 4)::

    python benchmarks/gpt_bench.py --model hf_llama --rounds 2 --out benchmarks/results/recompute \
        --configs dpmp_2x2,dpmp_2x2_ac,dpmp_1x2_pp2,dpmp_1x2_pp2_ac

Earlier side-by-sides::

    python benchmarks/gpt_bench.py --model hf_llama --rounds 3 --out benchmarks/results/dtensor_params \
        --configs dpmp_2x2,dpmp_2x2_plainparams,dpmp_2x2_zero3,dpmp_4x1_zero3

The pipeline side-by-side (issue 26): the 8-layer Llama at world 4::

    python benchmarks/gpt_bench.py --model hf_llama --layers 8 --rounds 3 \
        --configs dpmp_1x2_pp2,dpmp_1x4,dpmp_2x2,dpmp_4x1 --out benchmarks/results/pipeline

and ZeRO under the pipeline, (dp, pp, mp) = (2, 2, 1) at zero 0, 1, 3 beside (4, 1, 1) at zero 3 and 0::

    python benchmarks/gpt_bench.py --model hf_llama --layers 8 --rounds 3 --out benchmarks/results/pipeline_zero \
        --configs dpmp_2x1_pp2,dpmp_2x1_pp2_zero1,dpmp_2x1_pp2_zero3,dpmp_4x1_zero3,dpmp_4x1

and zero=3's ``reshard_after_forward`` both ways, under the pipeline and without it (issue 42 item 5)::

    python benchmarks/gpt_bench.py --model hf_llama --layers 8 --rounds 3 \
        --out benchmarks/results/pipeline_zero_reshard --configs dpmp_2x1_pp2_zero1,dpmp_2x1_pp2_zero3,\
dpmp_2x1_pp2_zero3_noreshard,dpmp_4x1_zero3,dpmp_4x1_zero3_noreshard
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DEFAULT_CONFIGS = "dpmp_2x2,mps_2x2,dpmp_4x1,ddp_4,dpmp_1x4"


# ---------------------------------------------------------------------------------------------------- worker side
def _model_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                n_embd=args.hidden, dropout=0.0, bias=True, tie_embeddings=True)


_SPLIT = re.compile(r"(blocks\.\d+\.(attn\.(q|k|v|out)_proj|mlp\.fc[12])\.weight"
                    r"|blocks\.\d+\.(attn\.[qkv]_proj|mlp\.fc1)\.bias|wte\.weight)$")


_SPLIT_LLAMA = re.compile(r"(layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight"
                          r"|embed_tokens\.weight|lm_head\.weight)$")


def expected_param_numel(net: Any, mp: int) -> tuple[int, int, int]:
    """(split, replicated, split/mp + replicated) element counts of the dense model under the Megatron layout."""
    split = rep = 0
    pattern = _SPLIT if hasattr(net, "blocks") else _SPLIT_LLAMA
    for name, p in net.named_parameters():  # tied lm_head/wte counted once
        if pattern.search(name):
            split += p.numel()
        else:
            rep += p.numel()
    return split, rep, split // mp + rep


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(t: Any) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


class _CollectiveBytes:
    """A dispatch mode recording c10d collectives by group with the size of the full tensor of each."""

    def __init__(self, groups: dict[str, Any]) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        from lightning_dpmp.integration.accounting import _OPS, _group_name

        names = {}
        for label, g in groups.items():
            n = _group_name(g) if g is not None else None
            if n is not None:
                names[n] = label
        outer = self
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}

        def size(x: Any) -> int:
            import torch
            from torch.utils._pytree import tree_leaves

            return sum(t.numel() * t.element_size() for t in tree_leaves(x) if isinstance(t, torch.Tensor))

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
                kwargs = kwargs or {}
                packet = func._overloadpacket
                ns = packet._qualified_op_name.split("::")[0]
                op = _OPS.get(packet.__name__) if ns in ("c10d", "_c10d_functional") else None
                if op is not None:
                    from torch.utils._pytree import tree_leaves

                    label = "other"
                    for leaf in tree_leaves((args, kwargs)):
                        name = leaf if isinstance(leaf, str) else _group_name(leaf)
                        if name is not None and name in names:
                            label = names[name]
                            break
                    b = max(size(args[0]), size(args[1]) if len(args) > 1 else 0)
                    if packet.__name__ == "all_gather_into_tensor":
                        b = size(args[0]) * int(args[1])
                    key = f"{label}/{op}"
                    outer.calls[key] = outer.calls.get(key, 0) + 1
                    outer.bytes[key] = outer.bytes.get(key, 0) + b
                return func(*args, **kwargs)

        self.mode = Mode()


def _held(trainer: Any, pl_module: Any, kind: str) -> dict[str, int]:
    """Bytes this rank holds now: parameters, gradients, optimizer state, and DDP's gradient buckets.

    DPMPStrategy counts from its tensors' storages (:meth:`DPMPStrategy.memory_report`: the ZeRO-3 parameters freed
    between uses count 0, their DP shards count); other strategies' tensors are counted here (DTensors by their
    local part). DDP's reducer copies gradients into buckets of its own that no Python tensor shows, so where DDP
    wraps the model (DDPStrategy; DPMPStrategy at zero=0 with dp>1) they are added as one more gradient's bytes.
    """
    import torch

    params = list(pl_module.parameters())
    if kind == "dpmp":
        rep = trainer.strategy.memory_report()
        out = {k: rep[k] for k in ("parameters", "gradients", "optimizer_state")}
    else:
        opt = trainer.optimizers[0]
        out = {
            "parameters": sum(_nbytes(p) for p in params),
            "gradients": sum(_nbytes(p.grad) for p in params if p.grad is not None),
            "optimizer_state": sum(_nbytes(v) for st in opt.state.values() for v in st.values()
                                   if isinstance(v, torch.Tensor) and v.dim() > 0),
        }
    from torch.nn.parallel import DistributedDataParallel

    s = trainer.strategy
    # DPMPStrategy wraps DDP only at zero=0 with dp > 1 where no parameter is split (mp = 1); elsewhere the strategy
    # all-reduces a flat copy of the gradients after the backward, which the profiler sees allocated and freed
    ddp = isinstance(s.model, DistributedDataParallel)
    out["ddp_buckets"] = sum(_nbytes(p) for p in params if p.requires_grad) if ddp else 0
    return out


class AllocationPeak:
    """The highest running total of CPU/GPU allocations minus frees inside the measured step, from the profiler's
    memory events (``profile_memory=True``; it sees every allocation through torch's allocators, whoever makes it).

    The profiler reports no free of a block allocated before it started ("allocated before the profiling started,
    profiler results will not include the deallocation event"), so a step profiled alone would never see the last
    step's gradients go (``zero_grad(set_to_none=True)``) while its own grow: wherever the peak comes after that
    (recomputation, the end of the backward) it counted the gradients twice. The profiler therefore starts a step
    early (:meth:`start`); the measured step is marked (:meth:`begin`, :meth:`end`) and its peak is the highest
    running total inside the mark less the total when the mark began.

    Example:
        >>> peak = AllocationPeak()  # doctest: +SKIP
        >>> peak.start(); step(); peak.begin(); step(); peak.end(); peak.peak  # bytes  # doctest: +SKIP
    """

    def __init__(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.peak = 0
        self._mark: Any = None

    def start(self) -> None:
        self.prof.__enter__()

    def begin(self) -> None:
        from torch.profiler import record_function

        self._mark = record_function(_MEASURED_STEP)
        self._mark.__enter__()

    def end(self) -> None:
        self._mark.__exit__(None, None, None)
        self.prof.__exit__(None, None, None)
        events = list(self.prof.profiler.kineto_results.events())
        mark = next(e for e in events if e.name() == _MEASURED_STEP)
        lo, hi = mark.start_ns(), mark.start_ns() + mark.duration_ns()
        running = base = 0
        self.peak = 0
        for t, nbytes in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
            if t > hi:
                break
            if t < lo:
                base = running = running + nbytes
                continue
            running += nbytes
            self.peak = max(self.peak, running - base)


#: the name of the profiler range around the measured step
_MEASURED_STEP = "gpt_bench.measured_step"


def _callback(args: argparse.Namespace, out_dir: Path, kind: str) -> Any:
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback

    class Probe(Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []
            self.cpu: list[float] = []
            self.counter: Optional[_CollectiveBytes] = None
            self.memory: dict[str, int] = {}

        def _groups(self, trainer: Any) -> dict[str, Any]:
            s = trainer.strategy
            if kind == "dpmp":
                groups = {"mp": s.grid.mp_group, "dp": s.grid.dp_group}
                return {**groups, "pp": s.grid.pp_group} if s.grid.pp > 1 else groups
            if kind == "mps":
                mesh = s.device_mesh
                return {"mp": mesh["tensor_parallel"].get_group(), "dp": mesh["data_parallel"].get_group()}
            return {"dp": dist.group.WORLD}

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # noqa: ANN001
            self.starts.append(time.perf_counter())
            self.cpu.append(time.process_time())
            if batch_idx == args.steps:  # the first untimed step: the allocation events start (see AllocationPeak)
                self.profiler = AllocationPeak()
                self.profiler.start()
            if batch_idx == args.steps + 1:  # the second untimed step: count its collectives and its memory
                self.held_start = _held(trainer, pl_module, kind)
                self.profiler.begin()
                self.counter = _CollectiveBytes(self._groups(trainer))
                self.counter.mode.__enter__()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001
            if self.counter is not None:
                self.counter.mode.__exit__(None, None, None)
                self.profiler.end()
                held = _held(trainer, pl_module, kind)
                local_numel = sum(_local(p).numel() for p in pl_module.parameters())
                # Peak during the step = what was held when it began + the highest running sum of the allocations
                # (and frees) the profiler saw in it, forward, backward, communication buffers and optimizer step.
                start_total = sum(self.held_start.values())
                self.memory = {"param_bytes": held["parameters"], "grad_bytes": held["gradients"],
                               "optim_bytes": held["optimizer_state"], "bucket_bytes": held["ddp_buckets"],
                               "held_bytes": sum(held.values()), "peak_bytes": start_total + self.profiler.peak,
                               "param_numel": local_numel}
                self._write(trainer)
                self.counter = None

        def _dp_size(self, trainer: Any) -> int:
            return trainer.strategy.dp if kind == "dpmp" else trainer.world_size

        def _write(self, trainer: Any) -> None:
            steps = [b - a for a, b in zip(self.starts, self.starts[1:])][:args.steps]  # (not the profiled ones)
            s = trainer.strategy
            rec = {
                "rank": trainer.global_rank,
                "layout": [s.dp, s.pp, s.mp, s.zero] if kind == "dpmp" else [self._dp_size(trainer), 1, 1, 0],
                "layout_report": getattr(s, "layout_report", ""),
                "step_times": steps,
                "step_cpu": [b - a for a, b in zip(self.cpu, self.cpu[1:])][:args.steps],
                "comm_calls": self.counter.calls,
                "comm_bytes": self.counter.bytes,
                "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                **self.memory,
            }
            (out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(rec))

    return Probe()


def _net(args: argparse.Namespace) -> Any:
    """The dense model: the example GPT, or transformers' Llama (RoPE, GQA, sdpa) of the same size."""
    if args.model == "gpt":
        from examples.models.gpt import GPT

        return GPT(**_model_kwargs(args))
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq, tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg)


def _hf_llama_module(args: argparse.Namespace, kind: str) -> Any:
    """transformers' Llama trained the usual way (shifted logits); for ModelParallelStrategy the TP plan of torch's
    docs and transformers' own ``tp_plan`` (q/k/v/gate/up colwise, o/down rowwise) + FSDP2 over DP."""
    import lightning as L
    import torch
    import torch.nn.functional as F

    class HFBench(L.LightningModule):
        def __init__(self, net: Any) -> None:
            super().__init__()
            self.net = net

        def configure_model(self) -> None:
            if kind != "mps" or getattr(self, "_parallelized", False):
                return
            from torch.distributed._composable.fsdp import fully_shard
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            tp, dp = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
            plan = {}
            for i in range(len(self.net.model.layers)):
                for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
                    plan[f"model.layers.{i}.{n}"] = ColwiseParallel()
                for n in ("self_attn.o_proj", "mlp.down_proj"):
                    plan[f"model.layers.{i}.{n}"] = RowwiseParallel()
            if tp.size() > 1:
                parallelize_module(self.net, tp, plan)
            for layer in self.net.model.layers:
                fully_shard(layer, mesh=dp)
            fully_shard(self.net, mesh=dp)
            self._parallelized = True

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=3e-4, weight_decay=0.0)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            ids = batch[0]
            logits = self.net(input_ids=ids, use_cache=False).logits
            return F.cross_entropy(logits[:, :-1].reshape(-1, args.vocab), ids[:, 1:].reshape(-1))

    torch.manual_seed(0)
    return HFBench(_net(args))


def _lit_module(args: argparse.Namespace, kind: str, mp: int) -> Any:
    import torch

    from examples.models.gpt import GPT, GPTLitModule

    if args.model == "hf_llama":
        return _hf_llama_module(args, kind)

    class Bench(GPTLitModule):
        def configure_model(self) -> None:
            if kind != "mps" or getattr(self, "_parallelized", False):
                return
            from torch.distributed._composable.fsdp import fully_shard
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            tp, dp = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
            plan = {}
            for i in range(len(self.net.blocks)):
                for n in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.fc1"):
                    plan[f"blocks.{i}.{n}"] = ColwiseParallel()
                for n in ("attn.out_proj", "mlp.fc2"):
                    plan[f"blocks.{i}.{n}"] = RowwiseParallel()
            if tp.size() > 1:
                parallelize_module(self.net, tp, plan)
            for block in self.net.blocks:
                fully_shard(block, mesh=dp)
            fully_shard(self.net, mesh=dp)
            self._parallelized = True

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=3e-4, weight_decay=0.0)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            logits = self(x)
            return torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))

    torch.manual_seed(0)
    return Bench(GPT(**_model_kwargs(args)))


def _shard_dp_with_fsdp2() -> None:
    """For ``..._zero<k>_fsdp2`` (issue 22's side-by-side, benchmark only): the parallelize pipeline's DP step done by
    torch's FSDP2 instead of our ZeRO engine. The MP split is ours as usual; then ``fully_shard`` over the grid's DP
    mesh dimension wraps each unit our engine would use (the repeated blocks) and the module's children, with
    ``reshard_after_forward=(zero == 3)``, and the optimizers are built again over FSDP2's sharded parameters."""
    from torch.distributed.fsdp import fully_shard

    import lightning_dpmp.integration.parallelize as pipeline
    from lightning_dpmp.parallel.zero_engine import find_units

    def shard_dp(module: Any, optimizers: Any, scheduler_configs: Any, grid: Any, split: Any, zero: int,
                 mixed_precision: Any = None, pipeline: Any = None,
                 reshard_after_forward: bool = True) -> tuple[Any, None]:
        strategy = module.trainer.strategy  # (benchmark only: its DP mesh, and configure_optimizers run again)
        mesh = strategy.device_mesh["dp"]
        for _, unit in find_units(module):
            fully_shard(unit, mesh=mesh, reshard_after_forward=zero == 3)
        # FSDP2's root hooks run on forward(), which Lightning never calls (training_step does): the children the
        # step calls (the model in `self.net`) are the root units, as ModelParallelStrategy users shard them
        for child in module.children():
            if any(True for _ in child.parameters()):
                fully_shard(child, mesh=mesh, reshard_after_forward=zero == 3)
        strategy.setup_optimizers(module.trainer)  # over the DTensor shards FSDP2 registered
        return strategy.optimizers, None

    pipeline.shard_dp = shard_dp  # type: ignore[assignment]


def _plain_parameters() -> None:
    """For ``..._plainparams`` (issue 41's side-by-side, benchmark only): the split parameters stay this rank's plain
    shards, as before DTensor parameters (DDP averages the gradients at zero=0), so one run times both."""
    import lightning_dpmp.integration.parallelize as pipeline

    pipeline.distributes_parameters = lambda topology, fitting: False  # type: ignore[assignment]


def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    import lightning as L
    from torch.utils.data import DataLoader

    from tests.support.models import make_lm_dataset

    name = args.config
    if name == "dpmp_auto":  # every size chosen at setup by the estimator (issue 44 item 3), on --world processes
        name = f"dpmp_{args.world}x1"
    m = re.fullmatch(r"(dpmp|mps|ddp)_(\d+)(?:x(\d+))?((?:_sp|_async|_compiled|_zero[0-3]|_fsdp2|_pp\d+|_gpipe"
                     r"|_interleaved|_plainparams|_noreshard|_ac)*)", name)
    if not m:
        raise SystemExit(f"unknown config {name!r}")
    kind, a, b, flags = m.group(1), int(m.group(2)), int(m.group(3) or 1), m.group(4)
    dp, mp = (a, b) if kind != "ddp" else (a, 1)
    pp_flag = re.search(r"_pp(\d+)", flags)
    pp = int(pp_flag.group(1)) if pp_flag else 1
    world = dp * mp * pp
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    callbacks = [_callback(args, out_dir, kind)]
    if kind == "dpmp":
        from lightning_dpmp import DPMPStrategy

        zero = re.search(r"_zero(\d)", flags)
        if "_fsdp2" in flags:
            if not zero or zero.group(1) not in "23":
                raise SystemExit(f"{name}: _fsdp2 replaces the ZeRO engine: give _zero2 or _zero3 with it")
            _shard_dp_with_fsdp2()
        if "_plainparams" in flags:
            _plain_parameters()
        if "_noreshard" in flags and (not zero or zero.group(1) != "3" or "_fsdp2" in flags):
            raise SystemExit(f"{name}: _noreshard is our engine's zero=3 reshard_after_forward=False: give _zero3")
        schedule = "interleaved" if "_interleaved" in flags else "gpipe" if "_gpipe" in flags else "1f1b"
        pipeline = dict(pp=pp, pp_microbatches=args.pp_microbatches, pp_schedule=schedule,
                        pp_stages_per_rank=2 if schedule == "interleaved" else 1) if pp > 1 else {}
        if args.config == "dpmp_auto":
            pipeline = dict(pp="auto", pp_microbatches=args.pp_microbatches)
            dp, mp, zero = "auto", "auto", None  # type: ignore[assignment]
        strategy: Any = DPMPStrategy(dp=dp, mp=mp, **pipeline, sequence_parallel="_sp" in flags, verify_plan=False,
                                     compile="_compiled" in flags, async_grad_allreduce="_async" in flags,
                                     zero="auto" if args.config == "dpmp_auto" else int(zero.group(1)) if zero else 0,
                                     reshard_after_forward="_noreshard" not in flags,
                                     activation_checkpointing="blocks" if "_ac" in flags else None,
                                     # FSDP2's DTensors are not gathered back by our teardown: leave them
                                     consolidate_on_teardown="_fsdp2" not in flags and "rank0")
    elif kind == "mps":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=mp)
    else:
        from lightning.pytorch.strategies import DDPStrategy

        strategy = DDPStrategy()
    if "_compiled" in flags and kind != "dpmp":
        raise SystemExit(f"{name}: _compiled is DPMPStrategy(compile=True); not offered for {kind}")
    per_dp = args.per_rank_batch or args.global_batch // dp  # --per-rank-batch: the global batch is dp times it
    n_steps = args.steps + 2  # + the untimed steps: the profiler's start, then counting and memory
    ds = make_lm_dataset(n=per_dp * world * n_steps, vocab=args.vocab, seq=args.seq, seed=1)
    loader = DataLoader(ds, batch_size=per_dp, shuffle=False, drop_last=True)
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=n_steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, callbacks=callbacks,
    )
    model = _lit_module(args, kind, mp)
    trainer.fit(model, loader)


# ---------------------------------------------------------------------------------------------------- parent side
def _run_one(config: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    for f in out.glob("rank*.json"):
        f.unlink()
    forwarded = ("model", "kv_heads", "layers", "hidden", "heads", "vocab", "seq", "global_batch", "steps",
                 "pp_microbatches", "per_rank_batch", "world")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--config", config, "--out", str(out),
           *[f"--{k.replace('_', '-')}={getattr(args, k)}" for k in forwarded]]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - t0
    ranks = sorted(out.glob("rank*.json"))
    if proc.returncode != 0 or not ranks:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        raise SystemExit(f"{config} failed (exit {proc.returncode})")
    recs = [json.loads(f.read_text()) for f in ranks]
    return {"config": config, "wall_s": wall, "ranks": recs}


def summarise(config: str, runs: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    steady = [t for r in runs for t in next(x for x in r["ranks"] if x["rank"] == 0)["step_times"][args.warmup:]]
    med = statistics.median(steady)
    cpu = [t for r in runs for x in r["ranks"] for t in x["step_cpu"][args.warmup:]]
    r0 = next(x for x in runs[0]["ranks"] if x["rank"] == 0)
    comm = r0["comm_bytes"]
    mp_b = sum(v for k, v in comm.items() if k.startswith("mp/"))
    dp_b = sum(v for k, v in comm.items() if k.startswith("dp/"))
    calls = {k: v for k, v in r0["comm_calls"].items()}
    return {
        "config": config,
        "step_s": med,
        "tokens_per_s": _global_batch(args, r0) * args.seq / med,
        "layout": r0.get("layout"),
        "cpu_s": statistics.median(cpu),
        "param_mb": max(x["param_bytes"] for x in runs[0]["ranks"]) / 2**20,
        "grad_mb": max(x["grad_bytes"] for x in runs[0]["ranks"]) / 2**20,
        "optim_mb": max(x["optim_bytes"] for x in runs[0]["ranks"]) / 2**20,
        "param_numel": max(x["param_numel"] for x in runs[0]["ranks"]),
        "bucket_mb": max(x["bucket_bytes"] for x in runs[0]["ranks"]) / 2**20,
        "held_mb": max(x["held_bytes"] for x in runs[0]["ranks"]) / 2**20,
        "held_mb_ranks": [x["held_bytes"] / 2**20 for x in sorted(runs[0]["ranks"], key=lambda x: x["rank"])],
        "pp_mb_per_step": sum(v for k, v in comm.items() if k.startswith("pp/")) / 2**20,
        "peak_mb": max(x["peak_bytes"] for r in runs for x in r["ranks"]) / 2**20,
        "peak_rss_mb": max(x["peak_rss"] for r in runs for x in r["ranks"]) / 2**20,
        "mp_mb_per_step": mp_b / 2**20,
        "dp_mb_per_step": dp_b / 2**20,
        "comm_calls": calls,
        "per_round_cpu_s": [
            statistics.median([t for x in r["ranks"] for t in x["step_cpu"][args.warmup:]]) for r in runs
        ],
        "per_round_step_s": [
            statistics.median(next(x for x in r["ranks"] if x["rank"] == 0)["step_times"][args.warmup:]) for r in runs
        ],
    }


def _global_batch(args: argparse.Namespace, rank0: dict[str, Any]) -> int:
    """Sequences per step: ``--global-batch``, or dp x ``--per-rank-batch`` (dp as the run's layout had it)."""
    return rank0["layout"][0] * args.per_rank_batch if args.per_rank_batch else args.global_batch


def _ratio(
    rows: dict[str, dict[str, Any]], a: str, b: str, key: str = "per_round_step_s"
) -> Optional[tuple[float, list[float]]]:
    """Throughput a/b (= time b / time a): per round (interleaved pairs), and its median."""
    if a not in rows or b not in rows:
        return None
    pairs = [tb / ta for ta, tb in zip(rows[a][key], rows[b][key])]
    return statistics.median(pairs), pairs


def report(rows: dict[str, dict[str, Any]], args: argparse.Namespace, out: Path) -> str:
    import torch

    net = _net(args)
    title = "GPT" if args.model == "gpt" else f"transformers Llama ({args.kv_heads} kv heads, SwiGLU {4 * args.hidden})"
    lines = [
        f"{title}: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocab {args.vocab}, "
        f"sequence {args.seq}, "
        + (f"{args.per_rank_batch} sequences per DP rank (global batch dp x that), " if args.per_rank_batch else
           f"global batch {args.global_batch} sequences ({args.global_batch * args.seq} tokens), ")
        + f"{sum(p.numel() for p in net.parameters()):,} parameters; float32, AdamW, {args.world} CPU processes"
        " (gloo); "
        f"median of steps {args.warmup + 1}..{args.steps} over {args.rounds} interleaved round(s)",
        "",
        "| layout | step s | CPU s/step/rank | tokens/s | param MB/rank | grad MB | optim MB | DDP bucket MB"
        " | held MB | peak MB | peak RSS MB | MP MB/step | DP MB/step | MP collectives/step | DP collectives/step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for c, r in rows.items():
        mp_calls = ", ".join(f"{k[3:]} {v}" for k, v in sorted(r["comm_calls"].items()) if k.startswith("mp/"))
        dp_calls = ", ".join(f"{k[3:]} {v}" for k, v in sorted(r["comm_calls"].items()) if k.startswith("dp/"))
        lines.append(
            f"| {c} | {r['step_s']:.3f} | {r['cpu_s']:.3f} | {r['tokens_per_s']:,.0f} | {r['param_mb']:.2f} | "
            f"{r['grad_mb']:.2f} | {r['optim_mb']:.2f} | {r['bucket_mb']:.2f} | {r['held_mb']:.2f} | "
            f"{r['peak_mb']:.2f} | {r['peak_rss_mb']:.0f} | {r['mp_mb_per_step']:.2f} | "
            f"{r['dp_mb_per_step']:.2f} | {mp_calls or '-'} | {dp_calls or '-'} |"
        )
    lines.append("")
    targets = (("dpmp_2x2", "mps_2x2", 2.0 if args.model == "hf_llama" else 1.5), ("dpmp_4x1", "ddp_4", 0.98),
               ("dpmp_2x2", "ddp_4", 1 / 1.2 if args.model == "hf_llama" else None))  # hf_llama: issue 11's targets
    for a, b, target in (*targets,
                         ("dpmp_2x2_async", "dpmp_2x2", None), ("dpmp_2x2_compiled", "dpmp_2x2", None),
                         ("dpmp_2x2_sp", "dpmp_2x2", None), ("dpmp_2x2_zero3", "mps_2x2", 1.6),
                         ("dpmp_2x2_zero2", "mps_2x2", None), ("dpmp_2x2_zero1", "dpmp_2x2", 0.97),
                         ("dpmp_2x2_zero0", "dpmp_2x2", 0.95)):
        r = _ratio(rows, a, b)
        if r is not None:
            verdict = "" if target is None else (f" (target >= {target}: {'holds' if r[0] >= target else 'MISSED'})")
            c = _ratio(rows, a, b, "per_round_cpu_s")
            per_round = ", ".join(f"{x:.3f}" for x in r[1])
            lines.append(f"- throughput {a} / {b}: {r[0]:.3f} (per round: {per_round}){verdict}; "
                         f"CPU time per step, {b} / {a}: {c[0]:.3f}")
    for a in [c for c in rows if c.endswith("_zero3_noreshard")]:  # FSDP2's trade: its cost and gain as ratios
        b = a[: -len("_noreshard")]
        r = _ratio(rows, a, b)
        if r is not None:
            per_round = ", ".join(f"{x:.3f}" for x in r[1])
            ratios = "; ".join(f"{what} {rows[a][key] / rows[b][key]:.3f}x ({rows[a][key]:.2f} / {rows[b][key]:.2f})"
                               for key, what in (("held_mb", "held MB"), ("peak_mb", "peak MB"),
                                                 ("dp_mb_per_step", "DP MB/step")) if rows[b][key])
            lines.append(f"- reshard_after_forward=False, {a} / {b}: throughput {r[0]:.3f} (per round: {per_round});"
                         f" {ratios}")
    for a, b in (("dpmp_2x2_zero3", "mps_2x2"), ("dpmp_2x2_zero2", "mps_2x2")):
        if a in rows and b in rows:  # issue 14: zero=3 holds no more bytes per rank than ModelParallelStrategy+FSDP2
            for key, what in (("held_mb", "held between steps"), ("peak_mb", "peak during a step")):
                ok = rows[a][key] <= rows[b][key]
                lines.append(f"- bytes {what}, {a} / {b}: {rows[a][key]:.2f} / {rows[b][key]:.2f} MB = "
                             f"{rows[a][key] / rows[b][key]:.3f}" + (f" (target <= 1: {'holds' if ok else 'MISSED'})"
                                                                      if a.endswith("zero3") else ""))
    for c, r in rows.items():
        pp = re.search(r"_pp(\d+)", c)
        if pp:  # the stages hold different blocks: every rank's bytes, and the schedule's idle share
            from lightning_dpmp.parallel.stage_runner import bubble_fraction

            schedule = "interleaved" if "_interleaved" in c else "gpipe" if "_gpipe" in c else "1f1b"
            bubble = bubble_fraction(schedule, int(pp.group(1)), args.pp_microbatches, 2 if "_interleaved" in c else 1)
            held = ", ".join(f"{h:.2f}" for h in r["held_mb_ranks"])
            lines.append(f"- {c}: {schedule}, {args.pp_microbatches} micro-batches, bubble {bubble:.1%}; held MB per "
                         f"rank {held}; stage-to-stage (PP) MB per step on rank 0 {r['pp_mb_per_step']:.2f}")
    for c, r in rows.items():
        base = c[:-3] if c.endswith("_ac") else None
        if base in rows:  # activation checkpointing beside the same layout without, and the estimator's peaks
            b = rows[base]
            step = _ratio(rows, c, base)
            predicted = [_predicted_peak_mb(args, x) for x in (c, base)]
            lines.append(f"- activation checkpointing, {c} / {base}: peak {r['peak_mb']:.2f} / {b['peak_mb']:.2f} MB ="
                         f" {r['peak_mb'] / b['peak_mb']:.3f} (estimator: {predicted[0]:.2f} / {predicted[1]:.2f} MB ="
                         f" {predicted[0] / predicted[1]:.3f}); throughput {step[0] if step else float('nan'):.3f}; "
                         f"MP collectives {r['comm_calls']} vs {b['comm_calls']}")
    for c, r in rows.items():
        m = re.fullmatch(r"dpmp_(\d+)x(\d+).*", c)
        if m and "_pp" not in c:
            split, rep, exp = expected_param_numel(net, int(m.group(2)))
            lines.append(f"- {c}: parameters per rank {r['param_numel']:,} vs analytic split/mp + replicated "
                         f"{exp:,} ({split:,}/{m.group(2)} + {rep:,}): {100 * (r['param_numel'] / exp - 1):+.2f}%")
    text = "\n".join(lines)
    (out / "results.md").write_text(text + "\n")
    with open(out / "results.csv", "w") as f:
        keys = ["config", "step_s", "cpu_s", "tokens_per_s", "param_mb", "grad_mb", "optim_mb", "bucket_mb",
                "held_mb", "peak_mb", "peak_rss_mb",
                "mp_mb_per_step", "dp_mb_per_step"]
        f.write(",".join(keys) + "\n")
        for r in rows.values():
            f.write(",".join(str(r[k]) for k in keys) + "\n")
    (out / "results.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    _plot(rows, out / "results.png")
    del torch
    return text


def _predicted_peak_mb(args: argparse.Namespace, config: str) -> float:
    """The layout estimator's peak tensor bytes per rank (worst stage) for a ``dpmp_*`` config, in MiB, from a
    profile of the benchmark's model read on meta tensors (float32, AdamW)."""
    import torch
    import torch.nn.functional as F

    from lightning_dpmp.tools.estimate import DEVICES, LayoutSpec, predict
    from lightning_dpmp.tools.profile import profile_step

    m = re.fullmatch(r"dpmp_(\d+)x(\d+)(.*)", config)
    if m is None:
        return float("nan")
    dp, mp, flags = int(m.group(1)), int(m.group(2)), m.group(3)
    pp_flag, zero = re.search(r"_pp(\d+)", flags), re.search(r"_zero(\d)", flags)
    pp = int(pp_flag.group(1)) if pp_flag else 1
    with torch.device("meta"):
        net = _net(args)
    ids = torch.zeros(1, args.seq, dtype=torch.long, device="meta")

    def step() -> Any:
        logits = net(ids) if args.model == "gpt" else net(input_ids=ids, use_cache=False).logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, args.vocab), ids[:, 1:].reshape(-1))

    prof = profile_step(net, step, args.vocab, args.hidden, args.seq, 1, heads=args.heads,
                        kv_heads=args.kv_heads if args.model == "hf_llama" else args.heads, ffn=4 * args.hidden)
    schedule = "interleaved" if "_interleaved" in flags else "gpipe" if "_gpipe" in flags else "1f1b"
    spec = LayoutSpec(dp, pp, mp, int(zero.group(1)) if zero else 0, "_sp" in flags,
                      args.pp_microbatches if pp > 1 else 1, schedule if pp > 1 else "none", "_ac" in flags)
    row = predict(prof, DEVICES["cpu"], dp * pp * mp, args.global_batch, spec, "32-true")
    return row.peak_mem_gib * 1024


def _plot(rows: dict[str, dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = list(rows)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].bar(names, [rows[n]["tokens_per_s"] for n in names], color="tab:blue")
    axes[0].set_title("throughput (tokens/s, higher is better)")
    x = range(len(names))
    axes[1].bar([i - 0.2 for i in x], [rows[n]["held_mb"] for n in names], width=0.4, label="held between steps",
                color="tab:green")
    axes[1].bar([i + 0.2 for i in x], [rows[n]["peak_mb"] for n in names], width=0.4, label="peak in a step",
                color="tab:olive")
    axes[1].set_xticks(list(x))
    axes[1].set_xticklabels(names)
    axes[1].set_title("tensor MB per rank (lower is better)")
    axes[1].legend()
    x = range(len(names))
    axes[2].bar([i - 0.2 for i in x], [rows[n]["mp_mb_per_step"] for n in names], width=0.4, label="MP")
    axes[2].bar([i + 0.2 for i in x], [rows[n]["dp_mb_per_step"] for n in names], width=0.4, label="DP")
    axes[2].set_xticks(list(x))
    axes[2].set_xticklabels(names)
    axes[2].set_title("communication MB per step (rank 0)")
    axes[2].legend()
    for ax in axes:
        ax.tick_params(axis="x", rotation=35)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help="comma-separated layouts (see the module docstring)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (every config once per round)")
    p.add_argument("--steps", type=int, default=12,
                   help="timed steps per run (two more, untimed, count collectives and memory)")
    p.add_argument("--warmup", type=int, default=3, help="steps excluded from the median")
    p.add_argument("--model", choices=("gpt", "hf_llama"), default="gpt", help="the example GPT or transformers' Llama")
    p.add_argument("--kv-heads", type=int, default=4, help="hf_llama: key/value heads (grouped-query attention)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step, over all DP ranks")
    p.add_argument("--world", type=int, default=4, help="processes (dpmp_auto's; other configs name their layout)")
    p.add_argument("--per-rank-batch", type=int, default=0,
                   help="sequences per DP rank (the global batch is dp times it; 0: --global-batch / dp)")
    p.add_argument("--pp-microbatches", type=int, default=4, help="pipeline configs: micro-batches per step")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    p.add_argument("--out", default="benchmarks/results/gpt", help="output folder")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    raw = Path(tempfile.mkdtemp(prefix="gpt_bench_"))  # per-rank JSON of each run; results.json keeps them all
    for rnd in range(args.rounds):
        for c in configs:
            rec = _run_one(c, args, raw / f"{c}_r{rnd}")
            runs[c].append(rec)
            r0 = next(x for x in rec["ranks"] if x["rank"] == 0)
            steady = r0["step_times"][args.warmup:]
            print(f"round {rnd} {c:22s} median step {statistics.median(steady):.3f}s  (run {rec['wall_s']:.0f}s)",
                  flush=True)
    rows = {c: summarise(c, runs[c], args) for c in configs}
    print(report(rows, args, out))
    (out / "runs.json").write_text(json.dumps(runs))


if __name__ == "__main__":
    main()
