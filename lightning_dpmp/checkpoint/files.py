"""Checkpoint files: atomic writes (temporary file, fsync, rename), folder swaps a crash cannot tear and the
recovery of what such a crash leaves, loading with ``weights_only=True`` (memory-mapped), turning what Lightning
stores but ``weights_only`` cannot read into plain containers, and rank 0 writing while the others wait.

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "last.ckpt")
    >>> atomic_save({"state_dict": {"w": torch.ones(2)}}, path)     # temp file, fsync, rename
    >>> load_file(path)["state_dict"]["w"].tolist()                  # weights_only=True, mmap
    [1.0, 1.0]
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

import lightning_dpmp.compat as compat

__all__ = [
    "atomic_save",
    "fsync_dir",
    "load_file",
    "make_weights_only_safe",
    "recover_path",
    "replace_path",
    "temp_sibling",
    "write_on_rank_zero",
]


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
    names = os.listdir(parent) if os.path.isdir(parent) else []
    found = [os.path.join(parent, n) for n in names if n.startswith(prefix)]
    return max(found, key=os.path.getmtime) if found else path


def temp_sibling(path: str) -> str:
    """A fresh hidden name beside ``path`` (``.<name>.tmp-<random>``; the folder is created) to write into before
    :func:`replace_path` moves it over ``path``: the only thing a crash mid-write can leave behind."""
    folder, base = os.path.split(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, f".{base}.tmp-{uuid.uuid4().hex[:12]}")


def atomic_save(obj: Any, path: str) -> None:
    """``torch.save`` to a temporary file beside ``path``, flush and fsync it, then rename it over ``path``.

    A crash (even SIGKILL) at any point leaves either the previous file or the new one, never a torn one: the
    rename is atomic on POSIX filesystems. A leftover ``.<name>.tmp-*`` file is all a crash can leave behind.
    """
    tmp = temp_sibling(path)
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
