"""Models out, in the Hugging Face format: safetensors files (sharded with an index above a size) plus the config,
written tensor by tensor so that the writer never holds more than one dense tensor.

The safetensors layout is written by hand (an 8-byte header length, a JSON header of names, dtypes, shapes and
byte offsets, then the raw bytes in that order): the header needs only shapes and dtypes, which every rank knows,
so each tensor can be gathered, written and freed before the next one. ``transformers``' ``from_pretrained`` and
``safetensors.safe_open`` read the result; tied weights are stored once, under their first name, as
``save_pretrained`` does.

Example:
    >>> entries = [TensorEntry("w", (2, 2), torch.float32)]
    >>> write_streamed(out_dir, entries, lambda e: torch.ones(2, 2))      # doctest: +SKIP
    {'files': 1, 'tensors': 1, 'bytes': 16}
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor

from lightning_dpmp.checkpoint.files import fsync_dir, replace_path
from lightning_dpmp.checkpoint.weights import SAFETENSORS_INDEX

__all__ = [
    "TensorEntry",
    "discard_staging",
    "floating_dtype",
    "parse_size",
    "staging_dir",
    "state_entries",
    "write_config",
    "write_streamed",
]

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the output: its name in the file, dense shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


def parse_size(size: Union[int, str]) -> int:
    """Bytes from ``5GB``, ``500MB``, ``20KB`` (powers of 1000, as transformers reads them; ``GiB`` powers of 1024)
    or an int."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?)B?\s*", size.upper())
    if not m:
        raise ValueError(f"max_shard_size={size!r}: expected bytes as an int or a size such as '5GB' or '500MB'.")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** " KMGT".index(m.group(2) or " "))


def state_entries(state: Mapping[str, Tensor], shapes: Mapping[str, tuple[int, ...]]) -> list[TensorEntry]:
    """The entries to write for a module's ``state_dict(keep_vars=True)`` (``shapes``: dense shapes by key): each
    tensor once, under its first name (tied weights, shared modules), in ``state_dict`` order."""
    seen: set[int] = set()
    out = []
    for key, t in state.items():
        if not isinstance(t, Tensor) or id(t) in seen:
            continue
        seen.add(id(t))
        if t.dtype not in _DTYPES:
            raise TypeError(f"{key}: dtype {t.dtype} has no safetensors code.")
        out.append(TensorEntry(key, tuple(shapes[key]), t.dtype))
    return out


def _files_for(entries: list[TensorEntry], max_bytes: int) -> list[list[TensorEntry]]:
    """Consecutive entries grouped into files of at most ``max_bytes`` (a larger tensor gets a file of its own)."""
    files: list[list[TensorEntry]] = [[]]
    size = 0
    for e in entries:
        if files[-1] and size + e.nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(e)
        size += e.nbytes
    return files


def _header(entries: list[TensorEntry]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}  # transformers refuses files without format "pt"
    offset = 0
    for e in entries:
        header[e.name] = {"dtype": _DTYPES[e.dtype], "shape": list(e.shape),
                          "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return len(raw).to_bytes(8, "little") + raw


def write_streamed(
    out_dir: str, entries: list[TensorEntry], fetch: Callable[[TensorEntry], Optional[Tensor]],
    max_shard_size: Union[int, str] = "5GB", write: bool = True,
) -> dict[str, int]:
    """Write ``entries`` as safetensors files under ``out_dir``, calling ``fetch`` once per entry, in order.

    ``fetch`` returns the dense tensor on the writing process (``write=True``); elsewhere it is called for the
    collectives it may take part in and returns ``None``. The files go into a temporary folder beside ``out_dir``
    (removed again if anything fails) and :func:`write_config` moves it in. One file is ``model.safetensors``; more
    get ``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json``.
    """
    groups = _files_for(entries, parse_size(max_shard_size))
    names = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    if not write:
        for e in entries:  # this rank takes part in the collectives fetch may issue, and writes nothing
            fetch(e)
        return {"files": 0, "tensors": len(entries), "bytes": 0}
    discard_staging(out_dir)  # whatever an interrupted export left
    try:
        total = _write_files(staging_dir(out_dir), names, groups, fetch)
    except BaseException:
        discard_staging(out_dir)
        raise
    return {"files": len(groups), "tensors": len(entries), "bytes": total}


def _write_files(tmp: str, names: list[str], groups: list[list[TensorEntry]],
                 fetch: Callable[[TensorEntry], Optional[Tensor]]) -> int:
    total = 0
    for name, group in zip(names, groups):
        with open(os.path.join(tmp, name), "wb") as f:
            f.write(_header(group))
            for e in group:
                t = fetch(e)
                if t is None:
                    raise ValueError(f"{e.name}: the writing process got no tensor.")
                if tuple(t.shape) != e.shape or t.dtype != e.dtype:
                    raise ValueError(f"{e.name}: got {tuple(t.shape)} {t.dtype}, expected {e.shape} {e.dtype}.")
                # A copy first: numpy sharing a parameter's storage would pin it (ZeRO-3 frees storages by resizing).
                f.write(t.detach().to("cpu", copy=True).reshape(-1).view(torch.uint8).numpy().data)
                total += e.nbytes
            f.flush()
            os.fsync(f.fileno())
    if len(groups) > 1:
        index = {"metadata": {"total_size": sum(e.nbytes for g in groups for e in g)},
                 "weight_map": {e.name: n for n, g in zip(names, groups) for e in g}}
        with open(os.path.join(tmp, SAFETENSORS_INDEX), "w") as fh:
            json.dump(index, fh, indent=2)
    return total


def staging_dir(out_dir: str) -> str:
    """The temporary folder beside ``out_dir`` that :func:`write_streamed` fills (made on first use)."""
    parent, base = os.path.split(os.path.abspath(out_dir))
    tmp = os.path.join(parent, f".{base}.tmp-dpmp")
    os.makedirs(tmp, exist_ok=True)
    return tmp


def write_config(out_dir: str, config: Any, dtype: Optional[torch.dtype], extra: Iterable[Any] = ()) -> None:
    """Save ``config`` (its ``dtype`` set to the weights' dtype) and ``extra`` objects with a ``save_pretrained``
    (a generation config) into the staged folder, then move it to ``out_dir`` (replacing what is there)."""
    tmp = staging_dir(out_dir)
    if config is not None:
        config = copy.deepcopy(config)
        if dtype is not None:
            config.dtype = dtype
        config.save_pretrained(tmp)
    for obj in extra:
        if obj is not None:
            obj.save_pretrained(tmp)
    fsync_dir(tmp)
    os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
    replace_path(tmp, out_dir)


def discard_staging(out_dir: str) -> None:
    """Remove what a failed :func:`write_streamed` left in its staging folder."""
    shutil.rmtree(staging_dir(out_dir), ignore_errors=True)


def floating_dtype(dtypes: Iterable[torch.dtype]) -> Optional[torch.dtype]:
    """The first floating-point dtype of ``dtypes`` (a model's parameters, or the tensors written: what its config
    should say), or ``None``."""
    return next((d for d in dtypes if d.is_floating_point), None)

