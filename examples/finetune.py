"""Fine-tune a pretrained Hugging Face model with DPMPStrategy, then export it: ``examples/train.py`` with
``experiment=finetune_hf`` (configured by Hydra, conf/).

    python examples/finetune.py                               # tiny Llama, dp=2 x mp=2 on CPU, exported at the end
    python examples/finetune.py strategy.dp=1 strategy.mp=4   # another layout
    python examples/finetune.py model.pretrained=/path/to/hf_folder   # your own save_pretrained folder

The default ``model.pretrained`` (``outputs/pretrained/tiny-llama``) is written first if missing: a 2-layer Llama
over the 256 byte values, random weights saved with ``save_pretrained`` (no download), standing in for a
pretrained checkpoint. Each rank then reads only its slices of it (``lightning_dpmp.from_pretrained``), trains,
and ``<run dir>/finetuned`` receives the fine-tuned model, loadable with ``AutoModelForCausalLM.from_pretrained``.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    if not any(a.startswith(("experiment=", "+experiment=")) for a in sys.argv[1:]):
        sys.argv.append("experiment=finetune_hf")  # the launcher's children re-run this argv: the same config
    runpy.run_path(str(Path(__file__).with_name("train.py")), run_name="__main__")
