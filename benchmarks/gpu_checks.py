"""The checks of ``benchmarks/gpu_check.sh``: every capability of lightning-dpmp on one CUDA GPU in one prepared run,
or the same run on the CPU with tiny sizes (the dry mode, which CI runs so that the script cannot rot).

    bash benchmarks/gpu_check.sh                        # one CUDA GPU: <= 8 minutes, benchmarks/results/gpu/
    bash benchmarks/gpu_check.sh --device cpu           # dry mode: the same code, tiny sizes, gloo
    python benchmarks/gpu_checks.py all --device cpu --out /tmp/gpu_check    # what the script runs

Checks (one row each in ``summary.md``; a check passes only when all of its assertions hold):

- ``gloo_cuda_probe``: each collective the library issues (:data:`PROBED_OPS`) on device tensors over gloo between 4
  processes that all use device 0 (NCCL refuses two ranks on one GPU, so every multi-rank check runs this way).
  ``unsupported`` names the operations that failed; without all-reduce, all-gather and broadcast the multi-rank
  checks are not run and are reported ``unsupported`` too.
- ``parity_1x2``, ``parity_2x1``, ``parity_2x2``, ``parity_pp``: the GPT of the tests (``tests.support.models``)
  trained in float64 (``precision="64-true"``) under ``DPMPStrategy`` at (dp, mp) = (1, 2), (2, 1), (2, 2) (plain,
  ``zero=3``, ``sequence_parallel=True``) and (dp, pp, mp) = (1, 2, 2) (1F1B, 4 micro-batches), against one process
  on the CPU (``tests.support.reference.reference_run``: same seed, global batch and sampler permutation): max
  |w - w_ref| <= 1e-8, and the collectives of one whole step counted (``CommCounter``) equal to the test suite's
  expectations (``tests/distributed/test_transformer_parity.py``, ``test_zero.py``, ``test_pipeline.py``).
- ``pretrained``: a tiny transformers Llama written with ``save_pretrained``, read with
  ``lightning_dpmp.from_pretrained`` at (1, 2) (each rank reads only its slices: equal to the file's exactly),
  fine-tuned in float64 against transformers' own ``from_pretrained`` on one process (<= 1e-8), exported with
  ``DPMPStrategy.save_pretrained`` while split, and loaded back by transformers to the trained weights exactly.
- ``hydra_train``: ``examples/train.py trainer=gpu`` (``trainer=cpu`` in the dry mode) at world size 1 in bf16-mixed
  through Hydra (NCCL on CUDA), saving ``last.ckpt``; ``hydra_resume``: a second run resumed from it
  (``ckpt_path=``) trains only the remaining steps and starts from the first run's loss level, not from scratch.
- ``compile``: ``DPMPStrategy(compile=True)`` against eager at world size 1 in float32: median step times, the max
  weight distance after the same steps (<= 1e-3), every block compiled, no graph break.
- ``mfu``: the benchmark Llama of ``benchmarks/gpt_bench.py --model hf_llama`` at world size 1 in bf16-mixed:
  tokens/s under ``DPMPStrategy(dp=1, mp=1)`` and under plain Lightning (``strategy="auto"``) in the same run, their
  ratio (our overhead at mp=1), and the model FLOP utilisation against the device's dense bf16 peak
  (:data:`PEAK_BF16_TFLOPS`); model FLOPs per token = 6 x (parameters but the input embedding) + 12 x layers x
  hidden x sequence (Megatron's attention term; recomputation not counted).

Layout: ``all`` (no torch import) runs three groups in turn, each within a time limit, and writes
``<out>/results/<check>.json``, ``<out>/logs/*.log`` and ``<out>/summary.md``; the bulky files (checkpoints,
exports, Hydra run folders) go to ``<out>/work/`` and are deleted at the end unless ``GPU_CHECK_KEEP=1``.
``group ranks`` (its own process session) trains the references on the CPU while it launches 4 rank processes
(``rank``) once for every multi-rank check: the probe, the 4-rank cases, then, on ranks 0 and 1, the 2-rank cases,
each case in a process group of its own (a failing case is recorded and the next one still runs). ``group single``
runs ``mfu`` and ``compile`` in one process. The Hydra checks run ``examples/train.py`` as subprocesses. The CUDA
mode differs from the dry mode only in the device, NCCL at world size 1 and the sizes (:data:`SIZES`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

START = time.perf_counter()
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PARITY_TOL = 1e-8  # float64 weights against one process (the test suite's bound; measured there <= 3e-14)
#: float32 weights, compiled against eager after the same AdamW steps (lr 1e-3): rounding differences stay far below
#: it (measured on the CPU: 2.4e-7 after 6 steps; the test suite: 2.4e-6 after 4), a wrong gradient moves a weight by
#: about lr every step (2.5e-2 after the CUDA run's 25)
COMPILE_TOL = 1e-3
#: Dense bf16 peak of a device in TFLOP/s, keyed by a substring of ``torch.cuda.get_device_name()`` (first match in
#: this order); ``cpu`` is a nominal figure for the dry mode, so that the arithmetic runs, not a measured peak.
PEAK_BF16_TFLOPS: dict[str, float] = {
    "H200": 989.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "A10G": 70.0,
    "cpu": 1.0,
}


@dataclass(frozen=True)
class Sizes:
    """Everything that differs between the CUDA run and the dry mode, apart from the device and NCCL at world 1."""

    budget_s: float  # the whole run, all groups together
    ranks_timeout_s: float  # the multi-rank group (references, the launch, every case, the comparisons)
    hydra_timeout_s: float  # each of the two examples/train.py runs
    single_timeout_s: float  # mfu + compile
    collective_timeout_s: float  # DPMPStrategy(timeout=...) in the rank processes: a hang fails, not waits
    parity_steps: int  # float64 steps per multi-rank case (>= 4: the collectives of step 3 are counted)
    hydra_steps: int  # steps of the first Hydra run; the resumed run trains as many again
    hydra_overrides: tuple[str, ...]  # model and data sizes of the Hydra runs
    compile_gpt: dict[str, int]  # examples.models.gpt.GPT sizes (+ batch) for compile vs eager
    compile_steps: int
    llama: dict[str, int]  # the benchmark Llama (gpt_bench.py --model hf_llama) for the MFU check (+ batch)
    mfu_steps: int
    warmup_steps: int  # steps left out of every timing (compilation, allocator, cuBLAS autotuning)


SIZES: dict[str, Sizes] = {
    "cpu": Sizes(
        # generous: CI machines are slow and may be shared (measured 43-64 s alone, 260 s beside a test suite)
        budget_s=540, ranks_timeout_s=240, hydra_timeout_s=120, single_timeout_s=180, collective_timeout_s=60,
        parity_steps=5, hydra_steps=4,
        hydra_overrides=("model.net.n_layer=2", "model.net.n_head=4", "model.net.n_embd=32", "data.block_size=32",
                         "data.batch_size=4", "data.max_bytes=60000"),
        compile_gpt=dict(n_layer=2, n_head=4, n_embd=32, block_size=32, vocab_size=64, batch=4), compile_steps=6,
        llama=dict(layers=2, hidden=64, heads=4, kv_heads=2, vocab=256, seq=64, batch=4), mfu_steps=4,
        warmup_steps=2,
    ),
    "cuda": Sizes(
        budget_s=470, ranks_timeout_s=190, hydra_timeout_s=70, single_timeout_s=200, collective_timeout_s=60,
        parity_steps=20, hydra_steps=40,
        hydra_overrides=("model.net.n_layer=4", "model.net.n_head=8", "model.net.n_embd=256", "data.block_size=256",
                         "data.batch_size=16", "data.max_bytes=2000000"),
        compile_gpt=dict(n_layer=6, n_head=16, n_embd=1024, block_size=512, vocab_size=256, batch=8), compile_steps=25,
        llama=dict(layers=12, hidden=2048, heads=16, kv_heads=8, vocab=32000, seq=2048, batch=8), mfu_steps=10,
        warmup_steps=4,
    ),
}


# ------------------------------------------------------------------------------------------------ checks and results
@dataclass(frozen=True)
class Case:
    """One multi-rank training of the ``ranks`` group (a parity case, or the pretrained fine-tune)."""

    name: str  # unique: file names of its results
    check: str  # the summary row it belongs to
    model: str  # tests.support.models.build name, or "pretrained"
    dp: int
    mp: int
    pp: int = 1
    zero: int = 0
    sp: bool = False

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.mp

    @property
    def layout(self) -> str:
        return f"({self.dp},{self.pp},{self.mp})" if self.pp > 1 else f"({self.dp},{self.mp})"


#: The multi-rank cases by world size: the launch's 4 ranks run the first ones, then ranks 0 and 1 the others.
PHASES: dict[int, tuple[Case, ...]] = {
    4: (Case("gpt_2x2", "parity_2x2", "gpt", 2, 2),
        Case("gpt_2x2_zero3", "parity_2x2", "gpt", 2, 2, zero=3),
        Case("gpt_2x2_sp", "parity_2x2", "gpt", 2, 2, sp=True),
        Case("gpt_1x2x2_pp", "parity_pp", "gpt", 1, 2, pp=2)),
    2: (Case("gpt_1x2", "parity_1x2", "gpt", 1, 2),
        Case("gpt_2x1", "parity_2x1", "gpt", 2, 1),
        Case("llama_pretrained_1x2", "pretrained", "pretrained", 1, 2)),
}
CASES = [c for phase in PHASES.values() for c in phase]
RANK_CHECKS = ("gloo_cuda_probe",) + tuple(dict.fromkeys(c.check for c in CASES))
GROUPS: dict[str, tuple[str, ...]] = {
    "ranks": RANK_CHECKS,
    "hydra": ("hydra_train", "hydra_resume"),
    "single": ("mfu", "compile"),
}
CHECKS = [c for checks in GROUPS.values() for c in checks]


@dataclass
class Result:
    """What a check reports: ``status`` is ``pass``, ``fail`` or ``unsupported`` (the platform cannot run it)."""

    name: str
    status: str = "fail"
    summary: str = ""  # one line for the table
    error: str = ""  # why it did not pass (an assertion, a traceback's last line, a timeout)
    log: str = ""  # the log whose tail explains a failure (relative to the output folder)
    seconds: float = 0.0
    rows: list[dict[str, Any]] = field(default_factory=list)  # detail rows (parity cases, MFU runs, ...)
    figures: dict[str, Any] = field(default_factory=dict)

    def write(self, out: Path) -> None:
        (out / "results").mkdir(parents=True, exist_ok=True)
        (out / "results" / f"{self.name}.json").write_text(json.dumps(asdict(self), indent=1, default=str) + "\n")

    @staticmethod
    def read(out: Path, name: str) -> Optional[Result]:
        path = out / "results" / f"{name}.json"
        return Result(**json.loads(path.read_text())) if path.exists() else None


class CheckFailed(AssertionError):
    """A check's assertion, with a message meant for the summary."""


