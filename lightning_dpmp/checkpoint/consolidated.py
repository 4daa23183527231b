"""Consolidated checkpoints: dense model and optimizer state under the dense names, written atomically, loaded safely.

A consolidated checkpoint is an ordinary Lightning checkpoint: ``state_dict`` holds dense tensors under the dense
model's names, and each optimizer's ``state`` holds per-parameter tensors (AdamW moments) of dense shape, keyed by
the dense model's parameter order. It loads into the plain model (``weights_only=True``, ``strict=True``) and
resumes under any ``(dp, mp)``. Alongside, ``checkpoint["dpmp"]`` records the layout that wrote it and every
rank's RNG states (as tensors and plain tuples, so that ``weights_only=True`` can read them).

Memory: only the MP group of DP rank 0 gathers, one parameter at a time, onto its first rank (global rank 0, which
writes); no other rank ever holds more than its own shards. Loading maps the file (``mmap=True``), so each rank
reads only the slices it keeps.

Example:
    >>> state = gather_state_dict(module.state_dict(), shard_dims(module), grid.mp_group)  # doctest: +SKIP
    >>> atomic_save({"state_dict": state}, "last.ckpt")     # temp file, fsync, rename    # doctest: +SKIP
    >>> ckpt = load_file("last.ckpt")                       # weights_only=True, mmap      # doctest: +SKIP
"""

from __future__ import annotations

import copy
import os
import random
import shutil
import time
import uuid
from datetime import timedelta
from collections.abc import Mapping
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

import lightning_dpmp.compat as compat
from lightning_dpmp.parallel.comm import group_rank, group_size
from lightning_dpmp.parallel.layers import gather_tensor, interleave_blocks, shard_blocks, shard_dims, shard_tensor

__all__ = [
    "CheckpointMismatchError",
    "atomic_save",
    "check_state_matches",
    "collect_rng_states",
    "consolidate_optimizer",
    "consolidate_optimizer_state",
    "dense_shapes",
    "fsync_dir",
    "gather_state_dict",
    "gather_to_first",
    "layout_info",
    "load_file",
    "make_weights_only_safe",
    "optimizer_param_dims",
    "optimizer_param_names",
    "recover_path",
    "replace_path",
    "restore_rng_from",
    "restore_rng_states",
    "shard_optimizer_state",
    "shard_state_dict",
    "write_on_rank_zero",
]


class CheckpointMismatchError(RuntimeError):
    """A checkpoint does not fit the model: names the first missing/unexpected key or the shapes that differ."""


# ---------------------------------------------------------------------------------------------- gathering / slicing
def gather_to_first(t: Tensor, group: Any, dim: int, blocks: int = 1) -> Optional[Tensor]:
    """Concatenate the group's shards of ``t`` along ``dim`` on the group's first rank, on CPU; ``None`` elsewhere.

    A ``gather`` rather than an ``all_gather``: the other ranks never hold the dense tensor.
    """
    n = group_size(group)
    t = t.detach().contiguous()
    if n == 1:
        return t.cpu()
    dst = dist.get_global_rank(group, 0)
    if group_rank(group) == 0:
        parts = [torch.empty_like(t) for _ in range(n)]
        dist.gather(t, parts, dst=dst, group=group)
        return interleave_blocks(parts, dim, blocks).cpu()
    dist.gather(t, None, dst=dst, group=group)
    return None


def gather_state_dict(
    state: Mapping[str, Any], dims: Mapping[str, int], group: Any, blocks: Optional[Mapping[str, int]] = None
) -> dict[str, Any]:
    """Dense ``state`` on the group's first rank (split entries gathered one by one); ``state`` unchanged elsewhere."""
    out = dict(state)
    done: dict[tuple, Optional[Tensor]] = {}  # aliases of one weight (tied or shared modules) are gathered once
    for key, dim in dims.items():
        t = state[key]
        tag = (t.data_ptr(), tuple(t.shape), dim)
        if tag not in done:
            done[tag] = gather_to_first(t, group, dim, (blocks or {}).get(key, 1))
        if done[tag] is not None:
            out[key] = done[tag]
    return out


def optimizer_param_dims(optimizer: Optimizer, module: Any) -> list[Optional[int]]:
    """For each parameter in the optimizer's order, the dim it is split along, or ``None`` if replicated."""
    dims = shard_dims(module)
    by_id = {id(p): dims.get(name) for name, p in module.named_parameters()}
    return [by_id.get(id(p)) for group in optimizer.param_groups for p in group["params"]]


def optimizer_param_blocks(optimizer: Optimizer, module: Any) -> list[int]:
    """For each parameter in the optimizer's order, its fused block count (1 unless a fused projection)."""
    blocks = shard_blocks(module)
    by_id = {id(p): blocks.get(name, 1) for name, p in module.named_parameters()}
    return [by_id.get(id(p), 1) for group in optimizer.param_groups for p in group["params"]]


