"""Start a save that stalls halfway (on purpose), so that the test can SIGKILL it mid-write.

Usage: python tests/distributed/checkpoint_kill_worker.py file|folder PATH READY_FILE

Writes a first checkpoint (value 1.0) to PATH, then starts writing a second one (value 2.0) and, partway through,
creates READY_FILE and sleeps. ``file``: the consolidated writer stalls with half of the bytes in its temporary
file. ``folder``: the sharded writer stalls after DCP wrote the shards, before the folder is swapped in.
"""

from __future__ import annotations

import io
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import lightning_dpmp.checkpoint.files as C  # noqa: E402
import lightning_dpmp.checkpoint.sharded as S  # noqa: E402


def stall(ready: str) -> None:
    open(ready, "w").close()
    time.sleep(120)


def main() -> None:
    mode, path, ready = sys.argv[1:4]
    if mode == "file":
        C.atomic_save({"state_dict": {"w": torch.full((256, 256), 1.0)}}, path)
        real_save = torch.save

        def slow_save(obj, f, *args, **kwargs):
            buf = io.BytesIO()
            real_save(obj, buf, *args, **kwargs)
            data = buf.getvalue()
            f.write(data[: len(data) // 2])
            f.flush()
            stall(ready)

        torch.save = slow_save
        C.atomic_save({"state_dict": {"w": torch.full((256, 256), 2.0)}}, path)
    else:
        dist.init_process_group("gloo", init_method=f"file://{path}.store", rank=0, world_size=1)
        module = nn.Linear(64, 64)
        with torch.no_grad():
            module.weight.fill_(1.0)
        S.save_sharded({"state_dict": module.state_dict(), "global_step": 1}, path, module, [], None)
        with torch.no_grad():
            module.weight.fill_(2.0)
        real_atomic = S.atomic_save
        S.atomic_save = lambda obj, p: (real_atomic(obj, p), stall(ready))
        S.save_sharded({"state_dict": module.state_dict(), "global_step": 2}, path, module, [], None)


if __name__ == "__main__":
    main()
