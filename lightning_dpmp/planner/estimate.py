"""Per-rank peak memory and step time of every layout (dp, pp, mp, zero, sequence parallel, micro-batches,
schedule, recomputation) of a profiled model on a given cluster, before anything is launched.

The model is a :class:`~lightning_dpmp.planner.profile.ModelProfile` (read from meta tensors of the model, or the
analytic GPT); the cluster a :class:`Device` preset and a device count. For each layout, per rank of the worst
pipeline stage:

* **memory**: parameters, gradients and optimizer state as the engine holds them at each ZeRO level (0: all local;
  1/2: the parameters plus a flat DP shard of them, gradients and AdamW moments 1/dp; 3: everything 1/dp, plus the
  root unit gathered for the step and two blocks, the gathered and the prefetched). Without a pipeline ZeRO's peak
  comes in the backward: last step's gradient shards are gone (``zero_grad``) and the full gradients then held are
  the root unit's (the head's come first), the block's and the previous block's, whose reduce-scatter is in flight
  (the engine waits for it when the next is issued). Under a pipeline zero 1/2 accumulate the stage's gradients
  whole, zero=3 reduce-scatters each unit per micro-batch (its fresh gradients are shards). The DP gradient buffer at
  zero=0: DDP's buckets where nothing is split (mp = 1); with split parameters the strategy all-reduces a flat copy
  of the gradients per 25 MB bucket after the backward (a pipeline: the stage's at once). The activations the
  profile saves (split ones /mp, token-wise ones /mp with sequence parallelism; with recomputation only each
  recomputed block's input: the first ``k`` of a stage's ``N`` blocks, :attr:`LayoutSpec.recompute_blocks`; when
  ``k = N`` the peak is in the backward, one block's activations recomputed with its backward's working set, two of
  its widest activation gradients, beside the saved inputs), times the micro-batches a stage holds in flight (1F1B:
  ``min(pp - stage, M)``, GPipe: ``M``, interleaved: Korthikanti's ``pp (1 + (pp-1)/(pp v))``), the logits and loss on
  the last stage (split by vocabulary), and the stage-to-stage buffers. The peak is taken where the step holds the
  most: the end of the forward pass, before the old gradients are freed, or the optimizer step (the gradients, and
  AdamW's float32 temporaries: of every stepped parameter with ``foreach``, of the largest one without,
  :attr:`Device.foreach_step`).
* **step time**: forward + backward FLOPs (+1 forward of each recomputed block, and its forward MP collectives) at
  the device's calibrated fraction of its dense peak; MP collectives per block (ring formula of
  :func:`lightning_dpmp.planner.cost.ring_s`; on the intra-node link when an MP group fits in a node);
  the DP gradient reduction (all-reduce, or reduce-scatter + all-gather, per 25 MB bucket; zero=3 one collective per
  unit, each paying its ring's latency: a block gathered for its forward and its backward per micro-batch, the root
  once, a reduce-scatter per unit per step or per micro-batch under a pipeline), exposed where it exceeds the last
  micro-batch's backward; stage-to-stage sends and the schedule's own work per micro-batch
  (:attr:`Device.micro_overhead_s`: milliseconds on CPU); the pipeline bubble ``(pp-1)/(v M)`` of the stage time;
  and the AdamW step at the memory bandwidth (at :attr:`Device.cached_step_fraction` of it where the stepped tensors
  fit the cache), with ZeRO's own copies (gradients into its flat buffers, the shard into the gathered one).

MFU is Megatron's: model FLOPs (no recomputation) / (step time x devices x dense peak).

Example:
    >>> from lightning_dpmp.planner.gpt_shape import GPTShape
    >>> from lightning_dpmp.planner.profile import ModelProfile
    >>> prof = ModelProfile.from_gpt(GPTShape(layers=24, hidden=2048, heads=16, vocab=51200, seq=2048, batch=512))
    >>> rows = estimate(prof, DEVICES["a100-80gb"], devices=64, global_batch=512, precision="bf16-mixed")
    >>> best = next(r for r in rows if r.chosen)
    >>> best.fits, best.dp * best.pp * best.mp
    (True, 64)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Iterable, Optional

from lightning_dpmp.planner.cost import BUCKET_BYTES, ring_s
from lightning_dpmp.planner.profile import ModelProfile

__all__ = ["CPU_MICRO_OVERHEAD_S", "DEVICES", "PRECISIONS", "Device", "Estimate", "LayoutSpec", "estimate",
           "fewest_recomputed", "layouts", "predict", "recomputed_per_stage"]


@dataclass(frozen=True)
class Device:
    """One accelerator kind and the links between them.

    Args:
        name: the preset's name.
        memory_gib: memory per device, GiB (what the framework can use).
        peak_flops: dense peak FLOP/s by compute dtype (``"bf16"``, ``"fp32"``, ``"fp64"``).
        efficiency: the fraction of the peak a large transformer's matmuls sustain (calibrated, see docs).
        mem_bw: memory bandwidth, bytes/s (the optimizer step).
        intra_bw, inter_bw: achieved collective bus bandwidth per device inside a node / across nodes, bytes/s.
        intra_latency, inter_latency: seconds per ring step.
        devices_per_node: devices sharing the intra-node link.
        efficiency_width: matmuls narrower than this lose efficiency: the sustained fraction is
            ``efficiency * hidden / (hidden + efficiency_width)`` (0 = constant).
        overhead_s: fixed seconds per block per micro-batch, forward and backward (kernel launches, Python).
        micro_overhead_s: fixed seconds per micro-batch on each pipeline stage, forward and backward: the schedule's
            own work (its Python, the send and receive calls, detaching a stage's input, one autograd call per
            micro-batch), beside the message time. Measured on CPU (where it is several milliseconds); ``0`` on
            the GPU presets (hidden under the kernels).
        overlap_dp: the DP gradient reduction runs during the backward pass (devices with their own copy
            engines); ``False`` where it competes for the same cores (gloo on CPU).
        idle_bubble: a stage waiting in the pipeline bubble idles its device; ``False`` where processes share
            cores, so that one waiting gives its core to another.
        foreach_step: torch's optimizers take their ``foreach`` implementation (the default on CUDA), which holds a
            float32 temporary of every parameter it steps at once; ``False`` (CPU tensors): the per-parameter loop,
            whose temporaries are those of one parameter at a time.
        step_cache_bytes, cached_step_fraction: the per-parameter loop (``foreach_step=False``) makes several
            passes over each tensor it steps; a tensor of at most ``step_cache_bytes`` stays in cache between them,
            and its step costs ``cached_step_fraction`` of the memory-bound time. That is what sets ZeRO 1/2 apart
            on CPU: zero=0 steps the model's own tensors (a matrix of 1 MiB here), ZeRO a unit's flat shard (2 MiB
            at dp=2, and 8 MiB at dp=1 would be). ``0``: no such effect (the GPU presets).
    """

    name: str
    memory_gib: float
    peak_flops: dict[str, float]
    efficiency: float
    mem_bw: float
    intra_bw: float
    inter_bw: float
    intra_latency: float = 5e-6
    inter_latency: float = 10e-6
    devices_per_node: int = 8
    efficiency_width: float = 0.0
    overhead_s: float = 30e-6
    micro_overhead_s: float = 0.0
    overlap_dp: bool = True
    idle_bubble: bool = True
    foreach_step: bool = True
    step_cache_bytes: float = 0.0
    cached_step_fraction: float = 1.0

    def sustained(self, dtype: str, hidden: int) -> float:
        """FLOP/s one device sustains on the model's matmuls at width ``hidden``."""
        shape = hidden / (hidden + self.efficiency_width) if self.efficiency_width else 1.0
        return self.peak_flops[dtype] * self.efficiency * shape


