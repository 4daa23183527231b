"""One test per private touch in lightning_dpmp/compat.py: each fails with a message naming what an upgrade changed."""

from __future__ import annotations

import inspect
from datetime import timedelta

import pytest
import torch
from torch import nn

from lightning_dpmp import compat


def _source(obj: object) -> str:
    return inspect.getsource(obj)  # type: ignore[arg-type]


def test_pytree_flattens_and_maps() -> None:
    assert compat.tree_leaves(([1, 2], {"a": 3})) == [1, 2, 3], "torch.utils._pytree.tree_leaves changed"
    assert compat.tree_map(lambda x: x * 2, {"a": (1, 2)}) == {"a": (2, 4)}, "torch.utils._pytree.tree_map changed"


def test_dispatch_mode_sees_ops() -> None:
    seen: list[str] = []

    class Spy(compat.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(compat.op_name(func)[1])
            return func(*args, **(kwargs or {}))

    with Spy():
        torch.ones(2) + 1
    assert "add" in seen, f"torch.utils._python_dispatch.TorchDispatchMode no longer sees aten ops: {seen}"


def test_op_name_of_a_c10d_op() -> None:
    assert compat.op_name(torch.ops.c10d.allreduce_.default) == ("c10d", "allreduce_"), (
        "OpOverload.namespace/overloadpacket changed"
    )


def test_disable_torch_function_subclass() -> None:
    calls: list[str] = []

    class Sub(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            calls.append(getattr(func, "__name__", ""))
            with compat.disable_torch_function_subclass():
                return func(*args, **(kwargs or {}))

    t = torch.ones(2).as_subclass(Sub)
    out = t + 1
    assert calls and type(out) is torch.Tensor, "torch._C.DisableTorchFunctionSubclass no longer returns plain tensors"


def test_unwatched_hides_calls_from_torch_function_modes() -> None:
    """unwatched (torch._C.DisableTorchFunction): a pipeline probe's bookkeeping inside a trace of the same step."""
    from torch.overrides import TorchFunctionMode

    seen: list[str] = []

    class Seen(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    x = torch.ones(2, 3)
    with Seen():
        y = x + 1
        with compat.unwatched():
            assert tuple(y.shape) == (2, 3) and y.size(0) == 2 and torch.equal(y * 2, torch.full((2, 3), 4.0))
    assert seen == ["add"], seen  # the addition only


def test_tensor_version_counts_in_place_ops() -> None:
    x = torch.zeros(2)
    v = compat.tensor_version(x)
    x.add_(1)
    assert compat.tensor_version(x) == v + 1, "Tensor._version is no longer bumped by in-place ops"


def test_script_object_type_of_a_process_group() -> None:
    pg_box = getattr(torch.classes, "c10d", None)
    assert pg_box is not None, "torch.classes.c10d is gone: the boxed ProcessGroup that accounting.py unboxes moved"
    assert hasattr(torch.ScriptObject, "_type"), (
        "torch.ScriptObject._type() is gone (accounting.py names boxed groups with it)"
    )


def test_default_store_function_exists() -> None:
    assert callable(getattr(torch.distributed.distributed_c10d, "_get_default_store", None)), (
        "torch.distributed.distributed_c10d._get_default_store is gone: checkpoint writes fall back to a barrier"
    )
    assert compat.default_store() is None  # no process group here: None, not an exception


def test_scaler_found_inf_is_the_dict_step_reads() -> None:
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.unscale_(opt)
    found, device = compat.scaler_found_inf(scaler, opt)
    assert set(found) == {torch.device("cpu")} and device.type == "cpu", "GradScaler's found_inf layout changed"
    found[torch.device("cpu")] = torch.ones((), dtype=torch.float32)  # an agreed overflow: step must skip
    before = model.weight.detach().clone()
    scaler.step(opt)
    assert torch.equal(model.weight, before), "GradScaler.step no longer reads _per_optimizer_states' found_inf"


def test_distributed_is_initialized() -> None:
    assert compat.distributed_is_initialized() is False


def test_enable_model_averaging_follows_ddp_setup() -> None:
    from lightning.pytorch.strategies import DDPStrategy

    setup = _source(DDPStrategy.setup)
    assert "self._ddp_comm_state" in setup and "self._enable_model_averaging()" in setup, (
        "DDPStrategy.setup no longer enables post-local-SGD averaging this way: compat.enable_model_averaging"
        " (which DPMPStrategy.setup calls in its place) must follow"
    )
    assert callable(getattr(DDPStrategy, "_enable_model_averaging", None))
    s = DDPStrategy()
    compat.enable_model_averaging(s)  # no ddp_comm_state: nothing to do, and no error


def test_unwrap_optimizer() -> None:
    from lightning.pytorch.core.optimizer import LightningOptimizer

    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    assert compat.unwrap_optimizer(LightningOptimizer(opt)) is opt, "LightningOptimizer.optimizer changed"
    assert compat.unwrap_optimizer(opt) is opt


def test_optimizer_to_device() -> None:
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.Adam([p])
    p.grad = torch.ones(2)
    opt.step()
    compat.optimizer_to_device(opt, torch.device("cpu"))
    compat.optimizers_to_device([opt], torch.device("cpu"))
    assert opt.state[p]["exp_avg"].device.type == "cpu"


def test_rng_states_round_trip() -> None:
    states = compat.collect_rng_states(include_cuda=False)
    assert {"torch", "python", "numpy"} <= set(states), f"_collect_rng_states keys changed: {sorted(states)}"
    a = torch.rand(1)
    compat.set_rng_states(states)
    assert torch.equal(torch.rand(1), a), "_set_rng_states no longer restores the torch stream"


def test_init_optimizers_and_lr_schedulers() -> None:
    import lightning as L

    class M(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(2, 2)

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.1)

    m = M()
    m.trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    optimizers, schedulers = compat.init_optimizers_and_lr_schedulers(m)
    assert len(optimizers) == 1 and schedulers == [], "_init_optimizers_and_lr_schedulers changed its return"


def test_trainer_and_loop_internals() -> None:
    import lightning as L

    trainer = L.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, use_distributed_sampler=False
    )
    assert compat.uses_distributed_sampler(trainer) is False, (
        "trainer._accelerator_connector.use_distributed_sampler changed"
    )
    for loop in ("fit_loop", "validate_loop", "test_loop", "predict_loop"):
        source = compat.loop_data_source(trainer, loop)
        assert callable(getattr(source, "dataloader", None)), f"trainer.{loop}._data_source.dataloader() is gone"


def test_apply_batch_transfer_handler() -> None:
    import lightning as L

    batch = compat.apply_batch_transfer_handler(L.LightningModule(), {"x": torch.ones(1)}, torch.device("cpu"))
    assert torch.equal(batch["x"], torch.ones(1)), "LightningModule._apply_batch_transfer_handler changed"


def test_ddp_strategy_internals() -> None:
    from lightning.pytorch.strategies import DDPStrategy

    s = DDPStrategy(timeout=timedelta(seconds=5), start_method="popen", find_unused_parameters=True)
    assert compat.ddp_timeout(s) == timedelta(seconds=5), "DDPStrategy._timeout changed"
    assert compat.start_method(s) == "popen", "DDPStrategy._start_method changed"
    assert compat.ddp_kwargs(s) == {"find_unused_parameters": True}, "DDPStrategy._ddp_kwargs changed"
    assert "self._ddp_kwargs" in _source(DDPStrategy._setup_model), (
        "DDPStrategy._setup_model no longer passes _ddp_kwargs to DDP"
    )
    assert compat.layer_sync(s) is None, "ParallelStrategy._layer_sync changed"
    compat.set_launcher(s, "launcher")
    assert s.launcher == "launcher", "Strategy.launcher no longer returns Strategy._launcher"
    assert callable(getattr(DDPStrategy, "_configure_launcher", None)), (
        "Strategy._configure_launcher is gone: DPMPStrategy's launcher would never be installed"
    )
    # DPMPStrategy.setup replays DDPStrategy.setup's steps around its parallelize pipeline: a step Lightning adds
    # or drops must be mirrored there.
    setup = _source(DDPStrategy.setup)
    steps = ["self.accelerator.setup(trainer)", "self._layer_sync.apply(self.model)",
             "self.precision_plugin.convert_module(self.model)", "self.model_to_device()", "self.configure_ddp()",
             "self.setup_optimizers(trainer)", "_sync_module_states(self.model)", "self.setup_precision_plugin()",
             "_optimizers_to_device(self.optimizers, self.root_device)", "self._enable_model_averaging()"]
    where = [setup.find(step) for step in steps]
    assert all(i >= 0 for i in where) and where == sorted(where), (
        f"DDPStrategy.setup's steps changed (missing or reordered: {[s for s, i in zip(steps, where) if i < 0]}):"
        " DPMPStrategy.setup replays them around parallelize() and must follow"
    )
    n_calls = sum(line.strip().startswith(("self.", "_")) and "(" in line for line in setup.splitlines())
    assert n_calls == 10, f"DDPStrategy.setup now makes {n_calls} calls (10 in lightning 2.6.6): mirror the new one"


def test_launcher_internals() -> None:
    base = compat.SubprocessScriptLauncher
    for name in ("_call_children_scripts", "_check_can_spawn_children", "kill", "launch"):
        assert callable(getattr(base, name, None)), (
            f"_SubprocessScriptLauncher.{name} is gone (DPMPScriptLauncher overrides or calls it)"
        )
    assert "self.procs" in _source(base.__init__), (
        "_SubprocessScriptLauncher.procs is gone (the child observer watches it)"
    )
    compat.set_num_threads_if_needed(num_processes=1)


def test_precision_clip_and_closure_order() -> None:
    from lightning.pytorch.plugins.precision import Precision

    assert "self.clip_grad_by_norm(" in _source(Precision.clip_gradients), (
        "Precision.clip_gradients no longer calls clip_grad_by_norm: the global-norm clip (hooks.install) would be "
        "skipped"
    )
    wrap = _source(Precision._wrap_closure)
    assert wrap.index("closure()") < wrap.index("self._after_closure"), (
        "Precision no longer runs the closure before clipping: the sequence-parallel sum at the end of the closure"
        " (DPMPStrategy.optimizer_step) would no longer precede clipping"
    )


def test_compiled_by_user_reads_dynamo_and_lightning_markers() -> None:
    import lightning as L
    from lightning.pytorch.utilities.compile import from_compiled, to_uncompiled

    assert compat.compiled_by_user(nn.Linear(2, 2)) is None
    assert compat.compiled_by_user(torch.compile(nn.Linear(2, 2))) == "torch.compile(module)", (
        "torch._dynamo.eval_frame.OptimizedModule is no longer what torch.compile(module) returns"
    )
    inplace = nn.Linear(2, 2)
    inplace.compile()
    assert compat.compiled_by_user(inplace) == "module.compile()", "nn.Module._compiled_call_impl changed"
    fn = nn.Linear(2, 2)
    fn.forward = torch.compile(fn.forward)  # type: ignore[method-assign]
    assert compat.compiled_by_user(fn) == "module.forward = torch.compile(module.forward)", (
        "torch.compile(fn) no longer sets _torchdynamo_orig_callable"
    )

    class LM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(2, 2)

    lm = from_compiled(torch.compile(LM()))
    assert compat.compiled_by_user(lm) == "torch.compile(lightning_module) passed to the Trainer", (
        "Lightning's from_compiled no longer sets LightningModule._compiler_ctx"
    )
    assert compat.compiled_by_user(to_uncompiled(lm)) is None


def test_metric_state_keys() -> None:
    from torchmetrics import SumMetric

    m = SumMetric()
    m.update(torch.tensor(2.0))
    keys = compat.metric_state_keys(m)
    missing = [k for k in keys if k not in m.__dict__]
    assert "sum_value" in keys and not missing, f"torchmetrics Metric state keys changed: {keys}, missing {missing}"
    assert m.__dict__["_update_count"] == 1


def test_compat_imports_no_lightning_at_module_level() -> None:
    import ast

    tree = ast.parse(inspect.getsource(compat))
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
    bad = [n for n in names if n.split(".")[0] in ("lightning", "pytorch_lightning", "torchmetrics")]
    assert not bad, f"lightning_dpmp/compat.py imports {bad} at module level: parallel/ and planner/ import compat"


@pytest.mark.parametrize("mha", [nn.MultiheadAttention(8, 2), nn.MultiheadAttention(8, 2, kdim=4, vdim=4)])
def test_mha_in_proj_weight_matches_the_private_flag(mha: nn.MultiheadAttention) -> None:
    assert (mha.in_proj_weight is not None) == mha._qkv_same_embed_dim


def test_compile_backend_looks_up_registered_backends() -> None:
    for name in ("inductor", "aot_eager"):
        assert callable(compat.compile_backend(name)), f"torch._dynamo.lookup_backend({name!r}) changed"


def test_dynamo_without_ddp_split_patches_optimize_ddp() -> None:
    import torch._dynamo

    before = torch._dynamo.config.optimize_ddp
    with compat.dynamo_without_ddp_split():
        assert torch._dynamo.config.optimize_ddp is False, "torch._dynamo.config.optimize_ddp is not patched"
        mode = torch._dynamo.utils.get_optimize_ddp_mode()
        assert mode != "ddp_optimizer", f"optimize_ddp=False no longer turns DDPOptimizer off: {mode}"
    assert torch._dynamo.config.optimize_ddp == before


def test_keep_adapters_off_meta_wraps_peft_inject_adapter() -> None:
    """peft 0.21: ``BaseTuner.inject_adapter`` creates and places every adapter; wrapped once (idempotent), and
    only a model with meta parameters gets the scope in which a real tensor's ``.to(meta)`` keeps its device."""
    pytest.importorskip("peft")
    from peft.tuners.tuners_utils import BaseTuner

    assert compat.keep_adapters_off_meta() and compat.keep_adapters_off_meta()
    wrapped = BaseTuner.inject_adapter
    assert getattr(wrapped, "_dpmp_keeps_real", False)
    compat.keep_adapters_off_meta()
    assert BaseTuner.inject_adapter is wrapped
    with compat._RealStaysReal():
        t = torch.ones(2).to("meta", torch.float64)
        lin = nn.Linear(2, 2).to(torch.device("meta"))
    assert t.device.type == "cpu" and t.dtype == torch.float64 and lin.weight.device.type == "cpu"


def test_hf_dtype_plan_is_transformers_keep_in_fp32() -> None:
    """transformers 5.24: ``PreTrainedModel._get_dtype_plan(dtype)`` maps T5's ``_keep_in_fp32_modules`` to float32
    under float16 only."""
    pytest.importorskip("transformers")
    from transformers import T5Config, T5ForConditionalGeneration

    model = T5ForConditionalGeneration(T5Config(vocab_size=8, d_model=8, d_kv=2, num_heads=4, d_ff=8, num_layers=1))
    assert compat.hf_dtype_plan(model, torch.float16) == {"wo": torch.float32}
    assert compat.hf_dtype_plan(model, torch.float32) == {}
    assert compat.hf_dtype_plan(nn.Linear(2, 2), torch.float16) == {}


def test_functional_collectives_have_the_calls_comm_and_overlap_make() -> None:
    funcol = compat.functional_collectives
    for name in ("all_reduce", "all_gather_tensor", "reduce_scatter_tensor", "wait_tensor"):
        assert callable(getattr(funcol, name, None)), f"torch.distributed._functional_collectives.{name} is gone"
    params = inspect.signature(funcol.reduce_scatter_tensor).parameters
    assert list(params)[:4] == ["self", "reduceOp", "scatter_dim", "group"], (
        f"reduce_scatter_tensor's arguments changed: {list(params)}"
    )


def test_queue_backward_callback_runs_once_when_the_backward_ends() -> None:
    events: list[str] = []
    x = torch.ones(3, requires_grad=True)
    y = x * 2

    def hook(grad):
        events.append("hook")
        compat.queue_backward_callback(lambda: events.append("end"))
        return grad

    y.register_hook(hook)
    (y * 3).sum().backward()
    assert events == ["hook", "end"], events  # after the hooks of that pass, once
    (x * 1).sum().backward()
    assert events == ["hook", "end"], "a callback must not run again in a later backward"


def test_hf_checkpoint_conversion_internals() -> None:
    pytest.importorskip("transformers")
    from transformers import MixtralConfig, MixtralForCausalLM
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, dot_natural_key, rename_source_key

    for name in ("add_tensor", "convert"):
        assert callable(getattr(WeightConverter, name, None)), f"WeightConverter.{name} is gone"
    assert callable(rename_source_key) and callable(dot_natural_key)
    with torch.device("meta"):
        model = MixtralForCausalLM(MixtralConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                                 num_attention_heads=2, num_key_value_heads=1, num_local_experts=2))
    assert any(isinstance(t, WeightConverter) for t in get_model_conversion_mapping(model)), (
        "transformers no longer converts Mixtral's per-expert files on load: compat.hf_checkpoint_conversion's test"
        " model must change")
    keys = [f"model.layers.0.block_sparse_moe.experts.{i}.w{j}.weight" for i in range(2) for j in (1, 2, 3)]
    renamed, groups = compat.hf_checkpoint_conversion(model, keys)
    assert renamed == {} and sorted(len(src) for src, _ in groups) == [2, 4]


def test_fabric_backward_sync_control_is_what_no_backward_sync_uses() -> None:
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy as FabricDDP

    assert "self._strategy._backward_sync_control.no_backward_sync(" in _source(Fabric.no_backward_sync), (
        "Fabric.no_backward_sync no longer asks Strategy._backward_sync_control: FabricDPMPStrategy's must follow"
    )
    s = FabricDDP()
    compat.set_backward_sync_control(s, "control")
    assert s._backward_sync_control == "control"
    assert compat.ddp_timeout(FabricDDP(timeout=timedelta(seconds=7))) == timedelta(seconds=7)
    # FabricDPMPStrategy checks dp * mp against the world in _configure_launcher, which Fabric's connector calls in
    # the launching process, before any rank starts
    from lightning.fabric.connector import _Connector

    assert "self.strategy._configure_launcher()" in _source(_Connector._lazy_init_strategy), (
        "Fabric no longer configures the launcher at construction: FabricDPMPStrategy's early grid check moves")


def test_streamed_checkpoint_internals_write_what_torch_load_reads(tmp_path) -> None:
    """zip_file_writer, storage_alignment, typed_storage, storage_record and tensor_rebuild_call: the pieces a
    streamed consolidated save (lightning_dpmp.checkpoint.streamed) writes torch.save's archive with."""
    import io
    import pickle
    import sys

    t = torch.arange(6, dtype=torch.float64).view(2, 3)
    storage = compat.typed_storage(t.untyped_storage(), t.dtype)
    record = compat.storage_record(storage)
    assert record is not None and record[2] == 6 and record[1] is torch.DoubleStorage
    assert compat.storage_record(object()) is None
    fn, args = compat.tensor_rebuild_call(storage, (2, 3), (3, 1))

    class P(pickle.Pickler):
        def persistent_id(self, x):
            r = compat.storage_record(x)
            return None if r is None else ("storage", r[1], "0", "cpu", r[2])

    buf = io.BytesIO()
    P(buf, protocol=2).dump({"w": fn(*args)})
    writer = compat.zip_file_writer(str(tmp_path / "x.pt"))
    writer.write_record("data/0", t.untyped_storage(), t.nbytes)
    writer.write_record("data.pkl", buf.getvalue(), len(buf.getvalue()))
    alignment = str(compat.storage_alignment())
    writer.write_record(".storage_alignment", alignment, len(alignment))
    writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))
    writer.write_end_of_file()
    del writer
    assert torch.equal(torch.load(tmp_path / "x.pt", weights_only=True, mmap=True)["w"], t)


