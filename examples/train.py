"""Train an example model with DPMPStrategy, configured by Hydra (conf/).

    python examples/train.py                                  # GPT on stdlib bytes, dp=2 x mp=2 on CPU
    python examples/train.py strategy.dp=1 strategy.mp=4      # another layout; trainer.devices follows
    python examples/train.py experiment=mlp_digits            # residual MLP on sklearn digits
    python examples/train.py -m strategy.dp=1,2 strategy.mp=1,2 trainer.max_steps=50   # layout sweep
    python examples/train.py test=true                        # then trainer.test on the best checkpoint
    python examples/train.py debug=default                    # a few batches of everything (also: overfit, profiler)
    python examples/train.py --cfg job                        # print the composed config
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
from examples.training import external_rank_overrides, train  # noqa: E402  (imports Lightning before Hydra sets up logging: no doubled lines)


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    """Hydra entry point; returns the final validation loss (usable by sweepers such as Optuna)."""
    summary = train(cfg)
    return summary.get("final_val_loss")


if __name__ == "__main__":
    sys.argv += external_rank_overrides(sys.argv)  # torchrun/srun: ranks > 0 log into rank 0's run folder
    main()
