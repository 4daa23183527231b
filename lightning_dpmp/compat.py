"""Every touch of a private name of Lightning, torch or torchmetrics, in one place.

Each function names what it relies on and the version it was checked against (lightning 2.6.6, torch 2.13,
torchmetrics 1.9); ``tests/unit/test_compat.py`` has one test per touch that fails with a clear message when an
upgrade changes it. Where a public API does the same job it is used instead, and said so.

Lightning and torchmetrics are imported lazily, inside the functions (``SubprocessScriptLauncher`` through the
module's ``__getattr__``), so that ``parallel/`` and ``planner/`` (torch only) can import this module.

Example:
    >>> from lightning_dpmp import compat
    >>> compat.tree_leaves(([1, 2], {"a": 3}))
    [1, 2, 3]
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist

# torch.distributed._functional_collectives: the collectives that torch.compile traces into its graph without a
# break (torch 2.13 has no public module for them; c10d's in-place ops break the graph). Relies on:
# all_reduce(t, "sum", group), all_gather_tensor(t, gather_dim, group), reduce_scatter_tensor(t, "sum", scatter_dim,
# group) returning tensors that wait_tensor(t) completes. Imported as ``compat.functional_collectives``.
import torch.distributed._functional_collectives as functional_collectives
from torch import Tensor, nn

# torch.distributed.tensor.placement_types._StridedShard: torch's placement for a dim split into equal blocks, each
# rank holding the same rows of every block (the layout FSDP2 + TP produce); no public name in torch 2.13. Relies
# on: _StridedShard(dim, split_factor=k) being a Placement that DTensor redistributes and checkpoints.
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard

# torch.nn.modules.dropout._DropoutNd: the base of every nn.Dropout* (torch 2.13 has no public base); relies on ``p``.
from torch.nn.modules.dropout import _DropoutNd as DropoutNd
from torch.overrides import TorchFunctionMode

# torch.utils._python_dispatch.TorchDispatchMode: the only home of the dispatch-mode base class in torch 2.13
# (``torch.overrides`` has TorchFunctionMode, not the dispatch one). Relies on: __torch_dispatch__ being called
# for every aten/c10d op while the mode is entered.
from torch.utils._python_dispatch import TorchDispatchMode

# torch.utils._pytree: torch 2.13 has no public pytree module (``torch.utils.pytree`` does not exist yet).
# Relies on: tree_leaves(tree) -> list of leaves, tree_map(fn, tree) -> same structure, tree_flatten(tree) ->
# (leaves, spec).
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map

if TYPE_CHECKING:
    from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
    from lightning.fabric.strategies import Strategy as FabricStrategy
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.strategies import DDPStrategy, ParallelStrategy, Strategy

__all__ = [
    "DropoutNd",
    "StridedShard",
    "TorchDispatchMode",
    "any_true_op",
    "module_apply",
    "own_buffers",
    "own_parameters",
    "tree_flatten",
    "storage_identity",
    "unwatched",
    "functional_collectives",
    "apply_batch_transfer_handler",
    "averaged_copy",
    "check_can_spawn_children",
    "collect_rng_states",
    "clear_dtensor_sharding_cache",
    "compiled_by_user",
    "current_function_mode",
    "ddp_kwargs",
    "set_ddp_kwargs",
    "ddp_timeout",
    "default_store",
    "compile_backend",
    "dcp_chunk_protocol",
    "disable_torch_function_subclass",
    "dynamo_without_ddp_split",
    "distributed_is_initialized",
    "enable_model_averaging",
    "hf_checkpoint_conversion",
    "hf_dtype_plan",
    "hf_model_from_config",
    "keep_adapters_off_meta",
    "init_optimizers_and_lr_schedulers",
    "layer_sync",
    "loop_data_source",
    "metric_state_keys",
    "op_name",
    "queue_backward_callback",
    "optimizer_to_device",
    "optimizers_to_device",
    "script_object_type",
    "scaler_found_inf",
    "set_backward_sync_control",
    "set_launcher",
    "set_num_threads_if_needed",
    "set_rng_states",
    "start_method",
    "tensor_version",
    "storage_alignment",
    "storage_record",
    "tensor_rebuild_call",
    "typed_storage",
    "tree_leaves",
    "tree_map",
    "unwrap_optimizer",
    "uses_distributed_sampler",
    "wrapper_tensor",
    "zip_file_writer",
]


# ---------------------------------------------------------------------------------------------- torch
def own_parameters(module: nn.Module) -> dict[str, Optional[nn.Parameter]]:
    """``nn.Module._parameters`` (torch 2.13): the module's own parameters by name, the live dict.

    Read and written in place where ``named_parameters``/``register_parameter`` cannot serve: swapping a parameter
    for another object (a DTensor, a shard, a meta tensor) without ``nn.Module.__setattr__``'s type checks, hooks or
    re-ordering, and reading the slot ``None`` holds.
    """
    return module._parameters


def own_buffers(module: nn.Module) -> dict[str, Optional[Tensor]]:
    """``nn.Module._buffers`` (torch 2.13): the module's own buffers by name, the live dict (as :func:`own_parameters`).
    """
    return module._buffers


def module_apply(module: nn.Module, fn: Callable[[Tensor], Tensor]) -> nn.Module:
    """``nn.Module._apply(fn)`` (torch 2.13): ``fn`` over every parameter, gradient and buffer, as ``.to()``/``.cpu()``
    do, for a move ``.to()`` cannot express (keep meta tensors where they are, move the rest)."""
    return module._apply(fn)


def any_true_op() -> Any:
    """``torch.ops.aten._is_any_true.default`` (torch 2.13): the op autograd's anomaly mode checks every gradient
    with."""
    return torch.ops.aten._is_any_true.default


def disable_torch_function_subclass() -> contextlib.AbstractContextManager:
    """``torch._C.DisableTorchFunctionSubclass()``: the context manager torch's own subclass docs use inside
    ``__torch_function__`` to call the plain op (torch 2.13); there is no public alias."""
    return torch._C.DisableTorchFunctionSubclass()


def compile_backend(name: str) -> Callable[..., Any]:
    """``torch._dynamo.lookup_backend(name)``: the callable behind a ``torch.compile`` backend name ("inductor",
    "aot_eager"), so that a backend of ours can hand a graph on to one of them (torch 2.13); torch has no public
    way to call a registered backend. Relies on: ``backend(graph_module, example_inputs) -> callable``."""
    import torch._dynamo

    return torch._dynamo.lookup_backend(name)


def dynamo_without_ddp_split() -> contextlib.AbstractContextManager:
    """``torch._dynamo.config.patch(optimize_ddp=False)``: Dynamo compiles a frame traced inside a DDP forward as
    it would any other, instead of splitting its graph at DDP's bucket boundaries (``DDPOptimizer``, the default
    ``optimize_ddp=True``; torch 2.13). No public switch exists. Relies on: the flag being read when a frame is
    converted (``convert_frame``), so a patch around the compiled call covers every (re)compilation."""
    import torch._dynamo

    return torch._dynamo.config.patch(optimize_ddp=False)


def current_function_mode() -> Optional[Any]:
    """The innermost ``TorchFunctionMode`` entered, or ``None``: ``torch.overrides._get_current_function_mode()``
    (torch 2.13), so that a mode can leave the stack only when it is on top (``__exit__`` pops whatever is)."""
    from torch.overrides import _get_current_function_mode

    return _get_current_function_mode()


def clear_dtensor_sharding_cache() -> None:
    """Forget DTensor's cached sharding decisions (torch 2.13): the C++ dispatch fast path's cache
    (``torch._C._clear_DTensor_sharding_propagator_cache``), the Python one behind it (``DTensor._op_dispatcher
    .sharding_propagator.propagate_op_sharding``, a thread-local ``lru_cache``) and the redistribution planner's
    (``torch.distributed.tensor._redistribute.clear_redistribute_planner_cache``). Their keys compare meshes without
    their process groups (``DeviceMesh.__eq__``: ranks, layout, device, dim names), so a mesh built over new groups
    (the next job in one process: a Hydra multirun, a test pool) would get an earlier mesh's cached output specs and
    run collectives on that mesh's destroyed groups ("Could not resolve the process group registered under the name
    ...").

    The redistribution's transform steps (``_redistribute._gen_transform_infos``, unbounded) and the tensor-meta
    propagation (``ShardingPropagator._propagate_tensor_meta_cached``) are cached by specs too, and their keys hold
    the mesh: cleared as well, so that a finished job's mesh, and with it its process groups and their gloo threads,
    can be freed."""
    from torch.distributed.tensor import DTensor, _redistribute
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    torch._C._clear_DTensor_sharding_propagator_cache()
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    _redistribute.clear_redistribute_planner_cache()
    for cached in (getattr(_redistribute, "_gen_transform_infos", None),
                   getattr(ShardingPropagator, "_propagate_tensor_meta_cached", None)):
        if cached is not None and hasattr(cached, "cache_clear"):
            cached.cache_clear()


def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` once, when the backward pass now running ends (after every gradient hook of that pass).

    ``torch.autograd.Variable._execution_engine.queue_callback`` (torch 2.13): the engine's private queue, the only
    "end of this backward" signal (FSDP and DDP use it too); it must be called from inside a backward (a hook).
    """
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def zip_file_writer(path: str) -> Any:
    """The writer ``torch.save`` writes its zip archive with, for a checkpoint streamed record by record.

    Relies on: ``torch._C.PyTorchFileWriter(path, crc32, alignment)`` with ``write_record(name, data, nbytes)``
    (``data`` bytes, str or an ``UntypedStorage``) and ``write_end_of_file()``, and the two settings
    ``torch.serialization`` reads for it (``get_crc32_options``, ``_get_storage_alignment``), torch 2.13. The
    public ``torch.save`` needs every tensor's data in memory at once; a streamed writer is what lets a rank hold
    one dense tensor at a time.
    """
    from torch import serialization

    return torch._C.PyTorchFileWriter(path, serialization.get_crc32_options(), storage_alignment())


