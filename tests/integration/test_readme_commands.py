"""Every command shown in README.md (and every experiment in conf/experiment/) is a test (issue 12).

Each ``python examples/train.py ...`` / ``torchrun ...`` / ``python -m lightning_dpmp...`` line of README's code
blocks is classified below; a line that is not fails the first test, so a new README command needs a test too.
Commands that run on CPU run for a few steps (small overrides appended) and must exit 0; those that need GPUs
(``trainer=gpu``, ``experiment=gpt_gpu``) or SLURM are composed and instantiated.

A command's subject is its script and config, not how its ranks are started: single runs execute in a rank pool of
their world size (``run_ranks(..., torchrun=True)``: each pool rank runs the script as a torchrun-launched rank
would), so they pay no imports. The launch paths of ``examples/train.py`` stay real launches elsewhere: Lightning's
popen launcher and torchrun in ``test_hydra_newuser.py``, the multirun sweep in ``test_hydra_sweep.py``, and the two
README sweeps here (a multirun launches each job's ranks itself). ``DPMP_TEST_POOL=0`` runs every command afresh.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_ranks

ROOT = Path(__file__).resolve().parents[2]
QUIET = ["trainer.enable_progress_bar=false", "print_config=false"]
FEW_STEPS = ["trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.limit_val_batches=1"]
SMALL_TEXT = ["data.max_bytes=100000"]

DEFAULT_RUN_TEST = (
    "tests/integration/test_hydra_sweep.py::test_default_run_trains_and_writes_summary_and_consolidated_checkpoint"
)
NEWUSER_TEST = "tests/integration/test_hydra_newuser.py::test_popen_run_with_test_then_eval_under_another_layout"
MULTINODE_TORCHRUN = (
    "torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HOST:29500 examples/train.py"
    " trainer=gpu trainer.num_nodes=2 strategy.dp=2 strategy.mp=8"
)
SLURM_SWEEP = (
    "python examples/train.py -m hydra/launcher=submitit_slurm trainer=gpu trainer.num_nodes=2 strategy.dp=4"
    " strategy.mp=4 hydra.launcher.partition=<partition>"
)

# README command -> how it is tested: ("run", overrides appended), ("compose", overrides) or ("elsewhere", where).
COMMANDS: dict[str, tuple[str, list[str]]] = {
    "python examples/train.py": ("elsewhere", [DEFAULT_RUN_TEST]),
    "python examples/train.py strategy.dp=1 strategy.mp=4": ("run", FEW_STEPS + SMALL_TEXT),
    "python examples/train.py strategy.sequence_parallel=true": ("run", FEW_STEPS + SMALL_TEXT),
    "python examples/train.py experiment=mlp_digits": ("run", FEW_STEPS),
    "python examples/train.py data.path=my.txt trainer=gpu": ("compose", []),
    "python examples/train.py --cfg job": ("run", []),
    "python examples/train.py -m strategy.dp=1,2 strategy.mp=1,2 trainer.max_steps=50": ("run", ["max_world_size=2"]),
    "python examples/train.py experiment=layout_sweep": (
        "run",
        ["max_world_size=2", "trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.limit_val_batches=1"],
    ),
    "torchrun --standalone --nproc_per_node=4 examples/train.py strategy.dp=2 strategy.mp=2": (
        "run", FEW_STEPS + SMALL_TEXT
    ),
    MULTINODE_TORCHRUN: ("compose", []),
    SLURM_SWEEP: ("compose", []),
    "python examples/train.py test=true": ("elsewhere", [NEWUSER_TEST]),
    "python examples/eval.py ckpt_path=outputs/train/<date>/<time>/checkpoints/last.ckpt": (
        "elsewhere", [NEWUSER_TEST]
    ),
    "python examples/train.py debug=default": ("run", SMALL_TEXT),
    "python examples/train.py debug=overfit": ("run", SMALL_TEXT + ["trainer.max_steps=4"]),
    "python examples/train.py debug=profiler": (
        "run", SMALL_TEXT + ["trainer.max_steps=3", "trainer.val_check_interval=3"]
    ),
    "python -m lightning_dpmp.convert checkpoints/last.ckpt last-consolidated.ckpt": (
        "elsewhere", ["tests/distributed/test_checkpoint.py (sharded -> consolidated conversion)"]
    ),
    "python -m lightning_dpmp.costmodel --model gpt-7b --hardware dgx-a100 --devices 64": ("run", []),
    "python -m lightning_dpmp.plan --model benchmarks/data/llama2_7b_config.json --devices 64 --gpus-per-node 8"
    " --hardware h100 --seq 4096 --global-batch 512": ("run", []),
    "python -m lightning_dpmp.plan --model benchmarks/data/llama_bench_config.json --devices 4 --hardware cpu"
    " --seq 128 --global-batch 8 --precision 32-true": ("run", []),
    "python examples/finetune.py": ("run", FEW_STEPS + SMALL_TEXT),
    "python -m lightning_dpmp.convert last.ckpt finetuned/ --hf --config pretrained/": (
        "elsewhere", ["tests/distributed/test_pretrained.py (convert --hf from the consolidated checkpoint)"]
    ),
}
# "run" commands executed in a rank pool of this world size (every other "run" command is launched afresh).
POOLED = {
    "python examples/train.py strategy.dp=1 strategy.mp=4": 4,
    "python examples/train.py strategy.sequence_parallel=true": 4,
    "python examples/train.py experiment=mlp_digits": 4,
    "python examples/train.py --cfg job": 4,  # prints the config in each rank, starts no job
    "torchrun --standalone --nproc_per_node=4 examples/train.py strategy.dp=2 strategy.mp=2": 4,
    "python examples/train.py debug=default": 4,
    "python examples/train.py debug=overfit": 4,
    "python examples/train.py debug=profiler": 4,
    "python -m lightning_dpmp.costmodel --model gpt-7b --hardware dgx-a100 --devices 64": 4,  # no job: ran in each
    "python examples/finetune.py": 4,
}
# conf/experiment/<name>.yaml -> the README command (or the test) that covers it.
EXPERIMENTS = {
    "mlp_digits": "python examples/train.py experiment=mlp_digits",
    "layout_sweep": "python examples/train.py experiment=layout_sweep",
    "gpt_tiny": "tests/integration/test_hydra_sweep.py (every sweep there runs experiment=gpt_tiny)",
    "gpt_gpu": "compose",
    "finetune_hf": "python examples/finetune.py",
}


def readme_commands() -> list[str]:
    """The commands of the bash code blocks of README.md and docs/*.md (continuations joined, comments dropped),
    plus inline ``python -m lightning_dpmp...`` commands."""
    text = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    out: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith(("python examples/", "torchrun ", "python -m lightning_dpmp")):
                out.append(" ".join(line.split()))
    out += [" ".join(m.split()) for m in re.findall(r"`(python -m lightning_dpmp\.\w+ [^`]*)`", text)]
    return list(dict.fromkeys(out))


def test_every_readme_command_and_experiment_is_covered():
    found = readme_commands()
    assert set(found) == set(COMMANDS), {"unclassified": set(found) - set(COMMANDS), "gone": set(COMMANDS) - set(found)}
    assert set(EXPERIMENTS) == {p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml")}
    assert all(v == "compose" or v.startswith("tests/") or v in COMMANDS for v in EXPERIMENTS.values())
    assert all(COMMANDS[c][0] == "run" and "train.py -m" not in c and "sweep" not in c for c in POOLED)  # no multirun


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("corpus_cache")  # one stdlib corpus for every run


def _argv(command: str, extra: list[str], tmp: Path) -> list[str]:
    scripts = ("examples/train.py", "examples/finetune.py")
    args = [str(ROOT / a) if a in scripts else a for a in shlex.split(command)]  # run from tmp_path
    if args[0] == "torchrun":  # the same launcher, without relying on a `torchrun` script on PATH
        args = [sys.executable, "-m", "torch.distributed.run", *args[1:]]
    elif args[0] == "python":
        args = [sys.executable, *args[1:]]
    if "examples/finetune.py" in command:  # its tiny "pretrained" model written under tmp_path, not the checkout
        args.append(f"model.pretrained={tmp / 'tiny-llama'}")
    if any(s in command for s in scripts):
        if "trainer.max_steps=50" in args:
            args[args.index("trainer.max_steps=50")] = "trainer.max_steps=2"  # a few steps, same sweep
        multirun = "-m" in args or "layout_sweep" in command
        out_dir = f"hydra.sweep.dir={tmp / 'sweep'}" if multirun else f"hydra.run.dir={tmp / 'run'}"
        args += [] if "--cfg" in args else [*extra, *QUIET, out_dir]
    return args


RUN = sorted(c for c, (how, _) in COMMANDS.items() if how == "run")
COMPOSE = sorted(c for c, (how, _) in COMMANDS.items() if how == "compose")


@pytest.mark.slow
@pytest.mark.parametrize("command", RUN)
def test_readme_command_runs(command, tmp_path, cache):
    extra_env = {"DPMP_CACHE_DIR": str(cache), "HYDRA_FULL_ERROR": "1"}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra_env}
    argv = _argv(command, COMMANDS[command][1], tmp_path)
    cwd = ROOT if "costmodel" in command or "lightning_dpmp.plan" in command else tmp_path
    if command in POOLED and os.environ.get("DPMP_TEST_POOL", "1") != "0":
        args = argv[1:]  # each pool rank runs `python ARGS`; under torchrun, the script and its arguments
        if args[:2] == ["-m", "torch.distributed.run"]:
            args = args[next(i for i, a in enumerate(args) if a.endswith(".py")):]
        proc = run_ranks(POOLED[command], args, timeout=400, env=extra_env, cwd=cwd, torchrun=True)
    else:
        try:
            proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=400)
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"{argv} did not finish in 400 s:\n{(exc.stderr or '')[-3000:]}")
    assert proc.returncode == 0, (argv, proc.stdout[-2000:], proc.stderr[-4000:])
    if "--cfg" in command:
        assert "_target_: lightning_dpmp.DPMPStrategy" in proc.stdout
    if "experiment=mlp_digits" in command:
        assert "kept whole: out_features=10 <= in_features=128" in proc.stdout + proc.stderr  # the plan printout
    if "finetune.py" in command:  # the fine-tuned model, exported at the end of fit, loads with transformers
        from transformers import AutoModelForCausalLM

        assert AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "finetuned").num_parameters() > 0
    if "train.py -m " in command or "layout_sweep" in command:
        summary = (tmp_path / "sweep" / "summary.csv").read_text()
        assert ",ok," in summary and ",failed," not in summary, summary


@pytest.mark.parametrize("command", COMPOSE + ["experiment=gpt_gpu"])
def test_gpu_and_cluster_commands_compose_and_instantiate(command, tmp_path):
    """Commands that need GPUs or SLURM: the config composes with their overrides and every part but the Trainer
    instantiates (model, optimizer, scheduler, strategy, callbacks, loggers)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from tests.integration.test_hydra_config import _instantiate_all

    args = [a for a in shlex.split(command) if "=" in a and not a.startswith("--")]
    args = [a.replace("<partition>", "debug") for a in args]
    if "data.path=my.txt" in args:
        (tmp_path / "my.txt").write_text("def f(x):\n    return x + 1\n" * 400)
        args[args.index("data.path=my.txt")] = f"data.path={tmp_path / 'my.txt'}"
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", return_hydra_config="hydra/launcher" in command,
                      overrides=[f"paths.output_dir={tmp_path}", f"paths.cache_dir={tmp_path / 'cache'}", *args])
    world = cfg.trainer.devices * cfg.trainer.num_nodes
    assert cfg.trainer.accelerator == "gpu" and world == cfg.strategy.dp * cfg.strategy.mp
    if "hydra/launcher" in command:
        assert "submitit" in cfg.hydra.launcher._target_ and cfg.hydra.launcher.partition == "debug"
    _instantiate_all(cfg, with_data="data.path" in command)
