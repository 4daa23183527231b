"""gloo's all-reduce time among N processes on this machine, by message size: the link figures the estimator's ``cpu``
calibration holds (``benchmarks/estimator_check.py``'s ``LINK_BW``) and a cross-check of the latency it fits.

Each size is all-reduced 3 times to warm up, then 10 times after a barrier each; the median is printed, with the
bandwidth and per-ring-step latency the strategy's own link measurement derives
(:func:`lightning_dpmp.integration.autolayout.link_figures`) from the smallest and the largest size::

    python benchmarks/gloo_links.py --world 4
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_dpmp.integration.autolayout import link_figures

SIZES_MIB = (1 / 1024, 0.25, 1.0, 4.0, 32.0)


def _work(rank: int, world: int, port: int, box: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = {}
    for mib in SIZES_MIB:
        t = torch.ones(int(mib * 2**20 / 4))
        for _ in range(3):
            dist.all_reduce(t)
        times = []
        for _ in range(10):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - start)
        out[mib] = sorted(times)[len(times) // 2]
    if rank == 0:
        box.put(out)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--port", type=int, default=29533)
    a = p.parse_args()
    box = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_work, args=(a.world, a.port, box), nprocs=a.world, start_method="spawn")
    times = box.get()
    for mib, t in times.items():
        print(f"all-reduce {mib * 1024:>8.0f} KiB over {a.world}: {t * 1e3:7.2f} ms")
    small, large = min(times), max(times)
    bw, latency = link_figures(times[small], times[large], a.world, int(small * 2**20), int(large * 2**20))
    print(f"bandwidth {bw / 1e9:.2f} GB/s, latency {latency * 1e3:.2f} ms per ring step")


if __name__ == "__main__":
    main()