def require(ok: bool, message: str) -> None:
    """Raise :class:`CheckFailed` with ``message`` unless ``ok``."""
    if not ok:
        raise CheckFailed(message)


def run_check(out: Path, name: str, log: str, body: Callable[[Result], None]) -> Result:
    """Run ``body(result)`` and record it: ``pass`` unless it raises (the error and its traceback go to the log)."""
    result = Result(name, log=log)
    start = time.perf_counter()
    print(f"=== check {name}", flush=True)
    try:
        body(result)
        result.status = "pass"
    except Exception as err:  # (every failure is a result, and the next check still runs)
        traceback.print_exc()
        result.status = "unsupported" if result.status == "unsupported" else "fail"  # (the body may say so)
        result.error = f"{type(err).__name__}: {err}"[:2000]
    result.seconds = result.seconds or time.perf_counter() - start  # (a body may report the time it measured)
    result.write(out)
    print(f"=== check {name}: {result.status} ({result.seconds:.1f} s) {result.summary} {result.error}", flush=True)
    return result


def device_of(device: str) -> Any:
    import torch

    return torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")


def accelerator_of(device: str) -> str:
    return "gpu" if device == "cuda" else "cpu"


def make_step_timer(warmup: int) -> Any:
    """A Lightning callback recording each training step's wall time (the device synchronised around it), with
    ``median()`` over the steps after ``warmup``; made here so that this module imports without Lightning."""
    import lightning as L
    import torch

    class StepTimer(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.t0 = 0.0

        def _sync(self, trainer: Any) -> None:
            if trainer.strategy.root_device.type == "cuda":
                torch.cuda.synchronize(trainer.strategy.root_device)

        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            self._sync(trainer)
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            self._sync(trainer)
            self.times.append(time.perf_counter() - self.t0)

        def median(self) -> float:
            steady = sorted(self.times[warmup:] or self.times)
            return steady[len(steady) // 2]

    return StepTimer()


# ------------------------------------------------------------------------------------------ the multi-rank group
def expected_counts(case: Case, result: dict[str, Any]) -> tuple[dict[str, int], list[str]]:
    """The exact collectives of one training step on one rank (``{"group/op": n}``, the keys that must match), and
    the keys that need only be present, from the test suite's expectations for the same models (2 blocks)."""
    n_layers, mp = 2, case.mp
    exact: dict[str, int] = {}
    present: list[str] = []
    if case.model == "pretrained":  # tests/distributed/test_pretrained.py: the plan's all-reduces + the clip norm
        comm = result["comm"]
        exact["mp/all_reduce"] = comm["forward"]["all_reduce"] + comm["backward"]["all_reduce"] + 1
        return exact, present
    if case.pp > 1:  # tests/distributed/test_pipeline.py, 1F1B with M micro-batches, one block per stage
        from tests.distributed.pipeline_worker import MICROBATCHES as m

        stage = result["grid"][1]
        exact["pp/send"] = exact["pp/recv"] = m * ((stage < case.pp - 1) + (stage > 0))
        exact["pp/all_reduce"] = 2  # the clipping norm; GPT's tied table and head summed over their two stages
        exact["pp/broadcast"] = 1  # the logged values, from the last stage
        return exact, present  # (MP: each pipeline's total, checked across its ranks in check_case)
    if case.sp:  # test_transformer_parity.py: 2 AG + 2 RS per block each way, embedding, head, loss, clip, SP sum
        exact.update({"mp/all_reduce": 4, "mp/all_gather": 4 * n_layers + 3, "mp/reduce_scatter": 4 * n_layers + 2})
    elif mp > 1:  # 2 all-reduces forward and 2 backward per block, embedding 1, vocab-parallel loss 2, head 1, clip 1
        exact["mp/all_reduce"] = n_layers * 4 + 1 + 2 + 1 + 1
    if case.zero == 3:  # test_zero.py: 3 units (2 blocks + the root): one reduce-scatter each; the root gathered
        # once, each block for its forward and again for its backward; the clipping norm's all-reduce
        exact.update({"dp/reduce_scatter": 3, "dp/all_gather": 1 + 2 * 2, "dp/all_reduce": 1})
    elif case.dp > 1 and mp > 1:
        present.append("dp/all_reduce")  # test_transformer_parity.py: >= 1 over DP (DDP's own buckets are C++)
    # mp = 1 (test_parity.py): no MP collective at all; the world group's clipping norm is counted as "world"
    return exact, present


#: The collectives the library issues (layers, ZeRO, checkpoints, the pipeline), probed on the device over gloo.
PROBED_OPS = ("all_reduce", "all_gather", "broadcast", "all_gather_into_tensor", "reduce_scatter",
              "reduce_scatter_tensor", "gather", "send_recv")
BASIC_OPS = ("all_reduce", "all_gather", "broadcast")  # without these no multi-rank check can run


def probe_gloo(device: str, store: Path, rank: int, world: int) -> dict[str, str]:
    """Each of :data:`PROBED_OPS` on tensors of ``device`` over gloo (a file store: no port): ``{op: "ok" | why}``."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    dev = device_of(device)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))  # (the ranks may start seconds apart)

    def full(n: int, v: float) -> Any:
        return torch.full((n,), float(v), device=dev)

    total = world * (world + 1) / 2  # the sum of rank + 1 over the ranks

    def all_reduce() -> bool:
        t = full(4, rank + 1)
        dist.all_reduce(t)
        return t.tolist() == [total] * 4

    def all_gather() -> bool:
        parts = [full(2, -1) for _ in range(world)]
        dist.all_gather(parts, full(2, rank))
        return [p.tolist() for p in parts] == [[float(r)] * 2 for r in range(world)]

    def broadcast() -> bool:
        t = full(2, rank)
        dist.broadcast(t, src=world - 1)
        return t.tolist() == [float(world - 1)] * 2

    def all_gather_into_tensor() -> bool:
        out = full(2 * world, -1)
        dist.all_gather_into_tensor(out, full(2, rank))
        return out.tolist() == [float(r) for r in range(world) for _ in range(2)]

    def reduce_scatter() -> bool:
        out = full(2, -1)
        dist.reduce_scatter(out, [full(2, rank + 1) for _ in range(world)])
        return out.tolist() == [total] * 2

    def reduce_scatter_tensor() -> bool:
        out = full(2, -1)
        dist.reduce_scatter_tensor(out, full(2 * world, rank + 1))
        return out.tolist() == [total] * 2

    def gather() -> bool:
        parts = [full(2, -1) for _ in range(world)] if rank == 0 else None
        dist.gather(full(2, rank), parts, dst=0)
        return rank != 0 or [p.tolist() for p in parts or []] == [[float(r)] * 2 for r in range(world)]

    def send_recv() -> bool:
        peer = rank ^ 1  # pairs (0, 1), (2, 3)
        got = full(2, -1)
        reqs = [dist.isend(full(2, rank), peer), dist.irecv(got, peer)]
        for req in reqs:
            if req is not None:
                req.wait()
        return got.tolist() == [float(peer)] * 2

    checks: dict[str, Callable[[], bool]] = {
        "all_reduce": all_reduce, "all_gather": all_gather, "broadcast": broadcast,
        "all_gather_into_tensor": all_gather_into_tensor, "reduce_scatter": reduce_scatter,
        "reduce_scatter_tensor": reduce_scatter_tensor, "gather": gather, "send_recv": send_recv}
    report: dict[str, str] = {}
    try:
        for op in PROBED_OPS:
            try:
                report[op] = "ok" if checks[op]() else "wrong values"
            except Exception as err:  # (unsupported here: reported per operation)
                report[op] = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
    finally:
        dist.destroy_process_group()
    return report


def _rank_trainer(case: Case, device: str, sizes: Sizes, callbacks: list) -> Any:
    """The Trainer of one case: every rank on the same device over gloo (``parallel_devices``, ``devices=1``)."""
    from datetime import timedelta

    import lightning as L

    from lightning_dpmp import DPMPStrategy
    from tests.distributed.parity_worker import CLIP
    from tests.distributed.pipeline_worker import MICROBATCHES

    pipeline: dict[str, Any] = dict(pp=case.pp, pp_microbatches=MICROBATCHES, pp_schedule="1f1b") if case.pp > 1 else {}
    strategy = DPMPStrategy(dp=case.dp, mp=case.mp, zero=case.zero, sequence_parallel=case.sp, **pipeline,
                            parallel_devices=[device_of(device)] * case.world, process_group_backend="gloo",
                            timeout=timedelta(seconds=sizes.collective_timeout_s))
    return L.Trainer(accelerator=accelerator_of(device), devices=1, strategy=strategy, precision="64-true",
                     max_steps=sizes.parity_steps, gradient_clip_val=CLIP, gradient_clip_algorithm="norm",
                     logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     callbacks=callbacks)


def run_case(case: Case, device: str, sizes: Sizes, work: Path) -> dict[str, Any]:
    """Train one case in this rank; rank 0 saves the consolidated checkpoint (``work/<case>.ckpt``)."""
    import lightning as L
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from lightning_dpmp.integration.accounting import CommCounter
    from tests.distributed.parity_worker import GLOBAL_BATCH, SEED
    from tests.distributed.pipeline_worker import Counter

    class WorldCounter(Counter):
        """pipeline_worker's counter of one step (step 3), also naming the world group (mp=1's clipping norm)."""

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step == self.step:
                grid = trainer.strategy.grid
                mode: Any = CommCounter({"world": dist.group.WORLD, "mp": grid.mp_group, "dp": grid.dp_group,
                                         "pp": grid.pp_group})  # (a group that is also the world keeps its name)
                self.mode = mode
                mode.__enter__()

    L.seed_everything(SEED, workers=True)
    counter = WorldCounter()
    record: dict[str, Any] = {}
    if case.model == "pretrained":
        import lightning_dpmp
        from tests.distributed.pretrained_worker import AfterLoad
        from tests.support import pretrained as P

        path = str(work / "pretrained" / "llama")
        probe = AfterLoad(path, str(work / f"{case.name}_export"))
        trainer = _rank_trainer(case, device, sizes, [counter, probe])
        net = lightning_dpmp.from_pretrained(P.model_class("llama"), path)  # after the Trainer: read lazily
        record["lazy"] = all(p.is_meta for p in net.parameters())
        model, dataset = P.lightning_module("llama", net), P.dataset()
    else:
        from tests.support.models import build

        trainer = _rank_trainer(case, device, sizes, [counter])
        model, dataset = build(case.model)
    trainer.fit(model, DataLoader(dataset, batch_size=GLOBAL_BATCH // case.dp))
    trainer.save_checkpoint(str(work / f"{case.name}.ckpt"))
    strategy = trainer.strategy
    plan = strategy.applied_plan.plan
    grid = strategy.grid
    record.update(counts=counter.counts, comm=plan.comm_per_step(), verified=strategy.applied_plan.verified,
                  grid=[grid.dp_rank, grid.pp_rank, grid.mp_rank], root_device=str(strategy.root_device),
                  per_block=plan.per_block(), backend=str(strategy.process_group_backend))
    if case.model == "pretrained":
        record.update(load_diff=probe.load_diff, split_tensors=probe.read.get("split_tensors", 0))
    return record


def rank_main(device: str, out: Path, ports: list[int]) -> int:
    """A rank of the ``ranks`` group's launch: the gloo probe, then every case it takes part in (the 4-rank cases,
    then, on ranks 0 and 1, the 2-rank ones), each in its own process group on its own port (``ports[i]`` for
    ``CASES[i]``). A case that raises is recorded with its error and its process group destroyed, and the next case
    still runs; peers left waiting in a collective fail at ``collective_timeout_s`` (gloo notices a closed peer
    only when its process ends: measured here, an error on one rank cost the others the whole timeout) and go on
    too. Each record goes to ``work/ranks/<case>.rank<r>.json`` when its case ends."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    sizes, work = SIZES[device], out / "work" / "ranks"
    rank, world = int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    t0 = time.perf_counter()
    try:
        probe = probe_gloo(device, work / "probe_store", rank, world)
    except Exception as err:  # (reported as the probe's result: the platform cannot do it)
        probe = {op: f"{type(err).__name__}: {err}" for op in PROBED_OPS}
    seconds = time.perf_counter() - t0
    (work / f"probe.rank{rank}.json").write_text(json.dumps({"ops": probe, "seconds": seconds}))
    print(f"=== gloo probe: {probe} in {seconds:.1f} s, {time.perf_counter() - START:.1f} s after the start",
          flush=True)
    if any(probe[op] != "ok" for op in BASIC_OPS):
        return 3
    for case, port in zip(CASES, ports):
        if rank >= case.world:
            continue
        os.environ.update(WORLD_SIZE=str(case.world), MASTER_PORT=str(port))
        (work / f"current.rank{rank}").write_text(case.name)
        t0 = time.perf_counter()
        try:
            record = run_case(case, device, sizes, work)
        except Exception as err:  # (the case's result: the others still run)
            traceback.print_exc()
            record = {"error": f"{type(err).__name__}: {err}"[:1500]}
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        record["seconds"] = time.perf_counter() - t0
        print(f"=== case {case.name} {'FAILED' if 'error' in record else 'done'} in {record['seconds']:.1f} s",
              flush=True)
        (work / f"{case.name}.rank{rank}.json").write_text(json.dumps(record, default=str))
    return 0


