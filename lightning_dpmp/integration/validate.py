"""Check what the user gave as early as it is known, and say it once: at construction, before launch, at setup.

A bad argument found after the processes started costs a trace of the model and prints one traceback per rank
(48 s and 4 tracebacks for a misspelt style name; 8 under Hydra). So each check runs at the first point where
its information exists:

* when the ``Trainer`` is built (the strategy's ``set_world_ranks``, devices known, no process started):
  ``process_group_backend="nccl"`` on CPU devices (:func:`check_backend`: NCCL would fail or hang at init) and
  ``sync_batchnorm=True`` with ``mp > 1`` (:func:`check_sync_batchnorm`: each batch would count mp times).
* construction (:func:`check_init_args`, :func:`ddp_kwargs_from_user`): the types and values of every plain
  constructor argument, and style names with a did-you-mean. No model, no processes.
* before launch (:func:`check_before_launch`, called by the launcher with ``fit``'s arguments): the plan's globs and
  forced splits against the model's structure, and ``ckpt_path`` (exists, not truncated). Only the launching
  process runs it with the popen launcher; under torchrun every rank does, and only rank 0 reports.
* setup (:func:`check_plan_at_setup`): the same plan checks for a model built in ``configure_model``; rank 0 raises,
  the other ranks exit quietly with code 1 (:func:`only_rank_zero_reports`).
* after planning and at train start, warnings on rank 0: mp > 1 that splits nothing (:func:`warn_if_mp_idle`), a
  dataset smaller than dp (:func:`warn_if_data_smaller_than_dp`), data Lightning cannot shard over DP
  (``use_distributed_sampler=False`` or an ``IterableDataset``: :func:`warn_if_data_not_sharded`; each DP rank must
  read its own part by ``strategy.dp_rank`` / ``strategy.dp_size``), MP groups that cross nodes
  (:func:`warn_if_mp_spans_nodes`).

What happens when a rank fails at run time is measured in ``tests/integration/test_reliability.py``: gloo raises
"Connection closed by peer" on the survivors as soon as the failed process is gone, Lightning's launcher (or
torchrun's agent) kills the rest, and the process-group timeout (``DPMPStrategy(timeout=...)``) bounds the
remaining case, a peer that is alive but never joins the collective.

Example:
    >>> check_init_args(plan_overrides={"fc1": "colum"})
    Traceback (most recent call last):
    ...
    ValueError: plan['fc1'] = 'colum' is not a style (did you mean 'column'?); choose one of column, row, ...
    >>> check_backend("gloo", [torch.device("cpu")] * 4)
    >>> check_sync_batchnorm(None, mp=2)
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import os
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, IterableDataset  # noqa: F401  (DataLoader: doctest)

from lightning_dpmp.checkpoint.integrity import check_checkpoint_file
from lightning_dpmp.compat import compiled_by_user
from lightning_dpmp.integration.activations import check_activation_checkpointing
from lightning_dpmp.parallel.compiled import compiled_by_strategy
from lightning_dpmp.planner.user_plan import PlanOverrides, UserPlan, check_plan_on_model

__all__ = [
    "DataShardingWarning",
    "DataSizeWarning",
    "IdleModelParallelWarning",
    "advise_our_arguments",
    "check_averaging_callbacks",
    "check_backend",
    "check_before_launch",
    "check_ckpt_path",
    "check_init_args",
    "check_not_compiled",
    "check_plan_at_setup",
    "check_reshard_after_forward",
    "check_recompute",
    "check_sync_batchnorm",
    "check_ddp_kwargs_with_dtensors",
    "check_zero_without_ddp",
    "ddp_kwargs_from_user",
    "loaders_of",
    "only_rank_zero_reports",
    "warn_if_data_smaller_than_dp",
    "warn_if_data_not_sharded",
    "warn_if_mp_idle",
    "warn_if_mp_spans_nodes",
]

_START_METHODS = ("popen", "spawn", "fork", "forkserver")
_FLAGS = ("sequence_parallel", "verify_plan", "consolidate_on_teardown", "save_distributed_checkpoint")
# ckpt_path values Lightning resolves itself (checkpoint connector), not file names.
_SPECIAL_CKPT = ("last", "best", "hpc", "registry")
# Errors that describe the user's input: the ones a non-zero rank leaves to rank 0 to report.
_INPUT_ERRORS = (ValueError, TypeError, FileNotFoundError)


class IdleModelParallelWarning(UserWarning):
    """``mp > 1``, but the plan splits no parameter: every MP rank computes the whole model."""


class DataShardingWarning(UserWarning):
    """The training data is not sharded by Lightning; each DP rank must read its own part."""


class DataSizeWarning(UserWarning):
    """The training dataset is smaller than ``dp``: the DistributedSampler repeats samples to give each replica one."""


# ---------------------------------------------------------------------------------------------- construction
def check_backend(backend: Optional[str], devices: Sequence[torch.device]) -> None:
    """Refuse NCCL for non-CUDA devices, or where this torch build has no NCCL.

    Example:
        >>> check_backend("nccl", [torch.device("cpu")] * 2)
        Traceback (most recent call last):
        ...
        ValueError: process_group_backend='nccl' needs CUDA devices, but the Trainer runs on 2 cpu device(s). ...
    """
    if backend != "nccl":
        return
    kinds = sorted({d.type for d in devices})
    if kinds != ["cuda"]:
        raise ValueError(
            f"process_group_backend='nccl' needs CUDA devices, but the Trainer runs on {len(devices)}"
            f" {'/'.join(kinds)} device(s). Use process_group_backend='gloo' (or leave it unset: gloo on CPU, nccl on"
            " CUDA), or Trainer(accelerator='gpu')."
        )
    if not (dist.is_available() and dist.is_nccl_available()):
        raise ValueError(
            f"process_group_backend='nccl', but this torch build ({torch.__version__}) has no NCCL. Install a CUDA"
            " build of torch, or use process_group_backend='gloo'."
        )


def check_sync_batchnorm(layer_sync: Any, mp: int) -> None:
    """Refuse ``Trainer(sync_batchnorm=True)`` with ``mp > 1`` (statistics would be synchronised over the world).

    Example:
        >>> check_sync_batchnorm(object(), mp=2)
        Traceback (most recent call last):
        ...
        ValueError: sync_batchnorm=True is not supported with mp=2: BatchNorm statistics would be synchronised ...
    """
    if layer_sync is not None and mp > 1:
        raise ValueError(
            f"sync_batchnorm=True is not supported with mp={mp}: BatchNorm statistics would be synchronised over the"
            f" whole world, where the mp={mp} ranks of an MP group hold the same batch, so each sample would count"
            f" {mp} times. Use Trainer(sync_batchnorm=False), or mp=1."
        )


def check_init_args(
    plan_overrides: Any = None,
    sequence_parallel: Any = False,
    verify_plan: Any = True,
    consolidate_on_teardown: Any = "rank0",
    save_distributed_checkpoint: Any = False,
    process_group_backend: Any = None,
    start_method: Any = "popen",
    timeout: Any = None,
) -> PlanOverrides:
    """Refuse wrong types and unknown values of :class:`DPMPStrategy`'s plain arguments (the sizes, ``zero`` and the
    pipeline's settings are the :class:`~lightning_dpmp.parallel.topology.Topology`'s to check, and
    ``check_consistency_every_n_steps`` is checked where it is used); returns ``plan_overrides`` parsed, the one
    :class:`PlanOverrides` every later plan check and ``mp="auto"`` use."""
    if timeout is not None and (not isinstance(timeout, timedelta) or timeout <= timedelta(0)):
        hint = (f": pass timeout=timedelta(seconds={timeout!r})" if isinstance(timeout, (int, float))
                and not isinstance(timeout, bool) and timeout > 0 else "")
        raise ValueError(
            f"`timeout` must be a positive datetime.timedelta (or None: 10 minutes), got {timeout!r}{hint}."
        )
    overrides = PlanOverrides.parse(plan_overrides)
    values = dict(zip(_FLAGS, (sequence_parallel, verify_plan, consolidate_on_teardown, save_distributed_checkpoint)))
    if consolidate_on_teardown == "rank0":
        values.pop("consolidate_on_teardown")
    elif not isinstance(consolidate_on_teardown, bool):
        raise TypeError(f"`consolidate_on_teardown` must be 'rank0', True or False, got {consolidate_on_teardown!r}"
                        f" ({type(consolidate_on_teardown).__name__}).")
    for name, value in values.items():
        if not isinstance(value, bool):
            raise TypeError(f"`{name}` must be True or False, got {value!r} ({type(value).__name__}).")
    if process_group_backend is not None and not isinstance(process_group_backend, str):
        raise TypeError(
            f"`process_group_backend` must be a backend name ('gloo', 'nccl') or None, got {process_group_backend!r}."
        )
    if start_method not in _START_METHODS:
        close = difflib.get_close_matches(str(start_method), _START_METHODS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"`start_method` must be one of {', '.join(_START_METHODS)}, got {start_method!r}{hint}.")
    return overrides


def check_zero_without_ddp(zero: int, ddp_kwargs: Mapping[str, Any]) -> None:
    """zero>=1 reduce-scatters the gradients itself, with no DDP wrapper: DDP options would be ignored."""
    if zero >= 1 and ddp_kwargs:
        raise ValueError(
            f"zero={zero} shards gradients over DP without DistributedDataParallel, so DDP options do not apply;"
            f" got {sorted(ddp_kwargs)}. Drop them (parameters a step may leave out are found from the traced step),"
            " or use zero=0."
        )


#: The DDP options the DTensor parameters' own DP all-reduce honours: its bucket size, and the request to find
#: parameters a step leaves out (it always does: each keeps a None gradient where no DP rank used it).
DTENSOR_DP_OPTIONS = ("bucket_cap_mb", "find_unused_parameters")


def check_ddp_kwargs_with_dtensors(ddp_kwargs: Mapping[str, Any], mp: Any) -> None:
    """With mp > 1 (at zero=0, no pipeline) the parameters are DTensors, which ``DistributedDataParallel`` cannot
    hold: the strategy averages the DP gradients itself, so DDP's other options would be ignored; refuse them."""
    ignored = sorted(k for k in ddp_kwargs if k not in DTENSOR_DP_OPTIONS)
    if isinstance(mp, int) and mp > 1 and ignored:
        raise ValueError(
            f"DPMPStrategy(mp={mp}) averages the data-parallel gradients itself (its parameters are DTensors, which"
            f" DistributedDataParallel cannot hold), so the DDP options {ignored} do not apply; drop them (only"
            f" {', '.join(DTENSOR_DP_OPTIONS)} are honoured), or use mp=1."
        )


