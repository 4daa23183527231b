"""Test (or validate) a checkpoint written by examples/train.py, under any layout, configured by Hydra (conf/eval.yaml).

    python examples/eval.py ckpt_path=<run dir>/checkpoints/last.ckpt                       # same overrides as the run
    python examples/eval.py ckpt_path=<...>.ckpt strategy.dp=1 strategy.mp=2 stage=validate  # another layout
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("PROJECT_ROOT", str(ROOT))
os.environ["DPMP_ENTRY_SCRIPT"] = str(Path(__file__).resolve())  # for sweep workers: see entry_script()

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

import examples.config  # noqa: E402,F401  (schemas and resolvers)
from examples.evaluation import evaluate  # noqa: E402  (imports Lightning before Hydra sets up logging)
from examples.training import external_rank_overrides  # noqa: E402


@hydra.main(config_path="../conf", config_name="eval", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    """Hydra entry point; returns the test (or validation) loss."""
    metrics = evaluate(cfg).get("metrics") or {}
    return metrics.get(f"{cfg.stage}/loss", metrics.get("val/loss"))


if __name__ == "__main__":
    sys.argv += external_rank_overrides(sys.argv)
    main()
