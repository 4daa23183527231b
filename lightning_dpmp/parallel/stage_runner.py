"""Pipeline stages of an unchanged step function, run by torch's schedules (``torch.distributed.pipelining``).

A stage is a contiguous run ``[start, end)`` of the model's repeated blocks (:mod:`lightning_dpmp.planner.stages`
chose and checked the cut). Rather than rewriting the user's step into per-stage programs, every stage runs the
step itself, once per micro-batch, with the blocks it does not own replaced, for that call only, by stand-ins:

* a block before ``start`` passes its stream argument through untouched, except the last one (``start - 1``), which
  returns the activation received from the previous stage: from there on the step computes on real values;
* block ``end`` (the first after the stage) raises, carrying its stream input, which is the stage's output: the rest
  of the step (later blocks, the head, the loss) does not run on this stage;
* the last stage runs to the end, and the step's loss is its output.

The modules with parameters before the stack (embeddings) run on the first stage only: on the others they return
zeros of their output's shape (``pre_modules``), which is all that the code before the stack needs there, since
the stream it starts is replaced by the received activation; so a vocabulary-parallel embedding's all-reduce
happens once per micro-batch, not once per stage. The side inputs of the blocks (masks, rotary tables, positions)
are recomputed from the micro-batch on every stage, which the probe made sure depend on no parameter. The
parameters of blocks a stage does not own get no gradient there.

:class:`PipelineRunner` builds one ``PipelineStage`` per stage this rank holds (``stages_per_rank`` of them,
looping: stage ``s`` lives on pipeline rank ``s % pp``) with static shapes (no shape exchange), and the schedule:
``ScheduleGPipe``, ``Schedule1F1B`` or ``ScheduleInterleaved1F1B``. Activations and their gradients cross stages as
point-to-point sends on the PP group: ``2 * (stages - 1) * microbatches`` per step. :meth:`PipelineRunner.evaluate`
runs the forwards only (``ScheduleGPipe`` without a loss; ``ScheduleLoopedBFS`` for several stages per rank): the
last stage keeps its last block's output per micro-batch, and the rest of the step runs once on the whole batch
(``stages - 1`` sends per micro-batch).

Example:
    >>> runner = PipelineRunner(blocks, ranges, profile, grid.pp_group, grid.pp_rank, grid.pp,
    ...                         microbatches=4, schedule="1f1b", device=torch.device("cpu"))   # doctest: +SKIP
    >>> losses = runner.step(micro_batches, lambda mb: module.training_step(mb, 0), scale=1 / 4)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor, nn

from lightning_dpmp.parallel.topology import SCHEDULES

__all__ = ["PipelineRunner", "bubble_fraction", "stood_in"]



class _StageExit(Exception):
    """Raised by the stand-in of the first block after a stage: carries the stage's output activation."""

    def __init__(self, activation: Tensor) -> None:
        super().__init__("pipeline stage output")
        self.activation = activation