def optimizer_param_names(optimizer: Optimizer, module: nn.Module) -> list[str]:
    """Dense name of each parameter in the optimizer's order (``param_<i>`` for one the module does not own)."""
    by_id = {id(p): name for name, p in module.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return [by_id.get(id(p), f"param_{i}") for i, p in enumerate(params)]


def _map_state(
    state: dict[str, Any], param_dims: list[Optional[int]], fn: Callable[[Tensor, int, int], Any],
    param_blocks: Optional[list[int]] = None,
) -> dict[str, Any]:
    out = copy.copy(state)
    out["state"] = {}
    for idx, per_param in state.get("state", {}).items():
        dim = param_dims[idx] if idx < len(param_dims) else None
        blocks = param_blocks[idx] if param_blocks and idx < len(param_blocks) else 1
        out["state"][idx] = {
            k: (fn(v, dim, blocks) if dim is not None and isinstance(v, Tensor) and v.dim() > dim else v)
            for k, v in per_param.items()
        }
    return out


def consolidate_optimizer_state(
    state: dict[str, Any], param_dims: list[Optional[int]], group: Any, param_blocks: Optional[list[int]] = None
) -> dict[str, Any]:
    """Gather the split per-parameter tensors of an optimizer ``state_dict`` onto the group's first rank.

    Collective over ``group``; the other ranks get ``state`` back unchanged.
    """
    if group_size(group) == 1:
        return state
    gathered = _map_state(state, param_dims, lambda v, d, b: gather_to_first(v, group, d, b), param_blocks)
    return gathered if group_rank(group) == 0 else state


def shard_optimizer_state(
    state: dict[str, Any], param_dims: list[Optional[int]], group: Any, param_blocks: Optional[list[int]] = None
) -> dict[str, Any]:
    """Keep this rank's slice of each split per-parameter tensor of a consolidated optimizer ``state_dict``."""
    n, r = group_size(group), group_rank(group)
    if n == 1:
        return state
    return _map_state(state, param_dims, lambda v, d, b: shard_tensor(v, d, n, r, b).clone(), param_blocks)


def shard_state_dict(
    state: Mapping[str, Any], dims: Mapping[str, int], group: Any, blocks: Optional[Mapping[str, int]] = None
) -> dict[str, Any]:
    """Slice the dense entries of a consolidated model ``state_dict`` for a parallelised module (no communication)."""
    n, r = group_size(group), group_rank(group)
    out = dict(state)
    for key, dim in dims.items():
        if key in out and isinstance(out[key], Tensor) and out[key].shape[dim] % n == 0:
            out[key] = shard_tensor(out[key], dim, n, r, (blocks or {}).get(key, 1))
    return out


def consolidate_optimizer(optimizer: Optimizer, moved: Mapping[int, tuple[Any, Optional[int], int]], group: Any) -> None:
    """Point ``optimizer`` at the dense parameters :func:`~lightning_dpmp.planner.parallelize.consolidate` made, with its
    per-parameter state gathered to dense shapes (collective over MP; every rank ends up dense)."""
    for pg in optimizer.param_groups:
        new_params = []
        for p in pg["params"]:
            dense, dim, blocks = moved.get(id(p), (p, None, 1))
            state = optimizer.state.pop(p, None)
            if state is not None:
                optimizer.state[dense] = {
                    k: (gather_tensor(v.detach(), dim, group, blocks)
                        if dim is not None and isinstance(v, Tensor) and v.shape == p.shape else v)
                    for k, v in state.items()
                }
            new_params.append(dense)
        pg["params"] = new_params


# ---------------------------------------------------------------------------------------------- validation
def dense_shapes(module: nn.Module, group: Any) -> dict[str, tuple[int, ...]]:
    """Shape of every ``state_dict`` tensor of ``module`` as the dense model has it (split dims times the group)."""
    dims, n = shard_dims(module), group_size(group)
    out: dict[str, tuple[int, ...]] = {}
    for key, t in module.state_dict().items():
        if isinstance(t, Tensor):
            shape = list(t.shape)
            if key in dims:
                shape[dims[key]] *= n
            out[key] = tuple(shape)
    return out


def check_state_matches(expected: Mapping[str, tuple[int, ...]], found: Mapping[str, tuple[int, ...]], strict: bool) -> None:
    """Raise :class:`CheckpointMismatchError` naming the first difference between model and checkpoint.

    Order: missing keys (in the model's order), unexpected keys (in the checkpoint's order), then shape mismatches,
    which are reported even with ``strict=False`` since no tensor of the wrong shape can be loaded.

    Example:
        >>> check_state_matches({"w": (4, 2)}, {"w": (4, 3)}, strict=True)
        Traceback (most recent call last):
        ...
        lightning_dpmp.checkpoint.consolidated.CheckpointMismatchError: Checkpoint does not match the model: 'w' has shape (4, 3) in the checkpoint but (4, 2) in the model.
    """
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    wrong = [k for k in expected if k in found and tuple(found[k]) != tuple(expected[k])]
    total = len(wrong) + (len(missing) + len(unexpected) if strict else 0)
    if not total:
        return
    if strict and missing:
        first = f"missing key {missing[0]!r} (shape {tuple(expected[missing[0]])} in the model)"
    elif strict and unexpected:
        first = f"unexpected key {unexpected[0]!r} (shape {tuple(found[unexpected[0]])} in the checkpoint)"
    else:
        k = wrong[0]
        first = f"{k!r} has shape {tuple(found[k])} in the checkpoint but {tuple(expected[k])} in the model"
    more = f" ({total - 1} more difference{'s' if total > 2 else ''})" if total > 1 else ""
    raise CheckpointMismatchError(f"Checkpoint does not match the model: {first}.{more}")


# ---------------------------------------------------------------------------------------------- files
def fsync_dir(path: str) -> None:
    """Make a rename or a new file inside ``path`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def replace_path(new: str, path: str) -> None:
    """Move the file or folder ``new`` to ``path``, replacing whatever is there (file, folder or link).

    A file over a file is one atomic ``rename``. A folder cannot be renamed over an existing one, so the old entry
    first moves aside to ``.<name>.old-*`` and is deleted after the swap: a crash between the two renames leaves the
    previous checkpoint intact under that name, and :func:`recover_path` finds it.
    """
    parent, base = os.path.split(os.path.abspath(path))
    if os.path.lexists(path) and (os.path.isdir(new) or (os.path.isdir(path) and not os.path.islink(path))):
        old = os.path.join(parent, f".{base}.old-{os.getpid()}-{time.monotonic_ns()}")
        os.replace(path, old)
        os.replace(new, path)
        fsync_dir(parent)
        if os.path.isdir(old) and not os.path.islink(old):
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.unlink(old)
    else:
        os.replace(new, path)
    fsync_dir(parent)


def recover_path(path: str) -> str:
    """``path`` if it exists, else the newest ``.<name>.old-*`` a crash in :func:`replace_path` left beside it."""
    if os.path.lexists(path):
        return path
    parent, base = os.path.split(os.path.abspath(path))
    prefix = f".{base}.old-"
    found = [os.path.join(parent, n) for n in os.listdir(parent) if n.startswith(prefix)] if os.path.isdir(parent) else []
    return max(found, key=os.path.getmtime) if found else path


def atomic_save(obj: Any, path: str) -> None:
    """``torch.save`` to a temporary file beside ``path``, flush and fsync it, then rename it over ``path``.

    A crash (even SIGKILL) at any point leaves either the previous file or the new one, never a torn one: the
    rename is atomic on POSIX filesystems. A leftover ``.<name>.tmp-*`` file is all a crash can leave behind.
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:12]}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for a plain save
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)  # streams to the file: no second in-memory copy of the checkpoint
            f.flush()
            os.fsync(f.fileno())
        replace_path(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_file(path: str) -> dict[str, Any]:
    """Load a checkpoint file with ``weights_only=True`` (no arbitrary unpickling), memory-mapped when possible.

    With ``mmap`` each rank only pages in the slices it keeps; legacy (non-zip) files fall back to a plain read.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as exc:
        if "mmap" not in str(exc):
            raise
        return torch.load(path, map_location="cpu", weights_only=True)


def make_weights_only_safe(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Turn what Lightning puts in a checkpoint but ``weights_only=True`` cannot read into plain containers.

    OmegaConf hyper-parameters become dicts/lists and the class stored under ``*hparams_type`` is dropped
    (``load_from_checkpoint`` then gives a dict-like ``hparams`` instead of a ``DictConfig``).
    """
    for key in list(checkpoint):
        value = checkpoint[key]
        if key.endswith("hparams_type") and isinstance(value, type):
            del checkpoint[key]
        elif type(value).__module__.startswith("omegaconf"):
            from omegaconf import OmegaConf

            checkpoint[key] = OmegaConf.to_container(value, resolve=True)
    return checkpoint


# ---------------------------------------------------------------------------------------------- RNG states
def collect_rng_states(device: Optional[torch.device] = None) -> dict[str, Any]:
    """This process's torch / CUDA / numpy / Python RNG states in a form ``weights_only=True`` loads."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": (str(name), torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss), float(gauss)),
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


def restore_rng_from(checkpoint: Mapping[str, Any], dp: int, mp: int, rank: int, device: Optional[torch.device]) -> None:
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


def write_on_rank_zero(write: Callable[[], None], timeout: timedelta) -> None:
    """Rank 0 runs ``write``; the other ranks wait for its signal with ``timeout`` (not the process group's).

    Waiting at an ordinary barrier would fail after the process-group timeout while rank 0 is still writing a large
    file; waiting on the store instead takes ``timeout`` and gets rank 0's error, if any, instead of hanging.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        write()
        return
    token: list[Any] = [uuid.uuid4().hex]
    dist.broadcast_object_list(token, src=0)
    key = f"dpmp/checkpoint_written/{token[0]}"
    try:
        store = compat.default_store()
    except Exception:  # a private API: without it, fall back to Lightning's barrier after the save
        store = None
    if dist.get_rank() == 0:
        try:
            write()
        except BaseException as exc:
            if store is not None:
                store.set(key, f"{type(exc).__name__}: {exc}")
            raise
        if store is not None:
            store.set(key, "ok")
    elif store is not None:
        store.wait([key], timeout)
        status = store.get(key).decode()
        if status != "ok":
            raise RuntimeError(f"Rank 0 failed to write the checkpoint: {status}")
