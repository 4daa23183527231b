"""RNG states in a checkpoint: ``checkpoint["dpmp"]`` records the layout that wrote it and every rank's torch /
CUDA / numpy / Python RNG states, as tensors and plain tuples so that ``weights_only=True`` can read them, and
restores each rank's own states under the same layout (rank 0's otherwise).

Example:
    >>> states = collect_rng_states()
    >>> a = torch.rand(1)
    >>> restore_rng_states(states)
    >>> bool(torch.rand(1) == a)
    True
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

__all__ = [
    "collect_rng_states",
    "layout_info",
    "restore_rng_from",
    "restore_rng_states",
]


def collect_rng_states(device: Optional[torch.device] = None) -> dict[str, Any]:
    """This process's torch / CUDA / numpy / Python RNG states in a form ``weights_only=True`` loads."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": (
            str(name), torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss), float(gauss)
        ),
        "python": random.getstate(),
    }
    if device is not None and device.type == "cuda" and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def restore_rng_states(states: Mapping[str, Any], device: Optional[torch.device] = None) -> None:
    """Inverse of :func:`collect_rng_states`."""
    torch.set_rng_state(states["torch"])
    name, keys, pos, has_gauss, gauss = states["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    py = states["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if "cuda" in states and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(states["cuda"], device)


def layout_info(dp: int, mp: int, device: Optional[torch.device] = None) -> dict[str, Any]:
    """``checkpoint["dpmp"]``: the writing layout and every rank's RNG states (collective over the world)."""
    states = collect_rng_states(device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, states)
    else:
        gathered = [states]
    return {"format": "consolidated", "dp": dp, "mp": mp, "rng_states": gathered}


def restore_rng_from(
    checkpoint: Mapping[str, Any], dp: int, mp: int, rank: int, device: Optional[torch.device]
) -> None:
    """Restore this rank's RNG states from ``checkpoint["dpmp"]``: its own under the same layout, else rank 0's.

    Rank 0's is the right fallback: ranks of an MP group must draw identically (replicated activations), and with
    ``seed_everything`` every rank starts from the same state anyway.
    """
    info = checkpoint.get("dpmp") or {}
    states = info.get("rng_states")
    if not states:
        return
    same = info.get("dp") == dp and info.get("mp") == mp and len(states) == dp * mp
    restore_rng_states(states[rank] if same else states[0], device)