def check_mixed_precision(policy: Any, zero: int, dp: Any) -> None:
    """``mixed_precision`` is the ZeRO engine's (zero >= 2, dp > 1): refuse it anywhere it would be ignored, and
    refuse a policy whose dtypes are not floating-point (or ``None``: the parameters' own)."""
    if policy is None:
        return
    if zero < 2 or dp == 1:
        raise ValueError(
            f"mixed_precision= is applied by the ZeRO-2/3 engine, which shards over data-parallel ranks; got"
            f" zero={zero} and dp={dp}. Use zero=2 or 3 with dp > 1, or precision='bf16-mixed' (autocast) for"
            " every layout."
        )
    for field in ("param_dtype", "reduce_dtype"):
        dtype = getattr(policy, field, None)
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"mixed_precision.{field} must be a floating-point torch.dtype or None, got {dtype!r}.")
    if getattr(policy, "output_dtype", None) is not None:
        raise ValueError("mixed_precision.output_dtype is not supported (outputs keep the compute dtype); leave it"
                         " None.")


def check_reshard_after_forward(reshard_after_forward: Any, zero: int) -> None:
    """``reshard_after_forward`` is zero=3's (FSDP2's option of that name): refuse a non-boolean, and ``False`` at a
    level that never frees the parameters (zero 0-2 hold them whole, so it would change nothing).

    Example:
        >>> check_reshard_after_forward(False, 3)
        >>> check_reshard_after_forward(False, 1)
        Traceback (most recent call last):
        ...
        ValueError: reshard_after_forward=False applies to zero=3 (parameters freed between uses); got zero=1,
            which keeps the parameters whole already. Set zero=3, or leave reshard_after_forward=True.
    """
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(f"`reshard_after_forward` must be True or False, got {reshard_after_forward!r} "
                        f"({type(reshard_after_forward).__name__}).")
    if not reshard_after_forward and zero != 3:
        raise ValueError(
            f"reshard_after_forward=False applies to zero=3 (parameters freed between uses); got zero={zero}, which"
            f" keeps the parameters whole already. Set zero=3, or leave reshard_after_forward=True."
        )