#: CPU seconds a pipeline stage spends per micro-batch on the schedule itself (forward and backward: its Python,
#: the send and receive calls, detaching the stage input, one autograd call), on one core. Fitted on this 2-core
#: machine (benchmarks/results/auto_layout/run4: the CPU time per step of (1,4,1) and (2,2,1) against (4,1,1) leaves
#: 4.8 ms per micro-batch and stage beside the blocks' own work).
CPU_MICRO_OVERHEAD_S = 5e-3

# Figures: vendor datasheets for peaks, memory and HBM bandwidth (dense, no sparsity); link figures are NCCL
# bus bandwidths commonly achieved (NVLink3 ~230 GB/s, NVLink4 ~360 GB/s, NVLink5 ~720 GB/s; 200/400 Gb/s
# InfiniBand per GPU ~22/45 GB/s). efficiency and efficiency_width of the NVIDIA presets are calibrated on
# Megatron-LM's Table 1 (benchmarks/megatron_check.py); cpu's on this machine (benchmarks/estimator_check.py).
_A100 = {"bf16": 312e12, "fp32": 19.5e12, "fp64": 19.5e12}
_H100 = {"bf16": 989e12, "fp32": 67e12, "fp64": 67e12}


def _nvidia(name: str, memory_gb: float, mem_bw: float, peak: dict[str, float], intra_bw: float,
            inter_bw: float) -> Device:
    # efficiency, efficiency_width and overhead fitted on the A100 rows of Megatron-LM's Table 1
    return Device(name, memory_gib=memory_gb * 1e9 / 2**30, peak_flops=peak, efficiency=0.64, mem_bw=mem_bw,
                  intra_bw=intra_bw, inter_bw=inter_bw, efficiency_width=500.0, overhead_s=0.0)