def storage_alignment() -> int:
    """``torch.serialization._get_storage_alignment()``: the alignment ``torch.save`` records (torch 2.13)."""
    from torch import serialization

    return int(serialization._get_storage_alignment())


def wrapper_tensor(cls: type, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Any:
    """``torch.Tensor._make_wrapper_subclass(cls, shape, dtype=..., device=...)``: an instance of the tensor subclass
    ``cls`` with a shape, dtype and device and no storage (how ``DTensor`` describes a tensor it holds chunks of),
    torch 2.13. ``cls`` must define ``__torch_dispatch__``."""
    return torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=device)


def typed_storage(storage: Any, dtype: torch.dtype) -> Any:
    """``torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)``: the typed view a tensor
    pickles its data as (``_internal`` keeps the class's deprecation warning quiet), torch 2.13."""
    return torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)


def storage_record(x: Any) -> Optional[tuple[Any, Any, int, int]]:
    """What ``torch.save``'s ``persistent_id`` records of a storage met while pickling a tensor: ``(untyped
    storage, storage class, numel, identity)``, or ``None`` for anything else. Relies on ``TypedStorage``'s
    ``_untyped_storage``, ``_size()`` and ``_pickle_storage_type()`` and on ``UntypedStorage._cdata`` (the identity
    torch.save keys storages by), torch 2.13."""
    if isinstance(x, torch.storage.TypedStorage):
        return x._untyped_storage, getattr(torch, x._pickle_storage_type()), x._size(), x._untyped_storage._cdata
    if torch.is_storage(x):
        return x, torch.UntypedStorage, x.nbytes(), x._cdata
    return None


