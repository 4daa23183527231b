"""Byte-level language-modelling data: no tokenizer, no download (vocab = 256 byte values).

The default corpus is the Python standard library's own source: a sorted list of ``*.py`` files under
``sysconfig.get_paths()["stdlib"]`` (``site-packages`` and caches excluded), read until a fixed byte budget. The token
array is cached as ``<cache_dir>/<sha256 of the bytes>.npy``; the first 1 - ``val_fraction`` of it is the training
split, the rest validation. ``path=...`` trains on a text file of your own instead.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path
from typing import Optional

import lightning.pytorch as pl
import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

__all__ = ["ByteWindows", "TextDataModule", "stdlib_corpus"]

DEFAULT_CACHE_DIR = Path(os.environ.get("DPMP_CACHE_DIR", Path.home() / ".cache" / "lightning_dpmp"))
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__", "idlelib", "turtledemo"}


def stdlib_files() -> list[Path]:
    """The standard library's ``*.py`` files in a deterministic (sorted) order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS)
        files += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def stdlib_corpus(max_bytes: int) -> bytes:
    """The first ``max_bytes`` bytes of the concatenated standard library sources."""
    chunks, total = [], 0
    for path in stdlib_files():
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


class ByteWindows(Dataset):
    """Map-style dataset of fixed-length windows: item ``i`` is ``(x, y)`` = ``data[s:s+T]``, ``data[s+1:s+T+1]``.

    ``s = i * stride``. Shuffling and DP sharding come from the sampler Lightning injects.
    """

    def __init__(self, data: np.ndarray, block_size: int, stride: Optional[int] = None) -> None:
        if len(data) < block_size + 1:
            raise ValueError(f"{len(data)} tokens are too few for block_size={block_size}")
        self.data = data
        self.block_size = block_size
        self.stride = stride or block_size

    def __len__(self) -> int:
        return (len(self.data) - self.block_size - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        s = i * self.stride
        chunk = torch.from_numpy(np.asarray(self.data[s : s + self.block_size + 1], dtype=np.int64))
        return chunk[:-1], chunk[1:]


class TextDataModule(pl.LightningDataModule):
    """Byte-level text windows for next-token prediction.

    Args:
        path: a text file to train on; ``None`` uses the Python standard library sources.
        max_bytes: byte budget read from the corpus (keeps tokenising and caching fast).
        block_size: window length ``T`` (must not exceed the model's ``block_size``).
        stride: distance between window starts in the training split (default ``block_size``: no overlap).
        val_fraction: tail fraction of the bytes held out for validation.
        batch_size: windows per batch *per DP rank*.
        num_workers: DataLoader workers.
        cache_dir: where the uint8 token arrays are cached (keyed by content hash).
    """

    def __init__(
        self,
        path: Optional[str] = None,
        max_bytes: int = 2_000_000,
        block_size: int = 128,
        stride: Optional[int] = None,
        val_fraction: float = 0.05,
        batch_size: int = 16,
        num_workers: int = 0,
        cache_dir: Optional[str] = None,
    ) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        self.path = path
        self.max_bytes = int(max_bytes)
        self.block_size = block_size
        self.stride = stride
        self.val_fraction = val_fraction
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else DEFAULT_CACHE_DIR
        self.train_set: Optional[ByteWindows] = None
        self.val_set: Optional[ByteWindows] = None

    def _raw(self) -> bytes:
        if self.path is None:
            return stdlib_corpus(self.max_bytes)
        return Path(self.path).expanduser().read_bytes()[: self.max_bytes]

    def tokens(self) -> np.ndarray:
        """The corpus as a uint8 array, from the cache when it is there (atomic write, so ranks may race)."""
        raw = self._raw()
        digest = hashlib.sha256(raw).hexdigest()[:20]
        cached = self.cache_dir / f"bytes-{digest}.npy"
        if cached.exists():
            try:
                return np.load(cached, mmap_mode="r")
            except (OSError, ValueError):
                pass  # truncated or corrupt: rebuild
        arr = np.frombuffer(raw, dtype=np.uint8)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".{os.getpid()}.tmp.npy")
        np.save(tmp, arr)
        os.replace(tmp, cached)
        return arr

    def prepare_data(self) -> None:
        self.tokens()

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        data = self.tokens()
        split = int(len(data) * (1.0 - self.val_fraction))
        self.train_set = ByteWindows(data[:split], self.block_size, self.stride)
        self.val_set = ByteWindows(data[split:], self.block_size, self.block_size)

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True, num_workers=self.num_workers
        )

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader:
        """The held-out split again (there is no third split): what ``test=true`` and examples/eval.py report."""
        return self.val_dataloader()