def test_dcp_chunk_protocol_classes_and_wrapper_tensor() -> None:
    """dcp_chunk_protocol's classes build a WriteItem; wrapper_tensor makes a storage-less tensor of a shape."""
    WriteItem, WriteItemType, TensorWriteData, Chunk, TensorProperties, MetadataIndex = compat.dcp_chunk_protocol()
    item = WriteItem(index=MetadataIndex("w", torch.Size([0, 2])), type=WriteItemType.SHARD,
                     tensor_data=TensorWriteData(chunk=Chunk(offsets=torch.Size([0, 2]), sizes=torch.Size([1, 2])),
                                                 properties=TensorProperties(dtype=torch.float32),
                                                 size=torch.Size([2, 4])))
    assert item.tensor_data.size == torch.Size([2, 4])

    class Shape(torch.Tensor):
        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise NotImplementedError

    w = compat.wrapper_tensor(Shape, (2, 4), torch.float16, torch.device("cpu"))
    assert isinstance(w, Shape) and w.shape == (2, 4) and w.dtype == torch.float16


def test_current_function_mode_is_the_innermost() -> None:
    from torch.overrides import TorchFunctionMode

    assert compat.current_function_mode() is None
    with TorchFunctionMode() as outer:
        assert compat.current_function_mode() is outer
        with TorchFunctionMode() as inner:
            assert compat.current_function_mode() is inner
        assert compat.current_function_mode() is outer


