"""The public name of :mod:`lightning_dpmp.planner.profile` under ``tools`` (where it lived before the strategy's
setup-time layout search, in ``integration``, came to use it: ``integration`` may not import ``tools``)."""

from lightning_dpmp.planner.profile import ModelProfile, config_sizes, profile_config, profile_step, token_tensor

__all__ = ["ModelProfile", "config_sizes", "profile_config", "profile_step", "token_tensor"]
