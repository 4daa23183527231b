"""``python -m lightning_dpmp.convert SHARDED_DIR OUT.ckpt``: the public name of
:mod:`lightning_dpmp.checkpoint.convert` (sharded folder -> one consolidated checkpoint)."""

import sys

from lightning_dpmp.checkpoint.convert import convert, main

__all__ = ["convert", "main"]

if __name__ == "__main__":
    sys.exit(main())