DEVICES: dict[str, Device] = {
    "a100-40gb": _nvidia("a100-40gb", 40, 1.555e12, _A100, 230e9, 22e9),
    "a100-80gb": _nvidia("a100-80gb", 80, 2.039e12, _A100, 230e9, 22e9),
    "h100": _nvidia("h100", 80, 3.35e12, _H100, 360e9, 45e9),
    "h200": _nvidia("h200", 141, 4.8e12, _H100, 360e9, 45e9),
    "b200": _nvidia("b200", 180, 8.0e12, {"bf16": 2.25e15, "fp32": 75e12, "fp64": 37e12}, 720e9, 45e9),
    # This machine (2 cores of an AVX-512 Xeon, 23 GiB, 4 gloo processes): peak = half a core's (2 FMA units x 16
    # float32 lanes x 2 FLOPs at an assumed 2.0 GHz: 128 GFLOP/s per core); memory = 23 GiB / 4 processes less the
    # runtime; link bandwidth measured (benchmarks/gloo_links.py), efficiency and per-ring-step latency fitted on 3
    # measured layouts (benchmarks/estimator_check.py); a pipeline micro-batch's schedule work,
    # CPU_MICRO_OVERHEAD_S x 2 processes per core; AdamW's loop over tensors of at most 2 MiB at half the
    # memory-bound time (measured: 2.4-3.4 ns per parameter up to 2 MiB, 4.5-6.3 from 4 MiB).
    "cpu": Device("cpu", memory_gib=4.0, peak_flops={"bf16": 64e9, "fp32": 64e9, "fp64": 32e9}, efficiency=0.62,
                  mem_bw=5e9, intra_bw=1.0e9, inter_bw=1.0e9, intra_latency=1e-3, inter_latency=1e-3,
                  devices_per_node=64, overhead_s=0.0, overlap_dp=False, idle_bubble=False,
                  micro_overhead_s=2 * CPU_MICRO_OVERHEAD_S, foreach_step=False, step_cache_bytes=2 * 2**20,
                  cached_step_fraction=0.5),
}

# precision -> (compute dtype, bytes per parameter, per gradient, optimizer state per parameter (AdamW + master))
PRECISIONS: dict[str, tuple[str, int, int, int]] = {
    "bf16-mixed": ("bf16", 4, 4, 8), "16-mixed": ("bf16", 4, 4, 8), "bf16-true": ("bf16", 2, 2, 4),
    "32-true": ("fp32", 4, 4, 8), "64-true": ("fp64", 8, 8, 16),
    # Megatron-LM's mixed precision: bf16 weights, fp32 main gradients, fp32 master weights and moments
    "megatron-bf16": ("bf16", 2, 4, 12),
}