def free_port() -> int:
    """A TCP port that was free a moment ago on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_ranks(device: str, out: Path, world: int) -> list[subprocess.Popen]:
    """Start ``world`` rank processes as an external launcher would (``LOCAL_RANK``, ``WORLD_SIZE``, ...): Lightning
    then starts no children. Their output goes to ``logs/rank<r>.log``."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world),
           "NODE_RANK": "0", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    for var in ("RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):  # not a torchrun job
        env.pop(var, None)
    ports = ",".join(str(free_port()) for _ in CASES)  # one per case: a case never reuses a closing store's port
    procs = []
    for r in range(world):
        log = open(out / "logs" / f"rank{r}.log", "w")  # (closed when the process ends)
        procs.append(subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "rank", "--device", device, "--out", str(out),
             "--ports", ports], cwd=ROOT, env={**env, "LOCAL_RANK": str(r)}, stdout=log, stderr=subprocess.STDOUT))
    return procs


def wait_ranks(procs: list[subprocess.Popen], deadline: float, grace_s: float = 15.0) -> list[Optional[int]]:
    """Wait for every rank; once one fails, the others get ``grace_s`` (they may sit in a collective), then all
    left are killed, as at the deadline. Returns the exit codes (``None``: killed)."""
    failed_at: Optional[float] = None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now - failed_at > grace_s):
            break
        time.sleep(0.2)
    codes: list[Optional[int]] = []
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
            codes.append(None)
        else:
            codes.append(p.returncode)
    return codes


