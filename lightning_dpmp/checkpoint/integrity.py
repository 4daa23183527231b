"""Tell a truncated or corrupt checkpoint file from other load errors, and say so with the file's name.

``torch.load`` on a file cut short raises whatever the byte at the cut makes of it: ``RuntimeError: ... failed
finding central directory``, ``OSError: [Errno 22] Invalid argument`` (mmap past the end), ``EOFError``, a bare
``KeyError``. None of them names the file or says it is incomplete. A ``torch.save`` file is a zip archive whose
central directory is written last, so a cut always loses it: that is checked cheaply (the end of the file only),
before launch on the resume path and again when a load fails.

Example:
    >>> checkpoint_problem(__file__)
    'it is not a checkpoint written by torch.save (neither a zip archive nor a legacy pickle)'
"""

from __future__ import annotations

import os
import zipfile
from typing import Any, Callable, Optional

__all__ = ["IncompleteCheckpointError", "check_checkpoint_file", "checkpoint_problem", "load_checked"]

_ZIP_MAGIC = b"PK\x03\x04"
_PICKLE_MAGIC = b"\x80"  # legacy (pre-zip) torch.save files are a pickle stream: protocol 2+ starts with PROTO


class IncompleteCheckpointError(ValueError):
    """The checkpoint file is truncated (an interrupted copy or save) or is not a checkpoint at all."""


def checkpoint_problem(path: str) -> Optional[str]:
    """Why the file at ``path`` cannot be a complete ``torch.save`` checkpoint, or ``None`` if it may be one.

    Reads the first bytes and the zip end record only, so it is cheap on a file of any size. A legacy pickle file
    cannot be checked this way and passes.
    """
    size = os.path.getsize(path)
    if size == 0:
        return "it is empty (0 bytes)"
    with open(path, "rb") as f:
        head = f.read(4)
    if head == _ZIP_MAGIC:
        if zipfile.is_zipfile(path):
            return None
        return (
            f"it is incomplete: a torch.save zip archive ({size} bytes) whose central directory, written last, is"
            " missing, so the file was cut short (an interrupted copy, download or save)"
        )
    if head.startswith(_PICKLE_MAGIC):
        return None
    return "it is not a checkpoint written by torch.save (neither a zip archive nor a legacy pickle)"


def _bad_member(path: str) -> Optional[str]:
    """The first archive member whose CRC does not match (reads the whole file: only after a load has failed)."""
    if not zipfile.is_zipfile(path):
        return None
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        return f"it is corrupt: its zip archive cannot be read ({exc})"
    return f"it is corrupt: archive member {bad!r} fails its CRC check" if bad else None


def _describe(path: str, problem: str) -> str:
    return (
        f"Cannot load checkpoint {path!r}: {problem}. Resume from an intact copy (ModelCheckpoint keeps the previous"
        " one until the new one is written completely), or start without `ckpt_path`."
    )


def check_checkpoint_file(path: str) -> None:
    """Raise :class:`IncompleteCheckpointError` naming ``path`` when :func:`checkpoint_problem` finds one."""
    problem = checkpoint_problem(path)
    if problem is not None:
        raise IncompleteCheckpointError(_describe(path, problem))


def load_checked(path: str, load: Callable[[str], Any]) -> Any:
    """``load(path)``; when it fails on a file that is truncated or not a checkpoint, raise that instead.

    Other failures (a ``weights_only`` refusal of a pickled class, a permission error) propagate unchanged.
    """
    try:
        return load(path)
    except Exception as exc:
        problem = (checkpoint_problem(path) or _bad_member(path)) if os.path.isfile(path) else None
        if problem is None:
            raise
        raise IncompleteCheckpointError(_describe(path, problem)) from exc