@dataclass(frozen=True)
class LayoutSpec:
    """One layout: the parallel degrees and the settings that change memory or time. ``recompute``: the blocks'
    activations are recomputed in the backward, ``recompute_blocks`` of each stage's (``None``: all of them)."""

    dp: int
    pp: int
    mp: int
    zero: int = 0
    sequence_parallel: bool = False
    microbatches: int = 1
    schedule: str = "none"
    recompute: bool = False
    recompute_blocks: Optional[int] = None


@dataclass
class Estimate:
    """The prediction for one layout (the JSON row of ``python -m lightning_dpmp.plan``); bytes per rank of the
    worst stage, seconds per optimizer step."""

    dp: int
    pp: int
    mp: int
    zero: int
    sequence_parallel: bool
    microbatches: int
    schedule: str
    recompute: bool
    fits: bool
    peak_mem_gib: float
    step_s: float
    tokens_per_s: float
    mfu: float
    chosen: bool = False
    memory: Optional[dict[str, float]] = None
    time: Optional[dict[str, float]] = None
    recompute_blocks: Optional[int] = None

    def row(self) -> dict[str, Any]:
        """The keys of the JSON format (without the breakdowns and the recomputed count: all or none there)."""
        d = asdict(self)
        d.pop("memory")
        d.pop("time")
        d.pop("recompute_blocks")
        return d

    @property
    def spec(self) -> LayoutSpec:
        return LayoutSpec(self.dp, self.pp, self.mp, self.zero, self.sequence_parallel, self.microbatches,
                          self.schedule, self.recompute, self.recompute_blocks)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(prof: ModelProfile, devices: int, global_batch: int, zeros: Iterable[int] = (0, 1, 2, 3),
            schedules: Iterable[str] = ("1f1b", "gpipe", "interleaved"),
            max_microbatches: int = 64) -> list[LayoutSpec]:
    """Every layout of ``devices`` the model allows: ``mp`` divides heads, key/value heads and the feed-forward
    width; ``pp`` at most the blocks; ``dp`` divides the global batch; micro-batches divide each DP rank's batch
    (powers of two times the stages, up to ``max_microbatches``); zero > 0 only with dp > 1; sequence
    parallelism only with mp > 1.

    Example:
        >>> from lightning_dpmp.planner.gpt_shape import GPTShape
        >>> p = ModelProfile.from_gpt(GPTShape(layers=4, hidden=64, heads=4, vocab=128, seq=16, batch=8))
        >>> sorted({(s.dp, s.pp, s.mp) for s in layouts(p, 4, 8)})
        [(1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1), (4, 1, 1)]
    """
    out = []
    for mp in _divisors(devices):
        if any(x and x % mp for x in (prof.heads, prof.kv_heads, prof.ffn)):
            continue
        for pp in _divisors(devices // mp):
            dp = devices // (mp * pp)
            if pp > max(prof.layers, 1) or global_batch % dp:
                continue
            local = global_batch // dp
            if pp == 1:
                mbs, scheds = [m for m in _divisors(local) if m <= max_microbatches], ["none"]
            else:
                mbs = [m for m in _divisors(local) if m >= pp and m <= max_microbatches]
                scheds = [s for s in schedules if s != "interleaved" or prof.layers % (2 * pp) == 0]
            for m in mbs:
                for sched in scheds:
                    for zero in (z for z in zeros if dp > 1 or z == 0):
                        for sp in ((False, True) if mp > 1 else (False,)):
                            for rc in (False, True):
                                out.append(LayoutSpec(dp, pp, mp, zero, sp, m, sched, rc))
    return out


def _stage_params(prof: ModelProfile, spec: LayoutSpec) -> list[float]:
    """Parameters each stage holds on one rank (dense count / mp where split)."""
    mp, pp = spec.mp, spec.pp
    vocab_split = prof.vocab % mp == 0
    block = prof.block_split_params / mp + prof.block_replicated_params
    vocab = prof.vocab_params / (mp if vocab_split else 1)
    per_stage = math.ceil(prof.layers / pp)
    if pp == 1:
        return [prof.layers * block + vocab + prof.other_params]
    table = vocab / 2 if not prof.tied else vocab  # untied: table on the first stage, head on the last
    first = per_stage * block + table + prof.other_params
    last = per_stage * block + (vocab - table if not prof.tied else vocab)
    return [first, last] + ([per_stage * block] if pp > 2 else [])


def recomputed_per_stage(prof: ModelProfile, spec: LayoutSpec) -> int:
    """How many of a stage's blocks ``spec`` recomputes (0 without recomputation, at most the stage's blocks).

    Example:
        >>> from lightning_dpmp.planner.gpt_shape import GPTShape
        >>> p = ModelProfile.from_gpt(GPTShape(layers=8, hidden=64, heads=4, vocab=128, seq=16, batch=8))
        >>> [recomputed_per_stage(p, LayoutSpec(1, 2, 1, recompute=r, recompute_blocks=k))
        ...  for r, k in ((False, 3), (True, None), (True, 3), (True, 9))]
        [0, 4, 3, 4]
    """
    per_stage = math.ceil(prof.layers / spec.pp)
    if not spec.recompute:
        return 0
    return per_stage if spec.recompute_blocks is None else max(0, min(spec.recompute_blocks, per_stage))


def predict(prof: ModelProfile, dev: Device, devices: int, global_batch: int, spec: LayoutSpec,
            precision: str = "bf16-mixed") -> Estimate:
    """Predict one layout: peak memory of the worst rank and step time (see the module docstring)."""
    dtype, pb, gb, ob = PRECISIONS[precision]
    dp, pp, mp, zero, m = spec.dp, spec.pp, spec.mp, spec.zero, spec.microbatches
    if dp * pp * mp != devices:
        raise ValueError(f"dp*pp*mp = {dp}*{pp}*{mp} = {dp * pp * mp} != devices = {devices}")
    act_scale = {"bf16": 2, "fp32": 4, "fp64": 8}[dtype] / prof.act_bytes  # profiled in another dtype
    local_seqs = global_batch / dp
    mb = local_seqs / m                                # sequences per micro-batch
    vocab_split = prof.vocab % mp == 0
    per_stage = math.ceil(prof.layers / pp)
    v = 2 if spec.schedule == "interleaved" else 1
    sp = spec.sequence_parallel
    k = recomputed_per_stage(prof, spec)  # blocks of a stage recomputed in the backward

    # ---- memory, per rank, of each stage; the worst counts
    block_params = prof.block_split_params / mp + prof.block_replicated_params
    # the model's largest matrix on a rank (what AdamW's CPU loop steps at once, at zero=0)
    matrix = max(prof.hidden * max(prof.ffn, prof.hidden) / mp, prof.hidden * prof.vocab / (mp if vocab_split else 1))
    tokenwise = prof.block_act_tokenwise / (mp if sp else 1)
    block_act = (prof.block_act_split / mp + tokenwise) * act_scale * mb
    block_in = prof.block_input_bytes * act_scale * mb / (mp if sp else 1)
    logits = prof.logits_act * mb / (mp if vocab_split else 1)
    # a block's backward beside its saved (or recomputed) activations: the gradients of its widest ones, the MLP's
    # intermediate (two alive at once: the gradient arriving and the one it makes)
    bwd_work = 2 * mb * prof.seq * (prof.ffn or 4 * prof.hidden) / mp * prof.act_bytes * act_scale
    msg = prof.hidden * prof.seq * mb * prof.act_bytes * act_scale   # one micro-batch's boundary activation
    worst: dict[str, float] = {}
    for s, n in enumerate(_stage_params(prof, spec)):
        stage = 0 if s == 0 else (pp - 1 if s == 1 else 1)
        if pp == 1:
            inflight = 1.0
        elif spec.schedule == "gpipe":
            inflight = float(m)
        elif spec.schedule == "interleaved":
            inflight = min(m, pp) * (1 + (pp - 1) / (pp * v)) if stage == 0 else min(m, pp - stage)
        else:
            inflight = float(min(m, pp - stage))
        held_p, held_g, held_o, extra = n * pb, n * gb, n * ob, 0.0
        root = max(0.0, n - per_stage * block_params)   # what is not a block: the root ZeRO unit
        # ZeRO (pp = 1): the peak comes in the backward, as it starts (every activation still held) or, with every
        # block recomputed, as a block recomputes. Last step's gradient shards went at zero_grad; the full gradients
        # held then are the root unit's (the head's come first, the embedding's last), the block's and the one
        # before it (its reduce-scatter in flight, waited for when this block's is issued)
        full_then = (root + 2 * block_params) * gb
        # DDP wraps the model where nothing is split and no pipeline runs; otherwise the strategy (or the pipeline)
        # all-reduces a flat copy of the gradients after the backward: per 25 MB bucket, or the whole stage at once
        ddp = mp == 1 and pp == 1
        flat_copy = 0.0 if ddp or zero or dp == 1 else n * gb if pp > 1 else min(n * gb, BUCKET_BYTES)
        if zero == 0:
            extra = n * gb if dp > 1 and ddp else 0.0                 # DDP's buckets, held for the run
        elif zero in (1, 2):
            held_p, held_g, held_o = n * pb * (1 + 1 / dp), n * gb / dp, n * ob / dp
            extra = max(0.0, full_then - held_g)
        else:
            held_p, held_g, held_o = n * pb / dp, n * gb / dp, n * ob / dp
            # + the root gathered for the step, the gathered and the prefetched block
            extra = max(0.0, full_then - held_g) + root * pb * (1 - 1 / dp) + block_params * pb * 2
        per_micro = k * block_in + (per_stage - k) * block_act
        rest = prof.rest_act * act_scale * mb if stage == 0 else 0.0
        last_logits = logits if stage == pp - 1 else 0.0
        if pp == 1 and k == per_stage and k:
            # Every block recomputed: the peak is in the backward, one block's activations recomputed, with its
            # backward's working set, beside the saved block inputs: all of them at the first block recomputed,
            # when the gradients are the head's only (last step's went at zero_grad), one at the last, when they
            # are all there. The forward's end holds the inputs, the logits and last step's gradients.
            bwd = block_act + bwd_work + rest + max(per_stage * block_in + root * gb - held_g, block_in)
            acts = max(per_stage * block_in + rest + last_logits, bwd)
        else:
            # the first k blocks recompute, late in the backward, when the later blocks' activations are freed: a
            # recomputed block's activations (and its backward's working set) add to the peak only when every
            # block recomputes
            acts = (inflight * (per_micro + rest) + (block_act + bwd_work if k == per_stage and k else 0.0)
                    + last_logits)
        if pp > 1:
            # the schedule's gradients are new tensors (the previous step's wait aside until the strategy's
            # backward): with a steady phase (more micro-batches than in flight) they coexist with the most
            # activations, otherwise with one micro-batch fewer. zero=3 (reshard_after_forward) reduce-scatters each
            # unit per micro-batch: its fresh gradients are shards, beside a unit's full ones and the last one's in
            # flight, with two blocks and the stage's root gathered
            fresh = n * gb / dp if zero == 3 else n * gb
            steady = spec.schedule != "gpipe" and m > inflight
            acts = acts + fresh if steady else max(acts, acts - per_micro + fresh)
            if zero in (1, 2):
                extra = 0.0
            elif zero == 3:
                extra = root * pb * (1 - 1 / dp) + 2 * block_params * (pb + gb)
        buffers = 2 * msg if pp > 1 else 0.0                         # the stage's send and receive buffers
        mem = dict(parameters=held_p, gradients=held_g, optimizer=held_o, activations=acts, dp_buffers=extra,
                   comm_buffers=buffers)
        # the optimizer step, activations freed: torch's foreach AdamW holds one float32 temporary per parameter
        # it steps (sqrt of the second moment); with recomputation this phase is often the peak. Its per-parameter
        # loop (CPU) holds two of the largest one it steps: under ZeRO a unit's flat shard
        if dev.foreach_step:
            stepped = n / (dp if zero else 1)
        else:
            largest = max(block_params, root) / dp if zero else matrix
            stepped = 2 * min(largest, n / (dp if zero else 1))
        grads_at_step = n * gb if zero == 0 else n * gb / dp
        at_step = held_p + grads_at_step + held_o + (n * gb if zero == 0 and dp > 1 and ddp else 0.0) + stepped * 4
        at_step = max(at_step, held_p + grads_at_step + held_o + flat_copy)  # the DP average, activations freed
        mem["optimizer_step"] = max(0.0, at_step - sum(mem.values()))
        if sum(mem.values()) > sum(worst.values()):
            worst = mem
    peak = sum(worst.values())

    # ---- time
    flops_dev = dev.sustained(dtype, prof.hidden)
    fwd_block = (prof.block_flops_split / mp + prof.block_flops_replicated) * mb
    fwd_head = prof.head_flops / (mp if vocab_split else 1) * mb
    stage_fwdbwd = ((3 * per_stage + k) * fwd_block + (3 * fwd_head if pp == 1 else 0.0)) / flops_dev
    head_s = 3 * fwd_head / flops_dev if pp > 1 else 0.0               # the last stage's extra work
    mp_in_node = mp <= dev.devices_per_node and dev.devices_per_node % mp == 0
    mp_bw, mp_lat = (dev.intra_bw, dev.intra_latency) if mp_in_node else (dev.inter_bw, dev.inter_latency)
    act = prof.hidden * prof.seq * mb * prof.act_bytes * act_scale
    fwd_ar, bwd_ar = prof.mp_allreduces_per_block
    n_ar = per_stage * (fwd_ar + bwd_ar) + k * fwd_ar   # a recomputed block re-issues its forward's
    mp_s = n_ar * ring_s(act, mp, mp_bw, mp_lat) if mp > 1 else 0.0   # SP: AG + RS, the same time
    if vocab_split and mp > 1:
        mp_s += 2 * ring_s(act, mp, mp_bw, mp_lat) / max(pp, 1)       # the embedding and the head's input grad
    micro_s = stage_fwdbwd + mp_s + (per_stage + 0.33 * k) * dev.overhead_s
    pp_s = 0.0
    if pp > 1:
        inter = pp * mp > dev.devices_per_node                          # neighbouring stages lie mp apart
        bw, lat = (dev.inter_bw, dev.inter_latency) if inter else (dev.intra_bw, dev.intra_latency)
        pp_s = 2 * (msg / bw + lat) + dev.micro_overhead_s            # activation forward, its gradient backward
        micro_s += pp_s
    bubble = (pp - 1) / v * micro_s if pp > 1 and dev.idle_bubble else 0.0
    pipe_s = m * micro_s + bubble + (m * head_s if pp > 1 else 0.0)
    # DP: gradients of the largest stage, over dp ranks; inter-node once the DP group spans nodes
    n_local = max(_stage_params(prof, spec))
    gw = 4 if dtype != "fp64" else 8  # bytes of a gradient element
    grad_bytes = n_local * gw
    # a DP group's ranks lie pp*mp apart: it spans nodes as soon as the world does (dp > 1)
    bw, lat = (dev.inter_bw, dev.inter_latency) if devices > dev.devices_per_node else (dev.intra_bw, dev.intra_latency)
    if zero == 3:
        # one collective per ZeRO unit (each block of the stage, and the root: what is not a block), each paying its
        # ring steps' latency. A block is gathered for its forward and again for its backward, per micro-batch; the
        # root once per step (it stays gathered). Gradients are reduce-scattered once per step, or per micro-batch
        # under a pipeline (1F1B frees them as it goes). Counted at (4,1,1): 17 gathers, 9 reduce-scatters; at
        # (2,2,1) with 4 micro-batches: 33 and 20
        block_n = min(block_params, n_local / max(per_stage, 1))
        root_n = n_local - per_stage * block_n
        rs_rounds = m if pp > 1 else 1
        dp_s = (m * 2 * per_stage * ring_s(block_n * pb, dp, bw, lat, "all_gather")
                + ring_s(root_n * pb, dp, bw, lat, "all_gather")
                + rs_rounds * (per_stage * ring_s(block_n * gw, dp, bw, lat, "reduce_scatter")
                               + ring_s(root_n * gw, dp, bw, lat, "reduce_scatter")))
    else:
        # zero=0: an all-reduce per 25 MB bucket; zero 1/2: a reduce-scatter and an all-gather per bucket (the same
        # bytes and ring steps)
        buckets = max(1, math.ceil(grad_bytes / BUCKET_BYTES))
        dp_s = ring_s(grad_bytes, dp, bw, 0.0) + (buckets * 2 * (dp - 1) * lat if dp > 1 else 0.0)
    dp_exposed = (max(0.0, dp_s - micro_s * 2 / 3) if dev.overlap_dp else dp_s) if dp > 1 else 0.0
    optim_s = n_local / (dp if zero else 1) * 28 / dev.mem_bw        # AdamW: ~7 words read/written per parameter
    if dev.step_cache_bytes:
        # the largest tensor stepped: a matrix of the model (zero=0), or a block unit's flat shard (ZeRO)
        stepped_bytes = (block_params / dp if zero else matrix) * 4
        if stepped_bytes <= dev.step_cache_bytes:
            optim_s *= dev.cached_step_fraction
    if zero:
        # ZeRO's own copies, beyond DDP's: the gradients into the engine's flat buffers and the stepped shard into
        # the gathered buffer, each read and written. On CPU they outweigh what stepping a 1/dp shard saves:
        # measured zero=1 against zero=0, (2,2,1) +17 ms CPU per step and rank, (4,1,1) +5 ms
        optim_s += n_local * 2 * 2 * gw / dev.mem_bw
    step = pipe_s + dp_exposed + optim_s
    tokens = global_batch * prof.seq
    model_flops = prof.model_flops_per_token() * tokens
    return Estimate(
        dp=dp, pp=pp, mp=mp, zero=zero, sequence_parallel=sp, microbatches=m, schedule=spec.schedule,
        recompute=spec.recompute, recompute_blocks=spec.recompute_blocks, fits=peak <= dev.memory_gib * 2**30,
        peak_mem_gib=peak / 2**30, step_s=step,
        tokens_per_s=tokens / step, mfu=model_flops / (step * devices * dev.peak_flops[dtype]),
        memory=worst, time=dict(compute=m * stage_fwdbwd, mp=m * mp_s, pp=m * pp_s, bubble=bubble,
                                dp_exposed=dp_exposed, optimizer=optim_s),
    )


def fewest_recomputed(prof: ModelProfile, spec: LayoutSpec, global_batch: int, budget_bytes: float,
                      precision: str = "bf16-mixed") -> tuple[int, Estimate]:
    """The fewest blocks per stage to recompute at ``spec``'s layout whose predicted peak fits ``budget_bytes``
    (what ``DPMPStrategy(activation_checkpointing="auto")`` applies), and that prediction; every block (the least
    memory) when none fits, with ``fits`` False.

    Example:
        >>> from lightning_dpmp.planner.gpt_shape import GPTShape
        >>> p = ModelProfile.from_gpt(GPTShape(layers=8, hidden=256, heads=4, vocab=512, seq=256, batch=8))
        >>> none = predict(p, DEVICES["h100"], 1, 8, LayoutSpec(1, 1, 1), "32-true").peak_mem_gib * 2**30
        >>> k, row = fewest_recomputed(p, LayoutSpec(1, 1, 1), 8, none * 0.8, "32-true")
        >>> 0 < k < 8, row.fits
        (True, True)
    """
    n = math.ceil(prof.layers / spec.pp)
    dev = replace(DEVICES["h100"], memory_gib=budget_bytes / 2**30)  # (only the memory matters here)
    devices = spec.dp * spec.pp * spec.mp
    row = predict(prof, dev, devices, global_batch, replace(spec, recompute=False, recompute_blocks=None), precision)
    for k in range(1, n + 1):
        if row.fits:
            return k - 1, row
        row = predict(prof, dev, devices, global_batch, replace(spec, recompute=True, recompute_blocks=k), precision)
    return n, row


def estimate(prof: ModelProfile, dev: Device, devices: int, global_batch: int, precision: str = "bf16-mixed",
             specs: Optional[Iterable[LayoutSpec]] = None) -> list[Estimate]:
    """Every layout (or ``specs``), fastest first; the fastest that fits is ``chosen`` (ties: the one holding
    the least memory)."""
    rows = [predict(prof, dev, devices, global_batch, s, precision)
            for s in (specs if specs is not None else layouts(prof, devices, global_batch))]
    rows.sort(key=lambda r: (not r.fits, round(r.step_s, 12), r.peak_mem_gib))
    if rows and rows[0].fits:
        rows[0].chosen = True
    return rows