def check_recompute(activation_checkpointing: Any, compile: Any = False) -> None:
    """Refuse an ``activation_checkpointing`` other than ``None``/``"blocks"``/``"auto"``, and with ``compile=True``
    (a compiled block under a recompute is not proven exact yet)."""
    check_activation_checkpointing(activation_checkpointing)
    if activation_checkpointing is not None and compile:
        raise ValueError(f"activation_checkpointing={activation_checkpointing!r} with compile=True is not supported "
                         "yet: the recompute of a compiled block is not proven exact; use one of the two.")


def check_speed_flags(compile: Any = False, async_grad_allreduce: Any = None) -> None:
    """Refuse non-boolean ``compile`` and ``async_grad_allreduce`` (which may also be ``None``: by device)."""
    if not isinstance(compile, bool):
        raise TypeError(f"`compile` must be True or False, got {compile!r} ({type(compile).__name__}).")
    if async_grad_allreduce is not None and not isinstance(async_grad_allreduce, bool):
        raise TypeError(f"`async_grad_allreduce` must be True, False or None (on for CUDA), got "
                        f"{async_grad_allreduce!r} ({type(async_grad_allreduce).__name__}).")


#: Arguments of earlier versions, refused with their replacement (they would otherwise reach DDP as unknown kwargs).
_REMOVED = {"timeout_s": "`timeout=timedelta(seconds=...)`", "plan": "`plan_overrides=`"}