def _pretrained_reference(folder: Path, steps: int) -> dict[str, Any]:
    """One process on the CPU, transformers' own ``from_pretrained``: the oracle of the pretrained case (as
    ``tests/distributed/test_pretrained.py`` trains it)."""
    import lightning as L

    from tests.distributed.parity_worker import CLIP, GLOBAL_BATCH, SEED
    from tests.support import pretrained as P
    from tests.support.models import reference_loader
    from tests.support.reference import one_process_trainer

    L.seed_everything(SEED, workers=True)
    model = P.lightning_module("llama", P.model_class("llama").from_pretrained(str(folder)))
    trainer = one_process_trainer(max_steps=steps, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
    trainer.fit(model, reference_loader(P.dataset(), GLOBAL_BATCH, SEED))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _max_diff(ours: dict[str, Any], ref: dict[str, Any]) -> float:
    require(ours.keys() == ref.keys(), f"state_dict keys differ: {sorted(set(ours) ^ set(ref))[:6]}")
    return max((ours[k].cpu().double() - ref[k].cpu().double()).abs().max().item() for k in ref)


def check_case(case: Case, records: list[dict[str, Any]], ref: dict[str, Any], work: Path, device: str
               ) -> dict[str, Any]:
    """Compare one case's ranks with the reference: weights, collectives, devices. Returns its detail row; raises
    :class:`CheckFailed` naming what differs."""
    import torch

    errors = {r: rec["error"] for r, rec in enumerate(records) if "error" in rec}
    if errors:  # the cause: the first error that is not a peer's timeout or closed connection
        cause = next((r for r, e in errors.items() if not re.search(r"Timed out|timed out|closed|Connection", e)),
                     next(iter(errors)))
        return {"case": case.name, "layout": case.layout, "zero": case.zero, "sp": case.sp,
                "max_abs_diff": float("nan"), "counts_rank0": {}, "seconds": records[0]["seconds"], "ok": False,
                "log": f"logs/rank{cause}.log", "problems": [f"rank {r}: {e}" for r, e in errors.items()]}
    ckpt = torch.load(work / f"{case.name}.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    worst = _max_diff(ckpt, ref)
    row: dict[str, Any] = {"case": case.name, "layout": case.layout, "zero": case.zero, "sp": case.sp,
                           "max_abs_diff": worst}
    problems = []
    if worst > PARITY_TOL:
        problems.append(f"max |w - w_ref| = {worst:.2e} > {PARITY_TOL:.0e}")
    for r, rec in enumerate(records):
        if not rec["root_device"].startswith(device_of(device).type):
            problems.append(f"rank {r} trained on {rec['root_device']}")
        if rec["verified"] is not True and case.mp > 1 and case.model != "pretrained":  # (lazy weights: None)
            problems.append(f"rank {r}: plan not verified ({rec['verified']})")
        exact, present = expected_counts(case, rec)
        got = rec["counts"]
        wrong: dict[str, tuple[Any, Any]] = {k: (got.get(k, 0), n) for k, n in exact.items() if got.get(k, 0) != n}
        wrong.update({k: (0, ">=1") for k in present if got.get(k, 0) < 1})
        if case.pp == 1 and case.model != "pretrained":  # nothing else on MP than the expected collectives
            wrong.update({k: (n, 0) for k, n in got.items() if k.startswith("mp/") and k not in exact})
        if wrong:
            problems.append(f"rank {r} collectives (got, want): {wrong}")
    if case.pp > 1:  # each pipeline's MP all-reduces: M x the plan's + the clipping norm once per stage
        from tests.distributed.pipeline_worker import MICROBATCHES as m

        for mp_rank in range(case.mp):
            pipe = [rec for rec in records if rec["grid"][2] == mp_rank]
            planned = pipe[0]["comm"]["forward"]["all_reduce"] + pipe[0]["comm"]["backward"]["all_reduce"]
            total = sum(rec["counts"].get("mp/all_reduce", 0) for rec in pipe)
            if total != m * planned + case.pp:
                problems.append(f"pipeline mp_rank {mp_rank}: {total} MP all-reduces, want {m * planned + case.pp}")
    if case.model == "pretrained":
        from transformers import LlamaForCausalLM

        for r, rec in enumerate(records):
            if not rec.get("lazy") or rec.get("load_diff") != 0.0 or not rec.get("split_tensors"):
                problems.append(f"rank {r}: lazy={rec.get('lazy')}, load diff={rec.get('load_diff')},"
                                f" split tensors={rec.get('split_tensors')} (want True, 0.0, > 0)")
            block = rec["per_block"].get("net.model.layers.1", {})
            if block.get("forward", {}).get("all_reduce") != 2 or block.get("backward", {}).get("all_reduce") != 2:
                problems.append(f"rank {r}: a block costs {block}, want 2 + 2 all-reduces")
        back = LlamaForCausalLM.from_pretrained(str(work / f"{case.name}_export")).state_dict()
        exported = max((v.double() - ckpt[f"net.{k}"].double()).abs().max().item() for k, v in back.items())
        row["export_diff"] = exported
        if exported != 0.0:
            problems.append(f"the save_pretrained export loads back {exported:.2e} from the trained weights")
    row["counts_rank0"] = records[0]["counts"]
    row["seconds"] = records[0]["seconds"]
    row["ok"] = not problems
    row["problems"] = problems
    return row


def group_ranks(device: str, out: Path) -> None:
    """The multi-rank checks: launch the ranks, train the references meanwhile, compare, write one result per
    check (``gloo_cuda_probe``, ``parity_*``, ``pretrained``)."""
    import torch

    torch.set_num_threads(1)
    sizes, work = SIZES[device], out / "work" / "ranks"
    start = time.monotonic()
    deadline = start + sizes.ranks_timeout_s - 15  # leave time to compare and report
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    from tests.support import pretrained as P

    P.save("llama", str(work / "pretrained"))  # before the launch: the ranks read it
    world = max(PHASES)
    procs = launch_ranks(device, out, world)
    from tests.support.reference import reference_run

    try:
        refs: dict[str, Any] = {
            "gpt": reference_run("gpt", "64-true", work / "ref_gpt.ckpt", max_steps=sizes.parity_steps)["state_dict"],
            "pretrained": _pretrained_reference(work / "pretrained" / "llama", sizes.parity_steps)}
    except BaseException:
        for proc in procs:  # no reference, nothing to compare with: stop the ranks
            proc.kill()
        raise
    print(f"references trained in {time.monotonic() - start:.1f} s", flush=True)
    codes = wait_ranks(procs, deadline)
    print(f"ranks exited with {codes} after {time.monotonic() - start:.1f} s", flush=True)

    probes = [json.loads(p.read_text()) if p.exists() else None
              for p in (work / f"probe.rank{r}.json" for r in range(world))]
    broken = {op: why for pr in probes if pr is not None for op, why in pr["ops"].items() if why != "ok"}
    probe_ok = all(pr is not None for pr in probes) and not any(op in broken for op in BASIC_OPS)
    probe_error = "; ".join(f"{op}: {why}" for op, why in broken.items()) or "a rank did not report"
    failed_rank = next((r for r, c in enumerate(codes) if c not in (0, None)), None)

    def probe_body(res: Result) -> None:
        res.figures = {"ops": {op: broken.get(op, "ok") for op in PROBED_OPS}}
        res.seconds = max((pr["seconds"] for pr in probes if pr is not None), default=0.0)
        if any(pr is None for pr in probes):
            raise CheckFailed(f"a rank did not report its probe (exit codes {codes})")
        if broken:
            res.status = "unsupported"
            raise CheckFailed(f"gloo with {device} tensors: {probe_error}")
        res.summary = f"{', '.join(PROBED_OPS)} of {device} tensors over gloo: {world} ranks, one device"

    run_check(out, "gloo_cuda_probe", "logs/rank0.log", probe_body)

    for check in dict.fromkeys(c.check for c in CASES):
        cases = [c for c in CASES if c.check == check]

        def body(res: Result, cases: list[Case] = cases) -> None:
            res.log = f"logs/rank{failed_rank if failed_rank is not None else 0}.log"
            if not probe_ok:
                res.status = "unsupported"
                raise CheckFailed(f"not run: gloo does not carry {device} tensors here ({probe_error})")
            problems: list[str] = []
            cause_logs: list[str] = []  # per compared case: the log of its failing rank ("" when none failed)
            for case in cases:
                paths = [work / f"{case.name}.rank{r}.json" for r in range(case.world)]
                if not all(p.exists() for p in paths):
                    current = [(work / f"current.rank{r}").read_text() if (work / f"current.rank{r}").exists()
                               else "?" for r in range(case.world)]
                    problems.append(f"{case.name}: did not finish (rank exit codes {codes}, None = killed at the"
                                    f" time limit or after another rank failed; cases running: {current})")
                    continue
                try:
                    row = check_case(case, [json.loads(p.read_text()) for p in paths], refs[
                        "pretrained" if case.model == "pretrained" else case.model], work, device)
                except Exception as err:  # (e.g. no checkpoint written): this case's problem, not the others'
                    traceback.print_exc()
                    problems.append(f"{case.name}: could not be compared: {type(err).__name__}: {err}")
                    continue
                res.rows.append(row)
                res.seconds += row["seconds"]
                problems += [f"{case.name}: {p}" for p in row["problems"]]
                cause_logs.append(row.get("log", ""))
            res.summary = "max abs(w - w_ref): " + ", ".join(
                f"{r['case']} {r['max_abs_diff']:.1e}" for r in res.rows)
            if res.rows and all(r["ok"] for r in res.rows):
                res.summary += f" (<= {PARITY_TOL:.0e}); collectives of a step exact"
            res.log = next((log for log in cause_logs if log), res.log)  # the first failing case's cause
            require(not problems, " | ".join(problems))

        run_check(out, check, "logs/rank0.log", body)


# ------------------------------------------------------------------------------------------------- Hydra (no torch)
def _train_py(device: str, run_dir: Path, steps: int, extra: list[str], log: Path, timeout: float) -> dict[str, Any]:
    """Run ``examples/train.py`` at world size 1 in bf16-mixed; return its ``summary.json``."""
    sizes = SIZES[device]
    cmd = [sys.executable, "examples/train.py", f"trainer={'gpu' if device == 'cuda' else 'cpu'}",
           "trainer.precision=bf16-mixed", "strategy.dp=1", "strategy.mp=1", *sizes.hydra_overrides,
           f"trainer.max_steps={steps}", f"trainer.val_check_interval={sizes.hydra_steps}",
           "trainer.limit_val_batches=2", "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false",
           "trainer.enable_model_summary=false", "scheduler.warmup_steps=2", "summary_warmup_steps=1",
           "callbacks=default", "logger=csv", f"hydra.run.dir={run_dir}", *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    with open(log, "w") as f:
        f.write("+ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    summary_path = run_dir / "summary.json"
    require(proc.returncode == 0, f"examples/train.py exited {proc.returncode}")
    require(summary_path.exists(), f"no {summary_path}")
    summary = json.loads(summary_path.read_text())
    require(summary.get("status") == "ok", f"summary status {summary.get('status')}: {summary.get('error')}")
    train_log = (run_dir / "train.log").read_text() if (run_dir / "train.log").exists() else ""
    backend = re.findall(r"distributed_backend=(\w+)", train_log + log.read_text())
    summary["backend"] = backend[-1] if backend else "?"
    return summary


def group_hydra(device: str, out: Path, deadline: float) -> None:
    """``hydra_train`` (NCCL at world size 1 on CUDA, bf16-mixed, a save) and ``hydra_resume`` (from that save)."""
    sizes, work = SIZES[device], out / "work" / "hydra"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    n = sizes.hydra_steps
    first: dict[str, Any] = {}
    want_backend = "nccl" if device == "cuda" else "gloo"

    def timeout() -> float:
        return max(5.0, min(sizes.hydra_timeout_s, deadline - time.monotonic()))

    def train(res: Result) -> None:
        s = _train_py(device, work / "train", n, [], out / "logs" / "hydra_train.log", timeout())
        first.update(s)
        last = work / "train" / "checkpoints" / "last.ckpt"
        require(last.exists(), f"no {last}")
        require((s.get("steps"), s.get("timed_steps")) == (n, n - 1), f"trained {s.get('steps')} steps, want {n}")
        require(s["backend"] == want_backend, f"process group backend {s['backend']}, want {want_backend}")
        res.figures = {k: s.get(k) for k in ("tokens_per_s", "first_loss", "final_loss", "peak_mem_mb", "backend")}
        res.summary = (f"{s['backend']} at world size 1, bf16-mixed, {n} steps, loss {s['first_loss']:.2f} ->"
                       f" {s['final_loss']:.2f}, {s['tokens_per_s']:.0f} tokens/s, last.ckpt saved")

    def resume(res: Result) -> None:
        last = work / "train" / "checkpoints" / "last.ckpt"
        require(bool(first) and last.exists(), "hydra_train did not save a checkpoint to resume from")
        s = _train_py(device, work / "resume", 2 * n, [f"ckpt_path={last}"], out / "logs" / "hydra_resume.log",
                      timeout())
        # the global step goes on from the checkpoint's; only the remaining n batches ran (1 of them untimed)
        require((s.get("steps"), s.get("timed_steps")) == (2 * n, n - 1),
                f"the resumed run ended at step {s.get('steps')} after {s.get('timed_steps')} + 1 batches, want step"
                f" {2 * n} after the remaining {n} batches")
        # from the checkpoint, the first step's loss is near where the first run ended, well below a fresh start
        require(s["first_loss"] < first["first_loss"] - 0.5 * (first["first_loss"] - first["final_loss"]),
                f"resumed first loss {s['first_loss']:.3f}: not below the midpoint of the first run"
                f" ({first['first_loss']:.3f} -> {first['final_loss']:.3f}); the weights were not restored?")
        res.figures = {k: s.get(k) for k in ("first_loss", "final_loss", "backend")}
        res.summary = (f"resumed at step {n} -> {2 * n}: first loss {s['first_loss']:.2f} (the first run ended at"
                       f" {first['final_loss']:.2f}, began at {first['first_loss']:.2f}), final {s['final_loss']:.2f}")

    run_check(out, "hydra_train", "logs/hydra_train.log", train)
    run_check(out, "hydra_resume", "logs/hydra_resume.log", resume)


# ------------------------------------------------------------------------------------------ the single-process group
def _fit_timed(device: str, module: Any, loader: Any, strategy: Any, precision: Any, steps: int, warmup: int,
               callbacks: tuple = ()) -> tuple[float, list[float]]:
    """``Trainer.fit`` at world size 1; the median step time after ``warmup`` steps, and each step's time."""
    import lightning as L

    timer = make_step_timer(warmup)
    trainer = L.Trainer(accelerator=accelerator_of(device), devices=1, strategy=strategy, precision=precision,
                        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[timer, *callbacks])
    trainer.fit(module, loader)
    return timer.median(), list(timer.times)


def _release(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def check_compile(device: str, out: Path) -> None:
    """``compile``: DPMPStrategy(compile=True) against eager at world size 1, float32."""
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from examples.models.gpt import GPT
    from lightning_dpmp import DPMPStrategy

    sizes = SIZES[device]
    g: dict[str, Any] = dict(sizes.compile_gpt)
    batch = g.pop("batch")
    steps = sizes.compile_steps

    class LM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            # no biases: a key bias has an exactly-zero gradient, whose float32 rounding noise AdamW turns into
            # lr-sized steps that differ between any two kernels (tests/support/models.py, FusedBlock)
            self.net = GPT(dropout=0.0, bias=False, **g)

        def training_step(self, b: Any, i: int) -> Any:
            logits = self.net(b[0])
            return F.cross_entropy(logits.reshape(-1, logits.size(-1)), b[1].reshape(-1))

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, g["vocab_size"], (batch * steps, g["block_size"] + 1), generator=gen)
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=batch)

    class Blocks(L.Callback):
        """How many blocks carry a compiled forward while training."""
        compiled = 0

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            self.compiled = sum("_dpmp_compiled" in vars(m) for m in pl_module.modules())

    def body(res: Result) -> None:
        times, weights, compiled_blocks, step_ms = {}, {}, {}, {}
        for compiled in (False, True):
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            L.seed_everything(0, verbose=False)
            module = LM()
            blocks = Blocks()
            strategy = DPMPStrategy(dp=1, mp=1, compile=compiled, consolidate_on_teardown=True)
            times[compiled], each = _fit_timed(device, module, loader, strategy, "32-true", steps,
                                               sizes.warmup_steps, (blocks,))
            step_ms[compiled] = [round(t * 1e3, 2) for t in each]
            compiled_blocks[compiled] = blocks.compiled
            weights[compiled] = {k: v.detach().float().cpu() for k, v in module.state_dict().items()}
            breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
            del module
            _release(device)
        distance = _max_diff(weights[True], weights[False])
        res.figures = {"eager_step_ms": times[False] * 1e3, "compiled_step_ms": times[True] * 1e3,
                       "speedup": times[False] / times[True], "max_weight_distance": distance,
                       "compiled_blocks": compiled_blocks[True], "graph_breaks": breaks, "steps": steps,
                       "eager_each_step_ms": step_ms[False], "compiled_each_step_ms": step_ms[True]}
        res.summary = (f"eager {times[False] * 1e3:.2f} ms, compiled {times[True] * 1e3:.2f} ms per step"
                       f" ({times[False] / times[True]:.2f}x); max abs(w_c - w_e) {distance:.1e} after {steps} float32"
                       f" steps; {compiled_blocks[True]} blocks compiled, {breaks} graph breaks")
        require(compiled_blocks[True] == g["n_layer"] and compiled_blocks[False] == 0,
                f"compiled blocks {compiled_blocks}, want {g['n_layer']} under compile=True and none eager")
        require(breaks == 0, f"{breaks} graph breaks")
        require(distance <= COMPILE_TOL, f"compiled weights {distance:.2e} from eager > {COMPILE_TOL:.0e}")

    run_check(out, "compile", "logs/single.log", body)


def peak_tflops(device_name: str) -> tuple[Optional[float], str]:
    """The dense bf16 peak of :data:`PEAK_BF16_TFLOPS` whose key the device's name contains, and that key."""
    for key, peak in PEAK_BF16_TFLOPS.items():
        if key.lower() in device_name.lower():
            return peak, key
    return None, ""


def llama_flops_per_token(model: Any, layers: int, hidden: int, seq: int) -> float:
    """Model FLOPs per trained token: 6 x the parameters that take part in matmuls (all but the input embedding,
    a lookup) + Megatron's attention term 12 x layers x hidden x sequence (scores and values, forward and backward);
    recomputation is not counted (none here)."""
    embed = model.get_input_embeddings().weight.numel()
    params = sum(p.numel() for p in model.parameters()) - embed
    return 6.0 * params + 12.0 * layers * hidden * seq


def check_mfu(device: str, out: Path) -> None:
    """``mfu``: the benchmark Llama in bf16-mixed at world size 1 under DPMPStrategy(dp=1, mp=1) and under plain
    Lightning (``strategy="auto"``), one after the other: tokens/s, their ratio, and the model FLOP utilisation."""
    import gpt_bench  # benchmarks/ is this file's folder
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from lightning_dpmp import DPMPStrategy
    from tests.support.models import make_lm_dataset

    sizes = SIZES[device]
    cfg = dict(sizes.llama)
    batch = cfg.pop("batch")
    args = argparse.Namespace(model="hf_llama", **cfg)
    steps = sizes.warmup_steps + sizes.mfu_steps
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    peak, key = peak_tflops(name)

    def body(res: Result) -> None:
        ds = make_lm_dataset(n=batch * steps, vocab=cfg["vocab"], seq=cfg["seq"], seed=1)
        loader = DataLoader(ds, batch_size=batch, shuffle=False, drop_last=True)
        tokens_per_step = batch * cfg["seq"]
        flops = 0.0
        runs: dict[str, float] = {}
        for kind in ("lightning", "dpmp"):
            L.seed_everything(0, verbose=False)
            module = gpt_bench._hf_llama_module(args, "dpmp")
            flops = llama_flops_per_token(module.net, cfg["layers"], cfg["hidden"], cfg["seq"])
            strategy: Any = "auto" if kind == "lightning" else DPMPStrategy(dp=1, mp=1)
            step_s, _ = _fit_timed(device, module, loader, strategy, "bf16-mixed", steps, sizes.warmup_steps)
            runs[kind] = tokens_per_step / step_s
            del module
            _release(device)
        for kind, tps in runs.items():
            achieved = tps * flops / 1e12
            res.rows.append({"run": "DPMPStrategy(dp=1, mp=1)" if kind == "dpmp" else "Lightning strategy='auto'",
                             "tokens_per_s": tps, "tflops": achieved,
                             "mfu": achieved / peak if peak else None, "estimator_prediction": "n/a"})
        mfu = res.rows[1]["mfu"]
        ratio = runs["dpmp"] / runs["lightning"]
        res.figures = {"device": name, "peak_bf16_tflops": peak, "peak_key": key, "flops_per_token": flops,
                       "tokens_per_step": tokens_per_step, "dpmp_over_lightning": ratio, "mfu": mfu,
                       "model": {**cfg, "batch": batch}, "estimator_prediction": "n/a (no pre-flight estimator yet)"}
        mfu_text = f"MFU {mfu:.1%} of {peak:.0f} TFLOP/s ({key})" if mfu is not None else f"MFU n/a ({name}?)"
        res.summary = (f"DPMP {runs['dpmp']:.0f} tokens/s, {res.rows[1]['tflops']:.3g} TFLOP/s, {mfu_text};"
                       f" plain Lightning {runs['lightning']:.0f} tokens/s: ratio {ratio:.3f}; estimator n/a")
        require(mfu is None or 0.0 < mfu < 1.0, f"MFU {mfu} outside (0, 1): the FLOP count or the timing is wrong")

    run_check(out, "mfu", "logs/single.log", body)


def group_single(device: str, out: Path) -> None:
    """``mfu`` then ``compile`` in this process (world size 1: NCCL on CUDA, gloo on the CPU)."""
    import torch

    if device == "cpu":
        torch.set_num_threads(1)
    # pinned, so that Lightning's DDP setup (DPMPStrategy) does not change it between the two runs it compares
    os.environ["OMP_NUM_THREADS"] = str(torch.get_num_threads())
    check_mfu(device, out)  # first: the timing of plain Lightning and DPMP before any compile worker exists
    check_compile(device, out)


# ---------------------------------------------------------------------------------------------- orchestration
def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no log at {path})"


def _run_group(name: str, device: str, out: Path, timeout: float) -> tuple[Optional[int], float]:
    """Run ``group NAME`` in a new session (its rank processes too): killed as a whole past ``timeout``."""
    log = out / "logs" / f"{name}.log"
    start = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "group", name, "--device", device,
                                 "--out", str(out)], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"},
                                start_new_session=True)
        try:
            code: Optional[int] = proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            code = None
        try:  # the group's leftovers too (rank processes of a group that died or was stopped)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    return code, time.monotonic() - start


