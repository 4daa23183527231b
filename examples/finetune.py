"""Fine-tune a pretrained Hugging Face model with DPMPStrategy, then export it (configured by Hydra, conf/).

    python examples/finetune.py                               # tiny Llama, dp=2 x mp=2 on CPU, exported at the end
    python examples/finetune.py strategy.dp=1 strategy.mp=4   # another layout
    python examples/finetune.py model.pretrained=/path/to/hf_folder   # your own save_pretrained folder

The default ``model.pretrained`` (``outputs/pretrained/tiny-llama``) is written first if missing: a 2-layer Llama
over the 256 byte values, random weights saved with ``save_pretrained`` (no download), standing in for a
pretrained checkpoint. Each rank then reads only its slices of it (``lightning_dpmp.from_pretrained``), trains,
and ``<run dir>/finetuned`` receives the fine-tuned model, loadable with ``AutoModelForCausalLM.from_pretrained``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `examples.*` and `lightning_dpmp` importable without installing
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("PROJECT_ROOT", str(ROOT))
os.environ["DPMP_ENTRY_SCRIPT"] = str(Path(__file__).resolve())  # for sweep workers: see entry_script()

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

import examples.config  # noqa: E402,F401  (registers the typed schemas and resolvers)
from examples.models.hf import write_tiny_pretrained  # noqa: E402
from examples.training import external_rank_overrides, train  # noqa: E402


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    """Hydra entry point; returns the final validation loss."""
    if "LOCAL_RANK" not in os.environ:  # the launcher's children find it written
        write_tiny_pretrained(str(cfg.model.pretrained))
    summary = train(cfg)
    return summary.get("final_val_loss")


if __name__ == "__main__":
    if not any(a.startswith(("experiment=", "+experiment=")) for a in sys.argv[1:]):
        sys.argv.append("experiment=finetune_hf")
    sys.argv += external_rank_overrides(sys.argv)
    main()
