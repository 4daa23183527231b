"""Cases for the rank pool's own tests (tests/distributed/test_pool.py): ``python pool_cases.py CASE OUT_DIR``.

Each case behaves as a worker script would in a launched rank: it reads ``LOCAL_RANK`` and ``WORLD_SIZE``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def _init() -> int:
    # MASTER_ADDR/MASTER_PORT from the environment, rank and world given, as Lightning does
    rank, world = int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=2))
    return rank


def main(case: str, out: str) -> None:
    rank = int(os.environ["LOCAL_RANK"])
    if case == "raise":  # rank 1 fails before joining; rank 0 waits for it inside init (a hang without the grace)
        if rank == 1:
            raise RuntimeError("boom on rank 1")
        _init()
        dist.barrier()
    elif case == "fail_all":  # every rank fails after a collective, leaving its process group and a dtype behind
        _init()
        dist.barrier()
        torch.set_default_dtype(torch.float64)
        raise SystemExit(f"failed on rank {rank}")
    elif case == "threads":  # leaves threads running (as a process group something still holds would)
        for _ in range(60):
            threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
    elif case == "hang":
        time.sleep(3600)
    elif case == "leave":  # leaves a process group, an environment variable and a default dtype behind
        _init()
        os.environ["DPMP_POOL_LEFTOVER"] = "1"
        torch.set_default_dtype(torch.float64)
        print(f"left state on rank {rank}")
    elif case == "check":  # what a fresh process would see, then a collective on a new group
        report = {
            "initialized": dist.is_initialized(),
            "leftover": os.environ.get("DPMP_POOL_LEFTOVER"),
            "dtype": str(torch.get_default_dtype()),
            "argv": sys.argv[1:],
        }
        _init()
        t = torch.ones(1)
        dist.all_reduce(t)
        report["sum"] = t.item()
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(report, f)
    else:
        raise SystemExit(f"unknown case {case}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