def ddp_kwargs_from_user(ddp_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The ``**ddp_kwargs`` to keep: those that differ from ``DistributedDataParallel``'s own defaults.

    LightningCLI (jsonargparse) fills every parameter of the signature behind ``**kwargs``, ``process_group=None``
    included; a default changes nothing, so it is dropped. A real ``process_group`` or ``device_mesh`` is refused:
    the strategy builds the DP group itself.
    """
    for key, use in _REMOVED.items():
        if key in ddp_kwargs:
            raise TypeError(f"DPMPStrategy has no argument `{key}`: use {use}.")
    for key in ("process_group", "device_mesh"):
        if ddp_kwargs.get(key) is not None:
            raise ValueError(f"DPMPStrategy builds the DP process group itself; do not pass `{key}`.")
    # DDPStrategy's own options (ddp_comm_hook, model_averaging_period, ...) reach us through **ddp_kwargs too.
    defaults = {
        n: p.default
        for init in (DistributedDataParallel.__init__, DDPStrategy.__init__)
        for n, p in inspect.signature(init).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    return {k: v for k, v in ddp_kwargs.items() if not (k in defaults and _same(v, defaults[k]))}


def _same(value: Any, default: Any) -> bool:
    if value is None or default is None or isinstance(value, bool) or isinstance(default, bool):
        return value is default
    return type(value) is type(default) and isinstance(value, (int, float, str)) and value == default


# ---------------------------------------------------------------------------------------------- before launch
@contextlib.contextmanager
def only_rank_zero_reports(global_rank: int, grace_s: float = 10.0) -> Iterator[None]:
    """On rank 0 an input error propagates; on the other ranks it becomes a quiet ``SystemExit(1)``.

    Use it only around checks that fail the same way on every rank (they read the same arguments and model), so
    that rank 0 is sure to report what the others leave unsaid. The other ranks wait up to ``grace_s`` first:
    exiting at once, a rank would be torchrun's "root cause" and rank 0 could be SIGTERMed before its message is
    out (seen). Rank 0's exit ends them sooner (torchrun's agent, or the popen children's parent-death signal).
    """
    try:
        yield
    except _INPUT_ERRORS:
        if global_rank == 0:
            raise
        time.sleep(grace_s)
        raise SystemExit(1) from None


def check_ckpt_path(ckpt_path: Any) -> None:
    """A local ``ckpt_path`` must exist and, if it is a file, be a complete ``torch.save`` archive."""
    if ckpt_path is None:
        return
    path = os.fspath(ckpt_path)
    if not isinstance(path, str) or "://" in path or path in _SPECIAL_CKPT or path.startswith("registry:"):
        return
    from lightning_dpmp.checkpoint.files import recover_path

    found = recover_path(path)
    if not os.path.exists(found):
        folder = os.path.dirname(os.path.abspath(path))
        near = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
        close = difflib.get_close_matches(os.path.basename(path), near, n=1)
        hint = f" Did you mean {os.path.join(os.path.dirname(path), close[0])!r}?" if close else ""
        where = "" if os.path.isdir(folder) else f" (the folder {folder!r} does not exist either)"
        raise FileNotFoundError(f"ckpt_path={path!r} does not exist{where}.{hint}")
    if os.path.isfile(found):
        check_checkpoint_file(found)


def _call_arguments(function: Callable, args: tuple, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    try:
        return dict(inspect.signature(function).bind_partial(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        return {}


def check_before_launch(trainer: Any, function: Callable, args: tuple, kwargs: Mapping[str, Any]) -> None:
    """The checks that need the model or ``ckpt_path``: run by the launcher before any child process starts.

    ``function`` is the Trainer's ``_fit_impl`` (or ``_validate_impl`` ...) and ``args``/``kwargs`` are the
    arguments it will get; they are read by name, so their order does not matter.
    """
    strategy = trainer.strategy
    call = _call_arguments(function, args, kwargs)
    with only_rank_zero_reports(strategy.global_rank):
        check_ckpt_path(call.get("ckpt_path"))
        model = call.get("model")
        if model is not None:
            check_not_compiled(model)
        if model is not None and not _builds_in_configure_model(model) and not strategy.layout_pending:  # else at setup
            check_plan_on_model(model, strategy.parsed_plan_overrides, strategy.mp)
        if not strategy.layout_pending:  # else at setup, once mp is chosen
            check_averaging_callbacks(trainer.callbacks, strategy.mp, getattr(strategy, "zero", 0),
                                      trainer.state.fn, strategy.checkpointer.distributed)


def _builds_in_configure_model(model: Any) -> bool:
    """Whether layers may still appear in ``configure_model`` (then the structure is only known at setup)."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    return is_overridden("configure_model", model) or is_overridden("configure_sharded_model", model)


def check_averaging_callbacks(callbacks: Any, mp: int, zero: int, stage: Any, distributed: bool = False) -> None:
    """Refuse weight-averaging callbacks (``StochasticWeightAveraging``, ``WeightAveraging``/``EMAWeightAveraging``)
    where their average cannot be exact: zero=3 (parameters freed between uses) and, with split layers, sharded
    checkpoints. Elsewhere :mod:`lightning_dpmp.integration.averaging` makes them average the MP shards.

    Example:
        >>> check_averaging_callbacks([], mp=2, zero=3, stage="fit")   # nothing to refuse
    """
    if stage != "fit" or (zero < 3 and not (distributed and mp > 1)):  # a TrainerFn compares equal to its value
        return
    from lightning_dpmp.integration.averaging import averaging_callbacks

    for cb in averaging_callbacks(callbacks):
        why = ("zero=3 frees the parameters between uses" if zero >= 3 else
               "sharded checkpoints (save_distributed_checkpoint=True) have no place for its averaged copy")
        raise ValueError(
            f"{type(cb).__name__} keeps a copy of the model to average into, but {why}. Use zero<=2 and consolidated"
            " checkpoints (save_distributed_checkpoint=False) with this callback."
        )


def check_not_compiled(model: Any) -> None:
    """Refuse a model that the user compiled with ``torch.compile`` before ``fit``.

    The planner must trace and split the original layers: under Dynamo the trace fails (an unverified plan that
    gathers every layer's output), and a compiled LightningModule's step methods are compiled copies that the split
    does not reach. Tracing through is not offered because compiled training is not yet proven exact against
    single-process training (``compile=True`` is applied after the split and the eager verification instead).
    """
    for name, module in model.named_modules():
        how = None if compiled_by_strategy(module) else compiled_by_user(module)
        if how is None:
            continue
        what = f"{name!r} ({type(module).__name__})" if name else f"the LightningModule {type(model).__name__}"
        raise ValueError(
            f"{what} was compiled with torch.compile before fit ({how}): DPMPStrategy must trace and split its"
            " original layers, which a compiled module hides. Pass the uncompiled module, and use"
            " DPMPStrategy(compile=True) to compile the split blocks after the plan is verified."
        )


# ---------------------------------------------------------------------------------------------- setup and training
def check_plan_at_setup(model: Any, user_plan: UserPlan, mp: int, global_rank: int) -> None:
    """The plan checks of :func:`check_before_launch`, on the model as ``configure_model`` left it (every rank)."""
    with only_rank_zero_reports(global_rank):
        check_not_compiled(model)
        check_plan_on_model(model, user_plan, mp)


def warn_if_mp_idle(n_split_params: int, dp: int, mp: int) -> Optional[str]:
    """Warn (and return the message) when ``mp > 1`` but the plan split no parameter. Call it on rank 0 only."""
    if mp <= 1 or n_split_params:
        return None
    msg = (
        f"DPMPStrategy(dp={dp}, mp={mp}): the plan splits no parameter of this model, so each of the mp={mp} ranks of"
        f" an MP group computes the whole model on the same batch. Use mp=1 and dp={dp * mp} on the same devices (each"
        " rank then trains on its own batches), or see the plan printout for why each layer stays whole."
    )
    warnings.warn(msg, IdleModelParallelWarning, stacklevel=2)
    return msg


def loaders_of(obj: Any) -> list[Any]:
    """The dataloaders inside ``trainer.train_dataloader``'s structure (mappings, sequences, a CombinedLoader)."""
    if isinstance(obj, Mapping):
        return [x for v in obj.values() for x in loaders_of(v)]
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in loaders_of(v)]
    if hasattr(obj, "flattened"):  # Lightning's CombinedLoader
        return loaders_of(list(obj.flattened))
    return [] if obj is None else [obj]