def unwatched() -> Any:
    """A context in which torch functions reach no ``TorchFunctionMode`` (``torch._C.DisableTorchFunction``, torch
    2.13): for a watcher's own bookkeeping (shapes, sizes), which another watcher of the same step (a trace around a
    pipeline probe) must not record as the step's ops."""
    return torch._C.DisableTorchFunction()


def storage_identity(t: Tensor) -> int:
    """A key for the storage ``t`` views, shared by every view of it: ``UntypedStorage._cdata`` (the StorageImpl's
    address, what torch.save keys storages by), torch 2.13. Unlike ``data_ptr()`` it tells meta tensors apart;
    it is unique only while the storage is alive."""
    return t.untyped_storage()._cdata


def tensor_rebuild_call(storage: Any, shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[Any, tuple]:
    """The reduce tuple ``torch.save`` pickles a contiguous tensor as: ``torch._utils._rebuild_tensor_v2(storage,
    0, shape, stride, False, OrderedDict())``, which ``weights_only`` loading accepts (torch 2.13)."""
    import collections

    return torch._utils._rebuild_tensor_v2, (storage, 0, shape, stride, False, collections.OrderedDict())


def dcp_chunk_protocol() -> tuple[Any, ...]:
    """``(WriteItem, WriteItemType, TensorWriteData, ChunkStorageMetadata, TensorProperties, MetadataIndex)``:
    what an object returns from the hooks ``torch.distributed.checkpoint`` calls on a tensor that describes its
    own chunks (``__create_write_items__(fqn, obj)``, ``__create_chunk_list__()``, ``__get_tensor_shard__(index)``,
    the protocol ``DTensor`` implements), torch 2.13. The classes are public; the hooks are not documented."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    return WriteItem, WriteItemType, TensorWriteData, ChunkStorageMetadata, TensorProperties, MetadataIndex


def tensor_version(x: Tensor) -> int:
    """``Tensor._version``: the in-place modification counter (bumped by every in-place op), torch 2.13."""
    return int(x._version)


def script_object_type(obj: Any) -> str:
    """``torch.ScriptObject._type()``: the TorchScript class of a boxed object, e.g.
    ``__torch__.torch.classes.c10d.ProcessGroup``
    (how the dispatcher hands a ProcessGroup to ``__torch_dispatch__``), torch 2.13."""
    return str(obj._type())


def op_name(func: Any) -> tuple[str, str]:
    """(namespace, packet name) of an ``OpOverload``, e.g. ``("c10d", "allreduce_")``: public ``namespace`` and
    ``overloadpacket`` (replaces ``_overloadpacket._qualified_op_name``)."""
    return str(func.namespace), str(func.overloadpacket.__name__)


def default_store() -> Optional[Any]:
    """``torch.distributed.distributed_c10d._get_default_store()``: the rendezvous key-value store of the default
    group (torch 2.13); ``None`` if unavailable, so callers fall back to a barrier."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


def coalesced_collectives(group: Any, device: torch.device, async_ops: bool) -> contextlib.AbstractContextManager:
    """A context in which the collectives issued over ``group`` run as one coalesced operation (NCCL groups them;
    gloo runs ``allgather_into_tensor_coalesced``/``reduce_scatter_tensor_coalesced``). It yields an object whose
    ``wait()`` waits for all of them (``async_ops``), else they are done on exit.

    Relies on: ``torch.distributed._coalescing_manager`` (private; torch 2.13, no public twin). Without it, a
    context that lets each collective run by itself (synchronously) and whose ``wait()`` does nothing.
    """
    manager = getattr(dist, "_coalescing_manager", None)
    if manager is None:
        return contextlib.nullcontext(_NoWait())
    # A device asks the backend to group the calls itself (``startCoalescing``: NCCL); gloo has no such mode and
    # without a device the manager collects the calls and issues the backend's one ``*_coalesced`` op.
    native = device.type == "cuda" and dist.get_backend(group) == "nccl"
    return manager(group=group, device=device if native else None, async_ops=async_ops)


class _NoWait:
    def wait(self) -> None:
        return None


def compiled_by_user(module: nn.Module) -> Optional[str]:
    """How ``module`` was compiled with ``torch.compile`` before it reached the strategy, or ``None``.

    Relies on (torch 2.13, lightning 2.6.6): ``torch._dynamo.eval_frame.OptimizedModule`` (what
    ``torch.compile(module)`` returns; no public alias), ``nn.Module._compiled_call_impl`` (set by the in-place
    ``module.compile()``), ``_torchdynamo_orig_callable`` on the function ``torch.compile(fn)`` returns (a compiled
    ``forward`` assigned to the instance), and ``LightningModule._compiler_ctx`` (set by Lightning's
    ``from_compiled`` when ``fit`` unwraps a compiled LightningModule and replaces its step methods).
    """
    from torch._dynamo.eval_frame import OptimizedModule

    if isinstance(module, OptimizedModule):
        return "torch.compile(module)"
    if getattr(module, "_compiler_ctx", None) is not None:
        return "torch.compile(lightning_module) passed to the Trainer"
    if getattr(module, "_compiled_call_impl", None) is not None:
        return "module.compile()"
    if getattr(module.__dict__.get("forward"), "_torchdynamo_orig_callable", None) is not None:
        return "module.forward = torch.compile(module.forward)"
    return None


def scaler_found_inf(scaler: Any, optimizer: Any) -> tuple[dict[Any, Any], torch.device]:
    """A ``GradScaler``'s per-device ``found_inf`` tensors for ``optimizer`` after ``unscale_`` (the dict itself,
    which ``step`` and ``update`` read, so writes take effect) and the device of its scale. torch 2.13 keeps them
    in ``_per_optimizer_states[id(optimizer)]["found_inf_per_device"]`` and ``_scale``; no public accessor."""
    return scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"], scaler._scale.device


def distributed_is_initialized() -> bool:
    """Public torch (replaces Lightning's ``_distributed_is_initialized``)."""
    return dist.is_available() and dist.is_initialized()


# ---------------------------------------------------------------------------------------------- Lightning
def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a ``LightningOptimizer`` (its public ``optimizer`` property), else ``optimizer``."""
    from lightning.pytorch.core.optimizer import LightningOptimizer

    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def optimizer_to_device(optimizer: Any, device: torch.device) -> None:
    """``lightning.fabric.utilities.optimizer._optimizer_to_device`` (lightning 2.6.6): move the state tensors."""
    from lightning.fabric.utilities.optimizer import _optimizer_to_device

    _optimizer_to_device(optimizer, device)


def optimizers_to_device(optimizers: Iterable[Any], device: torch.device) -> None:
    """``lightning.fabric.utilities.optimizer._optimizers_to_device`` (lightning 2.6.6)."""
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)


def collect_rng_states(include_cuda: bool) -> dict[str, Any]:
    """``lightning.fabric.utilities.seed._collect_rng_states`` (lightning 2.6.6): torch, numpy, python states."""
    from lightning.fabric.utilities.seed import _collect_rng_states

    return _collect_rng_states(include_cuda=include_cuda)


def set_rng_states(states: dict[str, Any]) -> None:
    """``lightning.fabric.utilities.seed._set_rng_states`` (lightning 2.6.6): the inverse of
    :func:`collect_rng_states`."""
    from lightning.fabric.utilities.seed import _set_rng_states

    _set_rng_states(states)


def init_optimizers_and_lr_schedulers(module: Any) -> tuple[list[Any], list[Any]]:
    """``lightning.pytorch.core.optimizer._init_optimizers_and_lr_schedulers`` (lightning 2.6.6): calls
    ``configure_optimizers`` and normalises its result to (optimizers, scheduler configs)."""
    from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers

    return _init_optimizers_and_lr_schedulers(module)


def uses_distributed_sampler(trainer: "Trainer") -> bool:
    """``trainer._accelerator_connector.use_distributed_sampler``: the Trainer's ``use_distributed_sampler=``
    (lightning 2.6.6); the Trainer exposes it nowhere else."""
    return bool(trainer._accelerator_connector.use_distributed_sampler)


def loop_data_source(trainer: "Trainer", loop_name: str) -> Any:
    """``<loop>._data_source`` (``_DataConnector``'s ``_DataLoaderSource``, with ``.dataloader()``) of
    ``trainer.<loop_name>``, lightning 2.6.6: the stage's dataloaders before the loop sets them up."""
    return getattr(trainer, loop_name)._data_source


def apply_batch_transfer_handler(module: "LightningModule", batch: Any, device: torch.device) -> Any:
    """``LightningModule._apply_batch_transfer_handler(batch, device=)`` (lightning 2.6.6): the loop's
    on_before_batch_transfer -> transfer_batch_to_device -> on_after_batch_transfer chain."""
    return module._apply_batch_transfer_handler(batch, device=device)


def ddp_kwargs(strategy: "DDPStrategy | FabricDDPStrategy") -> dict[str, Any]:
    """``DDPStrategy._ddp_kwargs``: the dict ``_setup_model`` passes to ``DistributedDataParallel``
    (lightning 2.6.6)."""
    kwargs: dict[str, Any] = strategy._ddp_kwargs
    return kwargs


def set_ddp_kwargs(strategy: "DDPStrategy | FabricDDPStrategy", kwargs: dict[str, Any]) -> None:
    """Set ``DDPStrategy._ddp_kwargs`` (lightning 2.6.6), which ``configure_ddp`` passes to
    ``DistributedDataParallel``."""
    strategy._ddp_kwargs = kwargs


def ddp_timeout(strategy: "DDPStrategy | FabricDDPStrategy") -> Any:
    """``DDPStrategy._timeout``: the ``timeout=`` timedelta given to ``init_process_group`` (lightning 2.6.6; the
    Trainer's and Fabric's ``DDPStrategy`` both keep it there)."""
    return strategy._timeout


def set_backward_sync_control(strategy: "FabricStrategy", control: Any) -> None:
    """Set Fabric's ``Strategy._backward_sync_control`` (lightning 2.6.6), the object whose
    ``no_backward_sync(module, enabled)`` context ``Fabric.no_backward_sync`` returns (``None``: Fabric warns that
    the strategy cannot skip synchronisation)."""
    strategy._backward_sync_control = control


def enable_model_averaging(strategy: "DDPStrategy") -> None:
    """The end of ``DDPStrategy.setup`` (lightning 2.6.6): with a ``PostLocalSGDState`` as ``ddp_comm_state``,
    ``DDPStrategy._enable_model_averaging()`` (reads ``_ddp_comm_state``) wraps the optimizers for periodic model
    averaging. A no-op otherwise."""
    import torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook as post_local_sgd

    if isinstance(getattr(strategy, "_ddp_comm_state", None), post_local_sgd.PostLocalSGDState):
        strategy._enable_model_averaging()


def layer_sync(strategy: "ParallelStrategy") -> Any:
    """``ParallelStrategy._layer_sync``: the ``sync_batchnorm`` plugin the connector sets (lightning 2.6.6)."""
    return strategy._layer_sync


def start_method(strategy: "DDPStrategy | FabricDDPStrategy") -> str:
    """``DDPStrategy._start_method``: ``"popen"``/``"spawn"``/``"fork"``/``"forkserver"`` (lightning 2.6.6)."""
    return str(strategy._start_method)


def set_launcher(strategy: "Strategy | FabricStrategy", launcher: Any) -> None:
    """``Strategy._launcher``: what ``_configure_launcher`` must set and ``Strategy.launcher`` returns
    (lightning 2.6.6)."""
    strategy._launcher = launcher


def set_num_threads_if_needed(num_processes: int) -> None:
    """``lightning.fabric.utilities.distributed._set_num_threads_if_needed`` (lightning 2.6.6): OMP threads per rank."""
    from lightning.fabric.utilities.distributed import _set_num_threads_if_needed

    _set_num_threads_if_needed(num_processes=num_processes)


def check_can_spawn_children(launcher: Any) -> None:
    """``_SubprocessScriptLauncher._check_can_spawn_children()`` (lightning 2.6.6): refuses a second launch."""
    launcher._check_can_spawn_children()


def metric_state_keys(metric: Any) -> list[str]:
    """The ``__dict__`` keys holding a torchmetrics ``Metric``'s accumulated state (torchmetrics 1.9): the states
    registered by ``add_state`` (``_defaults``) plus ``_update_count``, ``_computed``, ``_forward_cache``."""
    return list(metric._defaults) + ["_update_count", "_computed", "_forward_cache"]


def averaged_copy(callback: Any) -> Optional[nn.Module]:
    """The model copy a weight-averaging callback averages into (lightning 2.6.6): ``StochasticWeightAveraging.
    _average_model`` (a copy of the LightningModule) or ``WeightAveraging._average_model.module`` (the module inside
    torch's ``AveragedModel``); ``None`` before its ``setup`` made one. Relies on: the copy's parameters and buffers
    being paired with the model's by position."""
    average = getattr(callback, "_average_model", None)
    if average is None:
        return None
    inner = getattr(average, "module", None)
    return inner if isinstance(average, torch.optim.swa_utils.AveragedModel) and inner is not None else average


def __getattr__(name: str) -> Any:
    # PEP 562: the launcher base class is imported only when asked for, so importing this module imports no Lightning.
    if name == "SubprocessScriptLauncher":
        # lightning.pytorch.strategies.launchers.subprocess_script._SubprocessScriptLauncher (lightning 2.6.6):
        # subclassed by DPMPScriptLauncher, which overrides ``_call_children_scripts`` and reads ``procs``.
        from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

        return _SubprocessScriptLauncher
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def hf_model_from_config(model_class: Any, config: Any, **kwargs: Any) -> Any:
    """A transformers model built from ``config`` (no weights loaded): ``from_config`` for the ``Auto*`` classes,
    else ``PreTrainedModel._from_config`` (private; transformers 5.24), which applies ``dtype`` and
    ``attn_implementation`` exactly as ``from_pretrained`` does, where ``model_class(config)`` would ignore both."""
    if hasattr(model_class, "from_config"):
        return model_class.from_config(config, **kwargs)
    return model_class._from_config(config, **kwargs)


class _RealStaysReal(TorchFunctionMode):
    """``Tensor.to(meta)`` of a real tensor keeps its device (a dtype change still applies)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is Tensor.to and args and isinstance(args[0], Tensor) and not args[0].is_meta:
            real = args[0].device
            args = tuple(real if _is_meta_device(a) else a for a in args)
            if _is_meta_device(kwargs.get("device")):
                kwargs["device"] = real
        return func(*args, **kwargs)


def _is_meta_device(x: Any) -> bool:
    return isinstance(x, (str, torch.device)) and torch.device(x).type == "meta"


def keep_adapters_off_meta() -> bool:
    """Make peft keep a new adapter's real initial weights when its base layer is on the meta device.

    ``get_peft_model`` on a model whose weights are pending (:func:`lightning_dpmp.from_pretrained`, parameters on
    meta until the split) creates each adapter on the CPU, initialises it (LoRA: ``A`` Kaiming-uniform, ``B``
    zeros) and then moves it to its base layer's device, meta, which would drop those values: the split would
    have nothing to start from but a re-initialisation that single-process training never makes. Wrapped here:
    ``peft.tuners.tuners_utils.BaseTuner.inject_adapter`` (peft 0.21; public on the class, though not documented
    for direct use), the one call under which peft creates and places every adapter: while a model with meta
    parameters gets its adapters, ``Tensor.to`` of a real tensor onto meta keeps it where it is. The adapters then
    train from exactly the values one process gives them. Returns whether peft is installed (idempotent).
    """
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        return False
    from peft.tuners.tuners_utils import BaseTuner

    original = BaseTuner.inject_adapter
    if getattr(original, "_dpmp_keeps_real", False):
        return True

    def inject_adapter(self: Any, model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not any(p.is_meta for p in model.parameters()):
            return original(self, model, *args, **kwargs)
        with _RealStaysReal():
            return original(self, model, *args, **kwargs)

    inject_adapter._dpmp_keeps_real = True  # type: ignore[attr-defined]
    BaseTuner.inject_adapter = inject_adapter  # type: ignore[method-assign]
    return True


def hf_dtype_plan(model: Any, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """``{glob: dtype}`` of the parameters transformers keeps in another dtype than ``dtype`` when it loads
    ``model`` (``_keep_in_fp32_modules`` under float16, ``_keep_in_fp32_modules_strict`` under float16 and
    bfloat16): ``PreTrainedModel._get_dtype_plan`` (private; transformers 5.24), called on the built model as
    ``from_pretrained`` calls it. Its globs are matched by regular-expression search of the parameter name with
    ``*`` as ``.*`` (transformers' ``build_glob_alternation``). ``{}`` for a model without the method."""
    plan = getattr(model, "_get_dtype_plan", None)
    return dict(plan(dtype)) if callable(plan) else {}


def hf_checkpoint_conversion(
    model: Any, keys: list[str]
) -> Optional[tuple[dict[str, str], list[tuple[list[str], Callable[[Callable[[str], Tensor]], dict[str, Tensor]]]]]]:
    """How transformers' ``from_pretrained`` turns a checkpoint's tensors ``keys`` into ``model``'s, for checkpoints
    stored in another layout than the model's (Mixtral's per-expert ``experts.<i>.w1/w3`` files into one stacked
    ``experts.gate_up_proj``; renamed prefixes; legacy ``gamma``/``beta``). ``None`` when no key needs converting.

    Relies on transformers 5.24's loading internals: ``conversion_mapping.get_model_conversion_mapping(model)`` (used
    by peft, documented as such in its source), ``core_model_loading.rename_source_key`` and
    ``WeightConverter.add_tensor``/``convert``, called as ``convert_and_load_state_dict_in_model`` calls them (keys in
    ``dot_natural_key`` order, a fresh copy of the converter per target). Returns ``(renamed, groups)``: ``renamed``
    maps a model key to the one checkpoint key it is read from unchanged; each group is ``(source keys, make)`` where
    ``make(read)`` reads every source whole through ``read(key)`` and returns ``{model key: tensor}``.
    """
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
        )
    except ImportError:  # another transformers: checkpoints are read under their own names
        return None
    import copy
    import functools

    mapping = get_model_conversion_mapping(model)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    expected = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None)
    renamed: dict[str, str] = {}
    grouped: dict[str, tuple[Any, list[tuple[str, str]]]] = {}
    for key in sorted(keys, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, prefix, expected)
        if target not in expected and key in expected:
            target, pattern = key, None
        if pattern is None:
            renamed.setdefault(target, key)
        else:
            grouped.setdefault(target, (by_pattern[pattern], []))[1].append((key, pattern))
    if not grouped and all(t == k for t, k in renamed.items()):
        return None

    def maker(target: str, converter: Any, sources: list[tuple[str, str]]) -> Callable[..., dict[str, Tensor]]:
        def make(read: Callable[[str], Tensor]) -> dict[str, Tensor]:
            fresh = copy.deepcopy(converter)
            for key, pattern in sources:
                fresh.add_tensor(target, key, pattern, functools.partial(read, key))  # read when converted
            return dict(fresh.convert(target, model=model, config=getattr(model, "config", None)))

        return make

    groups = [([k for k, _ in sources], maker(target, converter, sources))
              for target, (converter, sources) in grouped.items()]
    return renamed, groups
