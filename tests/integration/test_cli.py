"""LightningCLI configures DPMPStrategy by ``class_path`` and init args, and ``--print_config`` output loads back.

jsonargparse fills every parameter behind ``**ddp_kwargs`` (DistributedDataParallel's signature, with
``process_group=None``); the strategy used to refuse that and exit 1.

The subject is the command line, not the launch: the runs go to the rank pool of their ``--trainer.devices``, except
``--print_config``, whose output must be one process's.
"""

from __future__ import annotations

import pytest

from tests.conftest import run_ranks, run_script

pytest.importorskip("jsonargparse")

WORKER = "tests/integration/cli_worker.py"
FLAGS = ["--trainer.accelerator=cpu", "--trainer.logger=false", "--trainer.enable_checkpointing=false",
         "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", "--trainer.max_steps=2",
         "--trainer.strategy=lightning_dpmp.DPMPStrategy"]


@pytest.mark.slow
def test_class_path_and_init_args_build_the_strategy():
    """The issue's command line, dp=2 x mp=2 on 4 devices: built without starting any process."""
    proc = run_ranks(4, [WORKER, *FLAGS, "--trainer.devices=4", "--trainer.strategy.dp=2", "--trainer.strategy.mp=2"],
                     env={"DPMP_CLI_RUN": "0"}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "STRATEGY DPMPStrategy dp=2 mp=2 ddp_kwargs={}" in proc.stdout  # DDP's defaults are not carried along


@pytest.mark.slow
def test_cli_still_refuses_a_real_process_group():
    proc = run_ranks(2, [WORKER, *FLAGS, "--trainer.devices=2", "--trainer.strategy.mp=2",
                         "--trainer.strategy.process_group=my_group"], env={"DPMP_CLI_RUN": "0"}, timeout=120)
    assert proc.returncode != 0 and "do not pass `process_group`" in proc.stderr


@pytest.mark.slow
def test_print_config_loads_back_and_trains(tmp_path):
    layout = ["--trainer.devices=2", "--trainer.strategy.dp=1", "--trainer.strategy.mp=2"]
    proc = run_script([WORKER, "fit", *FLAGS, *layout, "--print_config"], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = tmp_path / "c.yaml"
    config.write_text(proc.stdout)
    assert "class_path: lightning_dpmp.DPMPStrategy" in proc.stdout and "process_group: null" in proc.stdout
    # default_root_dir: LightningCLI writes its config.yaml there (else into the repo root).
    proc = run_ranks(2, [WORKER, "fit", "--config", str(config), f"--trainer.default_root_dir={tmp_path}"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "TRAINED global_step=2 grid=1x2" in proc.stdout