def report_failure(out: Path, res: Result) -> None:
    """The failing check's name, why, and its log's tail, on stderr."""
    sys.stderr.write(f"\n!! check '{res.name}' {res.status.upper()}: {res.error}\n")
    if res.log:
        sys.stderr.write(f"-- last lines of {out / res.log}:\n{_tail(out / res.log)}\n")
    sys.stderr.flush()


def run_all(device: str, out: Path) -> int:
    """Every group in turn within the time budget; one result per check (a check that never reported is a failure
    naming its group's exit); failures reported as they come; ``summary.md``; 0 when every check passed."""
    sizes = SIZES[device]
    start = time.monotonic()
    deadline = start + sizes.budget_s
    for sub in ("results", "logs"):
        shutil.rmtree(out / sub, ignore_errors=True)
        (out / sub).mkdir(parents=True, exist_ok=True)
    limits = {"ranks": sizes.ranks_timeout_s, "single": sizes.single_timeout_s}
    for group, checks in GROUPS.items():
        left = deadline - time.monotonic()
        print(f"--- {group}: {', '.join(checks)} ({left:.0f} s of the budget left)", flush=True)
        code: Optional[int] = 0
        took = 0.0
        why = "did not report it"
        if left < 10:
            code, why = None, "not started: the time budget was spent"
        elif group == "hydra":
            t0 = time.monotonic()
            try:
                group_hydra(device, out, deadline)
            except Exception as err:  # (each check catches its own; this is the group's own code failing)
                traceback.print_exc()
                why = f"failed: {type(err).__name__}: {err}"
            took = time.monotonic() - t0
        else:
            code, took = _run_group(group, device, out, min(limits[group], left))
            why = f"its process was killed at the {min(limits[group], left):.0f} s limit" if code is None else (
                f"its process exited {code} before reporting it")
        for check in checks:
            res = Result.read(out, check)
            if res is None:
                res = Result(check, error=f"did not run: group '{group}' {why}", log=f"logs/{group}.log")
                res.write(out)
            print(f"    {check:16s} {res.status:11s} {res.seconds:6.1f} s  {res.summary or res.error}"[:400],
                  flush=True)
            if res.status != "pass":
                report_failure(out, res)
        print(f"--- {group} done in {took:.1f} s", flush=True)
    total = time.monotonic() - start
    text = write_summary(device, out, total)
    print("\n" + text, flush=True)
    if os.environ.get("GPU_CHECK_KEEP") != "1":
        shutil.rmtree(out / "work", ignore_errors=True)
    results = [Result.read(out, c) for c in CHECKS]
    return 0 if all(r is not None and r.status == "pass" for r in results) else 1


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def write_summary(device: str, out: Path, total_s: float) -> str:
    """``summary.md``: the device, one table with a row per check, and the detail tables."""
    results = [Result.read(out, c) or Result(c, error="no result") for c in CHECKS]
    device_txt = (out / "device.txt").read_text().strip() if (out / "device.txt").exists() else device
    passed = sum(r.status == "pass" for r in results)
    lines = [f"# GPU check ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, --device {device}"
             f"{', dry mode: tiny sizes' if device == 'cpu' else ''})", "", device_txt, "",
             f"**{passed} of {len(results)} checks passed** in {total_s:.0f} s.", "",
             "| check | status | result | s |", "|---|---|---|---:|"]
    for r in results:
        text = r.summary if r.status == "pass" else f"{r.error} {r.summary}".strip()
        text = text.replace("|", "/").replace("\n", " ")
        lines.append(f"| {r.name} | {'PASS' if r.status == 'pass' else '**' + r.status.upper() + '**'} |"
                     f" {text} | {r.seconds:.1f} |")
    rows = [row for r in results if r.name.startswith(("parity", "pretrained")) for row in r.rows]
    if rows:
        lines += ["", "Float64 parity against one process (CPU), and the collectives of one step on rank 0:", "",
                  "| case | (dp,mp) or (dp,pp,mp) | zero | sp | max abs(w - w_ref) | collectives (rank 0) | ok |",
                  "|---|---|---:|---|---:|---|---|"]
        for row in rows:
            counts = ", ".join(f"{k} {n}" for k, n in sorted(row["counts_rank0"].items()))
            lines.append(f"| {row['case']} | {row['layout']} | {row['zero']} | {row['sp']} |"
                         f" {row['max_abs_diff']:.2e} | {counts} | {'yes' if row['ok'] else 'NO'} |")
    mfu = next((r for r in results if r.name == "mfu" and r.rows), None)
    if mfu is not None:
        f = mfu.figures
        lines += ["", f"MFU: Llama {f['model']}, bf16-mixed, world size 1, peak {_fmt(f['peak_bf16_tflops'])}"
                  f" TFLOP/s dense bf16 ({f['peak_key'] or 'unknown device'}), {f['flops_per_token']:.3g} model"
                  f" FLOPs per token:", "",
                  "| run | tokens/s | TFLOP/s | MFU | pre-flight estimate (n/a: no estimator yet) |",
                  "|---|---:|---:|---:|---|"]
        for row in mfu.rows:
            m = f"{row['mfu']:.1%}" if row["mfu"] is not None else "n/a"
            lines.append(f"| {row['run']} | {row['tokens_per_s']:.0f} | {row['tflops']:.3g} | {m} |"
                         f" {row['estimator_prediction']} |")
    compiled = next((r for r in results if r.name == "compile" and r.figures), None)
    if compiled is not None:
        lines += ["", "Compile vs eager (float32, world size 1): " + ", ".join(
            f"{k} {_fmt(v)}" for k, v in compiled.figures.items() if not k.endswith("each_step_ms"))]
    failed = [r.name for r in results if r.status != "pass"]
    if failed:
        lines += ["", f"**FAILED: {', '.join(failed)}** (logs in {out / 'logs'})"]
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    return text


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=("all", "group", "rank", "summary"))
    p.add_argument("group", nargs="?", choices=tuple(GROUPS), help="with `group`: which group")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu")
    p.add_argument("--ports", default="", help=argparse.SUPPRESS)  # `rank`: one port per case
    args = p.parse_args(argv)
    out = args.out.resolve()
    if args.command == "all":
        return run_all(args.device, out)
    if args.command == "summary":
        print(write_summary(args.device, out, 0.0))
        return 0
    if args.command == "rank":
        return rank_main(args.device, out, [int(p) for p in args.ports.split(",")])
    if args.group == "ranks":
        group_ranks(args.device, out)
    elif args.group == "single":
        group_single(args.device, out)
    else:
        raise SystemExit(f"group {args.group!r} runs inside `all` (it starts no torch process of its own)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