def bubble_fraction(schedule: str, pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """The idle fraction of a rank in one step, ``(pp - 1) / (v * m + pp - 1)`` (GPipe and 1F1B: ``v = 1``;
    interleaved: ``v`` stages per rank shrink the bubble ``v`` times).

    Example:
        >>> round(bubble_fraction("1f1b", pp=2, microbatches=4), 3)
        0.2
    """
    v = stages_per_rank if schedule == "interleaved" else 1
    return (pp - 1) / (v * microbatches + pp - 1)


_STAND_IN = "pipeline_stand_in"  # the mark on a stand-in forward (an attribute of the function)


def stood_in(module: nn.Module) -> bool:
    """Whether ``module`` runs a stand-in forward now: another stage's block, or a module before the stack on a later
    stage. Its own code (and its parameters) takes no part in this call, so hooks that gather or count parameters
    for a forward (ZeRO-3's) leave it alone.

    Example:
        >>> stood_in(nn.Linear(2, 2))
        False
    """
    return bool(getattr(module.__dict__.get("forward"), _STAND_IN, False))


class _StageModule(nn.Module):
    """What a ``PipelineStage`` calls: one stage of the step. It owns no parameters (the blocks stay in the user's
    module), so torch's stage machinery never scales or moves them."""

    def __init__(self, runner: "PipelineRunner", stage: int) -> None:
        super().__init__()
        self._run = runner.run_stage  # a bound method, not a submodule: no parameters through here
        self.stage = stage

    def forward(self, *inputs: Tensor) -> Tensor:
        return self._run(self.stage, inputs)


def _marked(forward: Callable[..., Any]) -> Callable[..., Any]:
    def stand_in(*args: Any, **kwargs: Any) -> Any:
        return forward(*args, **kwargs)

    setattr(stand_in, _STAND_IN, True)
    return stand_in


class PipelineRunner:
    """The stages this rank holds and the schedule that runs them.

    Args:
        blocks: the repeated blocks, in call order.
        ranges: ``[start, end)`` block range of every stage (``pp * stages_per_rank`` of them).
        stream: where a block takes its stream argument (a position or a keyword).
        output_arity: 0 when a block returns the stream tensor, else the length of the tuple it returns.
        stream_shape: the stream's shape for the full batch (dim 0 the batch), ``stream_dtype`` its dtype.
        group, pp_rank, pp: the PP group and this rank's place in it.
        microbatches: micro-batches per step; ``schedule`` one of :data:`SCHEDULES`.
        pre_modules: ``(module, shape_of, dtype)`` of the modules with parameters before the stack: on stages
            after the first, ``shape_of(first tensor input)`` gives the shape of the zeros they return instead.
    """

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        ranges: Sequence[tuple[int, int]],
        stream: Union[int, str],
        output_arity: int,
        stream_shape: tuple[int, ...],
        stream_dtype: torch.dtype,
        group: Any,
        pp_rank: int,
        pp: int,
        microbatches: int,
        schedule: str,
        device: torch.device,
        pre_modules: Sequence[tuple[nn.Module, Callable[[Any], Optional[tuple[int, ...]]], torch.dtype]] = (),
    ) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"pp_schedule must be one of {SCHEDULES}, got {schedule!r}.")
        self.blocks = list(blocks)
        self.ranges = list(ranges)
        self.stream, self.arity = stream, output_arity
        self.stream_shape, self.stream_dtype = tuple(stream_shape), stream_dtype
        self.group, self.pp_rank, self.pp = group, pp_rank, pp
        self.microbatches, self.schedule_name, self.device = microbatches, schedule, device
        self.n_stages = len(self.ranges)
        self.my_stages = [s for s in range(self.n_stages) if s % pp == pp_rank]
        self._schedules: dict[int, Any] = {}  # micro-batch size -> schedule (static shapes per size)
        self._micro: list[Any] = []
        self._step_fn: Optional[Callable[[Any], Any]] = None
        self._next: dict[int, int] = {}
        self.losses: list[Tensor] = []
        self.pre_modules = list(pre_modules)
        self._scale = 1.0  # of each micro-batch's loss gradient, set per step
        # forward-only schedules (evaluation): (micro-batches, micro-batch size) -> schedule, and what the step
        # returned for each micro-batch on the last stage (None while training)
        self._eval_schedules: dict[tuple[int, int], Any] = {}
        self._outputs: Optional[dict[int, Any]] = None

    # ------------------------------------------------------------------ one stage of one micro-batch
    def _stream_arg(self, args: tuple, kwargs: dict) -> Tensor:
        if isinstance(self.stream, int) and self.stream < len(args):
            return args[self.stream]
        return kwargs[str(self.stream)]

    def _as_output(self, t: Tensor) -> Any:
        return t if self.arity == 0 else (t,) + (None,) * (self.arity - 1)

    @contextmanager
    def _stand_ins(self, stage: int, received: Optional[Tensor],
                   bounds: Optional[tuple[int, int]] = None, keep_last: bool = False) -> Iterator[None]:
        start, end = bounds or self.ranges[stage]
        saved: list[tuple[nn.Module, Any]] = []
        if keep_last and end == len(self.blocks):  # evaluation: the last block's output ends the stage's work
            last = self.blocks[end - 1]
            own_forward = last.forward  # (its own code runs: hooks that gather or count its parameters still do)

            def capturing(*args: Any, **kwargs: Any) -> Any:
                out = own_forward(*args, **kwargs)
                raise _StageExit(out if isinstance(out, Tensor) else out[0])

            saved.append((last, last.__dict__.get("forward")))
            last.forward = capturing

        def passing(*args: Any, **kwargs: Any) -> Any:
            return self._as_output(self._stream_arg(args, kwargs))

        entered = [0]

        def entering(*args: Any, **kwargs: Any) -> Any:
            assert received is not None  # (stages after the first)
            entered[0] += 1
            if entered[0] > 1:  # the received activation is this micro-batch's one pass through the stack
                raise RuntimeError(
                    f"pipeline stage {stage}: the step ran the block stack more than once for one micro-batch (a "
                    f"loop over the model, such as generation); a pipelined step passes each micro-batch through "
                    f"the blocks once. Run such a step without pipeline stages (pp=1).")
            return self._as_output(received)

        def leaving(*args: Any, **kwargs: Any) -> Any:
            raise _StageExit(self._stream_arg(args, kwargs))

        def zeros_of(module: nn.Module, shape_of: Any, dtype: torch.dtype) -> Callable[..., Any]:
            def forward(*args: Any, **kwargs: Any) -> Any:
                first = next((a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)), None)
                shape = shape_of(first) if first is not None else None
                if first is None or shape is None:  # (its parameters may be freed here: it cannot run)
                    raise RuntimeError(f"pipeline stage {stage}: {type(module).__name__} before the block stack was "
                                       f"called without the tensor input it had when the stages were planned")
                return torch.zeros(shape, dtype=dtype, device=first.device)

            return forward

        for j, block in enumerate(self.blocks):
            if start <= j < end:
                continue
            stand_in = entering if j == start - 1 else leaving if j == end else passing
            saved.append((block, block.__dict__.get("forward")))  # a compiled block's own forward comes back
            block.forward = _marked(stand_in)
        if stage > 0:
            for module, shape_of, dtype in self.pre_modules:
                saved.append((module, module.__dict__.get("forward")))
                module.forward = _marked(zeros_of(module, shape_of, dtype))
        try:
            yield
        finally:
            for block, own in saved:
                if own is None:
                    del block.forward
                else:
                    block.forward = own

    def run_stage(self, stage: int, inputs: tuple[Tensor, ...]) -> Tensor:
        """Run the step on one micro-batch as stage ``stage``: its output activation, or the loss on the last."""
        index = self._next[stage]
        self._next[stage] = index + 1
        if stage == 0:
            index = int(inputs[0].reshape(-1)[0])
        received = inputs[0] if stage > 0 else None
        assert self._step_fn is not None
        keep = self._outputs is not None and stage == self.n_stages - 1
        with self._stand_ins(stage, received, keep_last=keep):
            try:
                loss = self._step_fn(self._micro[index])
            except _StageExit as done:
                if not keep:
                    return done.activation
                # evaluation: the last block's output stays here (the rest of the step runs once, on the whole
                # batch: evaluate); the schedule sends nothing on
                assert self._outputs is not None
                self._outputs[index] = done.activation.detach()
                return torch.zeros((), dtype=self.stream_dtype, device=self.device)
        if stage != self.n_stages - 1 or keep:
            end = self.ranges[stage][1]
            raise RuntimeError(f"pipeline stage {stage}: the step ended without reaching block "
                               f"{end if end < len(self.blocks) else end - 1}'s end")
        if not isinstance(loss, Tensor) or loss.dim() != 0:
            raise TypeError(f"under pipeline parallelism the step must return a scalar loss tensor, got {loss!r}")
        self.losses.append(loss.detach())
        return loss

    # ------------------------------------------------------------------ the schedule
    def _build(self, micro_size: int, forward_only: bool = False, microbatches: Optional[int] = None) -> Any:
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
            ScheduleLoopedBFS,
        )

        shape = (micro_size,) + self.stream_shape[1:]
        n = microbatches or self.microbatches
        stages: list[Any] = []
        for s in self.my_stages:
            def activation() -> Tensor:
                return torch.empty(shape, dtype=self.stream_dtype, device=self.device, requires_grad=not forward_only)

            first, last = s == 0, s == self.n_stages - 1
            inputs = torch.zeros(1, dtype=torch.long, device=self.device) if first else activation()
            outputs = torch.zeros((), dtype=self.stream_dtype, device=self.device) if last else activation()
            stages.append(PipelineStage(_StageModule(self, s), s, self.n_stages, self.device, input_args=inputs,
                                        output_args=outputs, group=self.group))
        if forward_only:  # no loss function: torch's schedules then run the forwards only, in their order
            if len(stages) > 1:  # (several stages per rank: breadth first, each stage's micro-batches in turn)
                return ScheduleLoopedBFS(list(stages), n, loss_fn=None, scale_grads=False)
            return ScheduleGPipe(stages[0], n, loss_fn=None, scale_grads=False)
        # the loss arrives scaled by the caller (1 / (micro-batches * accumulation)); torch must not rescale
        loss_fn = self._scaled_loss
        if self.schedule_name == "interleaved":
            return ScheduleInterleaved1F1B(list(stages), self.microbatches, loss_fn=loss_fn, scale_grads=False)
        cls = ScheduleGPipe if self.schedule_name == "gpipe" else Schedule1F1B
        return cls(stages[0], self.microbatches, loss_fn=loss_fn, scale_grads=False)

    def _scaled_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return output * self._scale

    def step(self, micro: list[Any], micro_size: int, step_fn: Callable[[Any], Any], scale: float) -> list[Tensor]:
        """Forward and backward of every micro-batch (``micro_size`` rows each) through the pipeline; the gradients
        of this rank's stages accumulate into their parameters (``scale`` times each micro-batch's loss gradient).
        Returns the micro-batches' losses (detached, unscaled) on the rank holding the last stage, ``[]`` elsewhere."""
        if len(micro) != self.microbatches:
            raise ValueError(f"{len(micro)} micro-batches given, the schedule runs {self.microbatches}")
        size = micro_size
        schedule = self._schedules.get(size)
        if schedule is None:
            schedule = self._schedules[size] = self._build(size)
        self._micro, self._step_fn, self._scale, self.losses = micro, step_fn, scale, []
        self._next = {s: 0 for s in self.my_stages}
        holds_first, holds_last = 0 in self.my_stages, self.n_stages - 1 in self.my_stages
        args = (torch.arange(self.microbatches, device=self.device),) if holds_first else ()
        target = torch.zeros(self.microbatches, device=self.device) if holds_last else None
        try:
            schedule.step(*args, target=target, return_outputs=False)
        finally:
            self._micro, self._step_fn = [], None
        return self.losses

    def stream_shape_of(self, micro_batch: Any, step_fn: Callable[[Any], Any]) -> tuple[int, ...]:
        """The shape of the stream that the first block receives when ``step_fn`` runs on ``micro_batch``: the code
        before the stack runs (on this rank, which must hold the first stage), the first block stops it. No
        communication; evaluation checks it against the planned shape before any activation is sent."""
        with self._stand_ins(0, None, bounds=(0, 0)):
            try:
                step_fn(micro_batch)
            except _StageExit as done:
                return tuple(done.activation.shape)
        raise RuntimeError("the step ended without calling the first block of the stack")

    def evaluate(self, micro: list[Any], micro_size: int, step_fn: Callable[[Any], Any], batch: Any
                 ) -> tuple[bool, Any]:
        """The forward of every micro-batch (``micro_size`` rows each, cut from ``batch``) through the blocks of the
        pipeline, no backward: the activations cross the stages as in :meth:`step`. The last stage keeps its last
        block's output per micro-batch; then, on its rank, ``step_fn`` runs once on the whole ``batch`` with every
        block stood in and the joined outputs entering after the last one, so the code after the stack (head, loss,
        metrics, logging) runs once per batch, as on one process. Returns ``(True, what step_fn returned)`` on the
        rank holding the last stage, ``(False, None)`` elsewhere."""
        key = (len(micro), micro_size)
        schedule = self._eval_schedules.get(key)
        if schedule is None:
            schedule = self._eval_schedules[key] = self._build(micro_size, forward_only=True, microbatches=len(micro))
        self._micro, self._step_fn, self._outputs = micro, step_fn, {}
        self._next = {s: 0 for s in self.my_stages}
        args = (torch.arange(len(micro), device=self.device),) if 0 in self.my_stages else ()
        try:
            schedule.step(*args, return_outputs=False)
            outputs = self._outputs
        finally:
            self._micro, self._step_fn, self._outputs = [], None, None
        if self.n_stages - 1 not in self.my_stages:
            return False, None
        stream = torch.cat([outputs[i] for i in range(len(micro))])
        n = len(self.blocks)
        with self._stand_ins(self.n_stages - 1, stream, bounds=(n, n)):
            return True, step_fn(batch)
