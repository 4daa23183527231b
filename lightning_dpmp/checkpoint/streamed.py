"""A consolidated checkpoint written tensor by tensor: ``torch.save``'s file, without the whole checkpoint in memory.

``torch.save`` pickles every tensor's storage and writes them all afterwards, so each must exist at once. Here the
held tensors of a checkpoint (:mod:`lightning_dpmp.checkpoint.held`) are fetched one at a time, each bucket's DP
shards gathered once for its members, and each dense tensor goes to the file as soon as it exists and is dropped.
The file is the same zip archive ``torch.save`` writes (``data.pkl``, ``data/<key>`` records, the same pickled
rebuild calls), so ``torch.load(..., weights_only=True, mmap=True)`` and the plain model read it unchanged.

Every rank calls :func:`stream_save` with the checkpoint it built (the fetches are collective); rank 0 writes into a
temporary file that replaces ``path`` only when complete. A failed write on rank 0 (a full disk) keeps it in the
collectives to the end, then every rank raises.

Example:
    >>> stream_save(checkpoint, "last.ckpt", write=trainer.is_global_zero)     # collective  # doctest: +SKIP
"""

from __future__ import annotations

import io
import os
import pickle
import sys
from typing import Any, Optional

import torch.distributed as dist
from torch import Tensor
from torch.serialization import location_tag

import lightning_dpmp.compat as compat
from lightning_dpmp.checkpoint.files import replace_path, temp_sibling
from lightning_dpmp.checkpoint.held import collect_held, fetch_in_order, held_of

__all__ = ["stream_save"]

_PROTOCOL = 2  # torch.save's default pickle protocol


def stream_save(obj: Any, path: str, write: bool) -> None:
    """Write ``obj`` (a checkpoint holding held tensors) to ``path`` as ``torch.save`` would, atomically, holding
    one bucket's gathered buffer and one dense tensor at a time; ``write`` on the rank that writes (rank 0)."""
    tmp: Optional[str] = None
    writer: Any = None
    error: Optional[BaseException] = None
    keys: dict[int, str] = {}
    if write:
        tmp = temp_sibling(path)
        try:
            writer = compat.zip_file_writer(tmp)
        except BaseException as exc:  # still take part in every fetch below: the other ranks are in them
            error = exc

    def consume(t: Tensor, dense: Optional[Tensor]) -> None:
        nonlocal error
        if writer is None or error is not None:
            return
        try:
            if dense is None:
                raise RuntimeError(f"internal: no dense value of a {tuple(t.shape)} tensor reached the writer")
            if tuple(dense.shape) != tuple(t.shape) or dense.dtype != t.dtype:
                raise RuntimeError(f"internal: a held {tuple(t.shape)} {t.dtype} tensor was fetched as "
                                   f"{tuple(dense.shape)} {dense.dtype}")
            key = keys.setdefault(id(t), str(len(keys)))
            _write_storage(writer, key, dense)
        except BaseException as exc:
            error = exc

    fetch_in_order(collect_held(obj), consume)
    if writer is not None and error is None:
        try:
            _write_rest(writer, obj, keys)
            writer.write_end_of_file()
            writer = None
            with open(tmp, "rb+") as f:  # type: ignore[arg-type]
                os.fsync(f.fileno())
            replace_path(tmp, path)  # type: ignore[arg-type]
        except BaseException as exc:
            error = exc
    writer = None  # closes the file
    if tmp is not None and error is not None and os.path.exists(tmp):
        os.unlink(tmp)
    _agree(error)


def _write_storage(writer: Any, key: str, t: Tensor) -> None:
    t = t.detach().cpu().contiguous()
    if t.untyped_storage().nbytes() != t.nbytes:
        t = t.clone()  # a view: write its own bytes, not its base's
    writer.write_record(f"data/{key}", t.untyped_storage(), t.nbytes)


def _write_rest(writer: Any, obj: Any, keys: dict[int, str]) -> None:
    """Pickle ``obj`` (held tensors as storages under ``keys``, written already) and write every other storage."""
    storages: dict[str, Any] = {}
    ids: dict[int, str] = {}

    class Pickler(pickle.Pickler):
        def reducer_override(self, x: Any) -> Any:
            if isinstance(x, Tensor) and held_of(x) is not None:
                # a held tensor: the rebuild call torch.save writes for a contiguous tensor, over the storage record
                # written above (its meta storage stands in for it while pickling)
                storage = compat.typed_storage(x.untyped_storage(), x.dtype)
                ids[compat.storage_record(storage)[3]] = keys[id(x)]  # type: ignore[index]
                return compat.tensor_rebuild_call(storage, tuple(x.shape), x.stride())
            return NotImplemented

        def persistent_id(self, x: Any) -> Any:
            record = compat.storage_record(x)
            if record is None:
                return None
            storage, storage_type, numel, identity = record
            if identity in ids and storage.device.type == "meta":
                return ("storage", storage_type, ids[identity], "cpu", numel)
            key = ids.setdefault(identity, str(len(keys) + len(storages)))
            storages[key] = storage
            return ("storage", storage_type, key, location_tag(storage), numel)

    buf = io.BytesIO()
    Pickler(buf, protocol=_PROTOCOL).dump(obj)
    for key, storage in storages.items():
        storage = storage.cpu() if storage.device.type != "cpu" else storage
        writer.write_record(f"data/{key}", storage, storage.nbytes())
    data = buf.getvalue()
    writer.write_record("data.pkl", data, len(data))
    writer.write_record(".format_version", "1", 1)
    alignment = str(compat.storage_alignment())
    writer.write_record(".storage_alignment", alignment, len(alignment))
    writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))


def _agree(error: Optional[BaseException]) -> None:
    """Rank 0's outcome on every rank: its error raised there, a ``RuntimeError`` naming it elsewhere."""
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    status = [None if error is None else f"{type(error).__name__}: {error}"]
    if distributed:
        dist.broadcast_object_list(status, src=0)
    if error is not None:
        raise error
    if status[0] is not None:
        raise RuntimeError(f"Rank 0 failed to write the checkpoint: {status[0]}")