def test_dtensor_sharding_cache_can_be_cleared() -> None:
    from torch.distributed.tensor import DTensor

    cache = DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding
    assert callable(getattr(cache, "cache_clear", None)), "DTensor's sharding cache moved: compat.clear_dtensor_..."
    assert callable(getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)), "the C++ cache's clear moved"
    compat.clear_dtensor_sharding_cache()
    assert cache.cache_info().currsize == 0


def test_module_internals_own_parameters_buffers_and_apply() -> None:
    mod = nn.BatchNorm1d(2)
    params, buffers = compat.own_parameters(mod), compat.own_buffers(mod)
    assert list(params) == ["weight", "bias"] and "running_mean" in buffers, "nn.Module._parameters/_buffers changed"
    replaced = nn.Parameter(torch.ones(2))
    params["weight"] = replaced  # written in place: the module sees it
    assert mod.weight is replaced, "nn.Module._parameters is no longer the live dict"
    compat.module_apply(mod, lambda t: t.double())
    assert mod.weight.dtype == torch.float64 and mod.running_mean.dtype == torch.float64, "nn.Module._apply changed"


def test_torch_private_classes_and_ops() -> None:
    from torch.distributed.tensor.placement_types import Placement

    assert issubclass(compat.StridedShard, Placement), "torch's _StridedShard is no longer a Placement"
    assert compat.StridedShard(0, split_factor=3).split_factor == 3, "_StridedShard(dim, split_factor=) changed"
    assert isinstance(nn.Dropout(0.1), compat.DropoutNd) and isinstance(nn.Dropout2d(0.1), compat.DropoutNd)
    assert bool(compat.any_true_op()(torch.tensor([False, True]))), "aten._is_any_true changed"
    leaves, _ = compat.tree_flatten(((1, [2]), {"a": 3}))
    assert leaves == [1, 2, 3], "torch.utils._pytree.tree_flatten changed"
def test_storage_identity_is_shared_by_views_and_tells_meta_tensors_apart() -> None:
    """storage_identity (UntypedStorage._cdata): the layout estimator's profile dedupes saved tensors by it."""
    a = torch.zeros(4, 4, device="meta")
    b = torch.zeros(4, 4, device="meta")
    assert compat.storage_identity(a) == compat.storage_identity(a.t()) == compat.storage_identity(a[1:])
    assert compat.storage_identity(a) != compat.storage_identity(b)
