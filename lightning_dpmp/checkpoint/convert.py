"""Convert a sharded checkpoint folder into one consolidated file that the plain model loads.

The output is an ordinary Lightning checkpoint (dense ``state_dict`` under the model's own names, dense optimizer
state, loops, schedulers, hyper-parameters), readable with ``torch.load(..., weights_only=True)`` and
``model.load_state_dict(..., strict=True)`` without this package, and resumable with ``Trainer.fit(ckpt_path=...)``
under any strategy. The conversion runs in one process without a process group and holds the whole state in memory.

Example:
    >>> convert("checkpoints/last.ckpt", "last-consolidated.ckpt")   # doctest: +SKIP
    {'tensors': 18, 'parameters': 2499, 'optimizer_states': 1}

Command line::

    python -m lightning_dpmp.checkpoint.convert SHARDED_DIR OUT.ckpt
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Optional

from torch import Tensor

from lightning_dpmp.checkpoint.files import atomic_save
from lightning_dpmp.checkpoint.sharded import load_sharded_full

__all__ = ["convert", "main"]


def convert(sharded_dir: str, out_path: str) -> dict[str, Any]:
    """Write the consolidated form of ``sharded_dir`` to ``out_path`` (atomically) and return a short summary."""
    checkpoint = load_sharded_full(str(sharded_dir))
    if isinstance(checkpoint.get("dpmp"), dict):
        checkpoint["dpmp"]["format"] = "consolidated"
    atomic_save(checkpoint, str(out_path))
    tensors = [v for v in checkpoint["state_dict"].values() if isinstance(v, Tensor)]
    return {
        "tensors": len(tensors),
        "parameters": sum(t.numel() for t in tensors),
        "optimizer_states": len(checkpoint.get("optimizer_states", [])),
    }


def main(argv: Optional[list[str]] = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_dpmp.convert",
        description="Convert a sharded DPMPStrategy checkpoint folder into one consolidated .ckpt file.",
    )
    parser.add_argument("sharded_dir", help="folder written with DPMPStrategy(save_distributed_checkpoint=True)")
    parser.add_argument("out", help="consolidated checkpoint file to write")
    args = parser.parse_args(argv)
    try:
        summary = convert(args.sharded_dir, args.out)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(
        f"wrote {args.out}: {summary['tensors']} tensors, {summary['parameters']:,} model values,"
        f" {summary['optimizer_states']} optimizer state(s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
