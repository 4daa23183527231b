"""Every config in conf/ composes and instantiates; typed fields fail at compose time with Hydra's own message."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

import examples.config  # noqa: F401  (schemas and resolvers)
from examples.training import instantiate_callbacks, instantiate_loggers, instantiate_strategy, max_world_size

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


def _compose(tmp_path: Path, *overrides: str) -> DictConfig:
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(
            config_name="config",
            overrides=[f"paths.output_dir={tmp_path}", f"paths.cache_dir={tmp_path / 'cache'}", *overrides],
        )


def _instantiate_all(cfg: DictConfig, with_data: bool = True) -> None:
    if with_data:
        data = instantiate(cfg.data)
        data.setup("fit")
        assert len(data.train_dataloader()) > 0 and len(data.val_dataloader()) > 0
    optimizer = instantiate(cfg.optimizer) if cfg.get("optimizer") else None
    assert optimizer is None or isinstance(optimizer, functools.partial)  # _partial_: true
    scheduler = instantiate(cfg.scheduler) if cfg.get("scheduler") else None
    model = instantiate(cfg.model, optimizer=optimizer, scheduler=scheduler)
    assert isinstance(model, torch.nn.Module) and sum(p.numel() for p in model.parameters()) > 0
    if optimizer is not None:
        opt = optimizer(params=model.parameters())
        if scheduler is not None:
            scheduler(optimizer=opt, total_steps=10)
    strategy = instantiate_strategy(cfg.strategy)
    assert type(strategy).__name__ == "DPMPStrategy"
    instantiate_callbacks(cfg.get("callbacks"))
    if "tensorboard" not in (cfg.get("logger") or {}) or importlib.util.find_spec("tensorboard"):
        instantiate_loggers(cfg.get("logger"))
    assert cfg.trainer.devices == cfg.strategy.dp * cfg.strategy.mp // cfg.trainer.num_nodes


def test_default_config_composes_and_instantiates(tmp_path):
    cfg = _compose(tmp_path, "data.max_bytes=100000")
    assert cfg.strategy._target_ == "lightning_dpmp.DPMPStrategy"
    assert (cfg.strategy.dp, cfg.strategy.mp, cfg.trainer.devices) == (2, 2, 4)
    assert cfg.model.net.block_size == cfg.data.block_size
    _instantiate_all(cfg)


def test_default_trainer_instantiates_with_the_strategy(tmp_path):
    cfg = _compose(tmp_path, "strategy.dp=1", "strategy.mp=2")
    trainer = instantiate(cfg.trainer, strategy=instantiate_strategy(cfg.strategy), logger=False)
    assert trainer.world_size == 2 and trainer.num_devices == 2
    assert trainer.max_steps == cfg.trainer.max_steps


def test_zero_is_a_typed_strategy_option(tmp_path):
    cfg = _compose(tmp_path, "strategy.zero=3")
    assert instantiate_strategy(cfg.strategy).zero == 3
    with pytest.raises(Exception, match="zero"):
        _compose(tmp_path, "strategy.zero=three")  # typed: fails while composing


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_and_instantiates(tmp_path, experiment):
    extra = [f"model.pretrained={tmp_path / 'tiny-llama'}"] if experiment == "finetune_hf" else []  # written there
    cfg = _compose(tmp_path, f"experiment={experiment}", *extra)
    _instantiate_all(cfg, with_data=experiment != "gpt_gpu")  # gpt_gpu reads 20 MB of corpus


@pytest.mark.parametrize(
    "overrides",
    [
        ["model=mlp", "data=digits"],
        ["optimizer=sgd"],
        ["~scheduler"],
        ["logger=tensorboard"],
        ["~logger", "callbacks=none"],
        ["trainer=gpu"],
        ["strategy.dp=1", "strategy.mp=4", "strategy.verify_plan=false", "strategy.timeout.seconds=30"],
        ["strategy.plan_overrides={net.blocks.*.mlp.fc1:column,net.blocks.*.mlp.fc2:row}",
         "+strategy.ddp.bucket_cap_mb=50"],
    ],
    ids=lambda o: " ".join(o),
)
def test_every_group_option_composes_and_instantiates(tmp_path, overrides):
    small = [] if "data=digits" in overrides else ["data.max_bytes=100000"]
    cfg = _compose(tmp_path, *small, *overrides)
    _instantiate_all(cfg)


def test_plan_override_reaches_the_strategy(tmp_path):
    cfg = _compose(tmp_path, "strategy.plan_overrides={net.blocks.*.mlp.fc1:column,net.lm_head:replicate}")
    plan = {"net.blocks.*.mlp.fc1": "column", "net.lm_head": "replicate"}
    assert OmegaConf.to_container(cfg.strategy.plan_overrides) == plan
    assert instantiate_strategy(cfg.strategy).plan_overrides == plan


def test_devices_follow_the_layout_and_nodes(tmp_path):
    cfg = _compose(tmp_path, "strategy.dp=4", "strategy.mp=2", "trainer.num_nodes=2")
    assert cfg.trainer.devices == 4
    cfg = _compose(tmp_path, "strategy.dp=3", "strategy.mp=1", "trainer.num_nodes=2")
    with pytest.raises(Exception, match="cannot be split evenly over num_nodes = 2"):
        _ = cfg.trainer.devices


@pytest.mark.parametrize(
    ("override", "key"),
    [("strategy.dp=two", "strategy.dp"), ("strategy.mp=1.5", "strategy.mp"),
     ("model.net.n_layer=four", "model.net.n_layer"), ("strategy.verify_plan=maybe", "strategy.verify_plan"),
     ("seed=abc", "seed")],
)  # fmt: skip
def test_wrong_types_fail_at_compose_time(tmp_path, override, key):
    with pytest.raises(ConfigCompositionException) as err:
        _compose(tmp_path, override)
    message = f"{err.value}\n{err.value.__cause__}"
    assert f"Error merging override {override}" in message
    assert key in message


def test_unknown_strategy_field_fails_at_compose_time(tmp_path):
    with pytest.raises(ConfigCompositionException, match="strategy.dpp"):
        _compose(tmp_path, "strategy.dpp=2")


def test_max_world_size_defaults(tmp_path):
    cfg = _compose(tmp_path)
    assert max_world_size(cfg) >= 4  # os.cpu_count() * 4 on CPU
    assert max_world_size(_compose(tmp_path, "max_world_size=3")) == 3
    assert max_world_size(_compose(tmp_path, "trainer=gpu")) == torch.cuda.device_count()
