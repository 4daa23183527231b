"""What torch's FSDP2 cannot do that our ZeRO engine does: a step whose modules depend on the data.

One block runs only for the rows whose first feature is positive (a data-dependent branch, as experts, LayerDrop or
an optional encoder make). With dp=2 one DP rank's sub-batch takes the branch and the other's does not. Each case
runs one AdamW step at dp=2 (gloo, float64, two fresh processes, ``--timeout`` seconds) and compares the weights with
one process on the global batch:

* ``fsdp2``: ``fully_shard`` on each block and the root, as torch documents it;
* ``engine``: our ZeRO-3 engine (``lightning_dpmp.parallel.zero_engine.ZeroEngine``, ``conditional=True``: what
  ``DPMPStrategy(zero=3)`` builds when the traced step branches on the data);
* ``*_same``: both DP ranks take the branch (the control: FSDP2 is right when every rank runs the same modules).

Usage::

    python benchmarks/fsdp2_limits.py --out benchmarks/results/fsdp2_limits

The open torch issue on this: pytorch/pytorch#158719 ("FSDP Fails when parameters are used differently across
ranks").
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.gpu_checks import free_port  # noqa: E402


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8, dtype=torch.float64) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks[0](x)
        if bool(x[0, 0] > 0):  # the branch: this sub-batch's data decides
            h = self.blocks[1](h)
        return h.pow(2).mean()


def global_batch(same: bool) -> torch.Tensor:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    x[0, 0] = 1.0
    x[2, 0] = 1.0 if same else -1.0  # DP rank 1's sub-batch (rows 2-3) takes the branch only if ``same``
    return x


def one_process(same: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    ref = Net()
    x = global_batch(same)
    ((ref(x[:2]) + ref(x[2:])) / 2).backward()  # the mean over the two sub-batches, as DP averages
    torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.1).step()
    return [p.detach().clone() for p in ref.parameters()]


def worker(rank: int, case: str, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    same = case.endswith("_same")
    torch.manual_seed(0)
    net = Net()
    x = global_batch(same)[2 * rank: 2 * rank + 2]
    if case.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2,))
        for block in net.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(net, mesh=mesh)
        opt = torch.optim.AdamW(net.parameters(), lr=0.1, weight_decay=0.1)
        net(x).backward()
        opt.step()
        weights = [p.full_tensor().detach() for p in net.parameters()]  # type: ignore[attr-defined]
    else:
        from lightning_dpmp.parallel.zero_engine import ZeroEngine

        engine = ZeroEngine(net, [torch.optim.AdamW(net.parameters(), lr=0.1, weight_decay=0.1)], 3,
                            dist.group.WORLD, set(), set(), conditional=True, branches=("",))
        engine.gather_root()
        net(x).backward()
        engine.optimizers[0].step()
        engine.after_step()
        with engine.gathered():
            weights = [p.detach().clone() for p in net.parameters()]
    if rank == 0:
        torch.save(weights, out)
    dist.barrier()
    dist.destroy_process_group()


def run(case: str, timeout: float, tmp: pathlib.Path) -> tuple[str, float]:
    """(what happened, seconds): the largest weight difference from one process, or why there is none."""
    out = tmp / f"{case}.pt"
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, case, port, str(out))) for r in range(2)]
    start = time.perf_counter()
    for p in procs:
        p.start()
    for p in procs:
        p.join(max(0.0, timeout - (time.perf_counter() - start)))
    took = time.perf_counter() - start
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join()
    if hung:
        return f"no rank finished the step in {timeout:.0f} s (hung; killed)", took
    if any(p.exitcode for p in procs):
        return f"failed (exit codes {[p.exitcode for p in procs]})", took
    got = torch.load(out)
    ref = one_process(case.endswith("_same"))
    diff = max(float((a - b).abs().max()) for a, b in zip(got, ref))
    return f"largest weight difference from one process: {diff:.2e}", took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=None, help="folder for README.md (default: print)")
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds each case may take")
    args = parser.parse_args()
    tmp = pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / f"fsdp2_limits_{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    rows = []
    for case in ("fsdp2_same", "engine_same", "fsdp2", "engine"):
        what, took = run(case, args.timeout, tmp)
        rows.append(f"| {case} | {'both' if case.endswith('_same') else 'DP rank 0 only'} | {what} | {took:.1f} |")
        print(rows[-1], flush=True)
    table = "\n".join(["| case | ranks taking the branch | result (float64, one AdamW step) | wall s |",
                       "|---|---|---|---:|", *rows])
    text = (f"# FSDP2 and our ZeRO-3 engine on a data-dependent step (dp=2, gloo, torch {torch.__version__})\n\n"
            f"`python benchmarks/fsdp2_limits.py --out benchmarks/results/fsdp2_limits`\n\n{table}\n")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "README.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
