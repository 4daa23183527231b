"""``python -m lightning_dpmp.convert SHARDED_DIR OUT.ckpt`` and ``python -m lightning_dpmp.convert CKPT OUT_DIR
--hf --config BASE_DIR``: the public name of :mod:`lightning_dpmp.checkpoint.convert` (sharded folder -> one
consolidated checkpoint; either format -> a Hugging Face folder)."""

import sys

from lightning_dpmp.checkpoint.convert import convert, convert_hf, main

__all__ = ["convert", "convert_hf", "main"]

if __name__ == "__main__":
    sys.exit(main())