def warn_if_data_not_sharded(loaders: Any, use_distributed_sampler: bool, dp: int, mp: int) -> Optional[str]:
    """Warn (and return the message) when the training data cannot have been sharded over DP by Lightning.

    Example:
        >>> warn_if_data_not_sharded(DataLoader(range(8)), use_distributed_sampler=True, dp=2, mp=2) is None
        True
    """
    if dp == 1:
        return None  # a single replica reads everything; MP ranks read the same loader with the same seed
    iterable = [dl for dl in loaders_of(loaders) if isinstance(getattr(dl, "dataset", None), IterableDataset)]
    if iterable:
        kind = type(iterable[0].dataset).__name__
        why = f"the training data is an IterableDataset ({kind}), which no sampler can shard"
    elif not use_distributed_sampler:
        why = "Trainer(use_distributed_sampler=False) leaves the DataLoaders as given"
    else:
        return None
    msg = (
        f"DPMPStrategy(dp={dp}, mp={mp}): {why}. The data must be sharded by DP rank: give each of the dp={dp}"
        " replicas a different part (`trainer.strategy.dp_rank` in 0..dp-1 and `trainer.strategy.dp_size`), and the"
        f" same batches to the mp={mp} ranks of one MP group (those with the same dp_rank). Otherwise every replica"
        " trains on the same samples. `check_consistency_every_n_steps` verifies the MP side."
    )
    warnings.warn(msg, DataShardingWarning, stacklevel=2)
    return msg


def warn_if_data_smaller_than_dp(loaders: Any, use_distributed_sampler: bool, dp: int) -> Optional[str]:
    """Warn (and return the message) when a training dataset has fewer samples than ``dp``. Call it on rank 0 only."""
    if dp <= 1 or not use_distributed_sampler:
        return None
    for loader in loaders_of(loaders):
        dataset = getattr(loader, "dataset", None)
        if dataset is None or isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            continue
        n = len(dataset)
        if n < dp:
            msg = (
                f"DPMPStrategy(dp={dp}): the training dataset ({type(dataset).__name__}) has {n} sample(s), fewer than"
                f" dp={dp}. The DistributedSampler gives every replica one sample by repeating {dp - n} of them, so"
                f" repeated samples count more than once in each averaged gradient. Use dp <= {n} (and a larger mp),"
                " or more data."
            )
            warnings.warn(msg, DataSizeWarning, stacklevel=2)
            return msg
    return None


def warn_if_mp_spans_nodes(mp: int, devices_per_node: int, num_nodes: int) -> None:
    """MP groups are consecutive ranks: if mp does not divide the devices of a node, some groups cross nodes."""
    if mp > 1 and devices_per_node % mp and num_nodes > 1:
        rank_zero_warn(
            f"mp={mp} does not divide the {devices_per_node} devices per node: MP groups span nodes, and every"
            " tensor-parallel all-reduce crosses the slower inter-node link."
        )


def advise_our_arguments(exception: BaseException, dp: Any, mp: Any, zero: int) -> bool:
    """Rewrite advice that names a DDP strategy string (``strategy='ddp_find_unused_parameters_true'``, which would
    drop DP x MP) into the ``DPMPStrategy(...)`` argument that does the same; returns whether it did.

    Example:
        >>> e = RuntimeError("... `strategy='ddp_find_unused_parameters_true'` ...")
        >>> advise_our_arguments(e, 2, 2, 0), "DPMPStrategy(dp=2, mp=2, find_unused_parameters=True)" in str(e)
        (True, True)
    """
    changed = False
    args = []
    for arg in exception.args:
        if isinstance(arg, str) and "ddp_find_unused_parameters_true" in arg:
            arg = (
                "It looks like your LightningModule has parameters that were not used in producing the loss returned"
                " by training_step (some steps leave some layers out: experts, LayerDrop, a branch on the data). If"
                " this is intentional, enable DDP's detection of unused parameters over the DP group with"
                f" `strategy=DPMPStrategy(dp={dp!r}, mp={mp!r}, find_unused_parameters=True)`"
                + "; a DDP strategy string would drop DP x MP."
            )
            changed = True
        args.append(arg)
    exception.args = tuple(args)
    return changed
