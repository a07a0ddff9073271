"""What happens during forward and backward: the runtime the hooks report to.

The step moves through :class:`TrainingState` (``state.py``, whose :class:`PassState` alone writes it);
every event reads it to decide what to do, and the first outermost forward (or optimizer step) after an
interrupted step resets whatever that step left behind. The hooks themselves are in ``hooks.py``, which
units are gathered when in ``gathering.py``. Per unit:

- pre-forward: (stage 3) wait for the unit's all-gather, prefetch the units predicted to run next, reshard
  prefetched units that did not run; wrap the unit's grad-requiring inputs so their backward tells us the
  unit's backward is finished.
- post-forward: (stage 3) reshard the unit; hook its outputs so the first gradient reaching them gathers it
  again (pre-backward).
- post-accumulate-grad hook per parameter: move the gradient into the unit's flat gradient buffer.
- post-backward (the wrapped inputs' backward, once every call of the unit is back-propagated): reshard the
  unit, let the reduce schedule advance.

A forward hook that fires during backward is a recompute (activation
checkpointing), not a new forward: it gathers the unit for its backward and
records nothing else. A reentrant checkpoint ran the original forward under
``no_grad``, so its recompute also wraps the inputs (its inner backward is
the unit's backward); a non-reentrant one already wrapped them.

Reduces never depend on data (:class:`ReduceSchedule`).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..collectives import TrainingProgress
from ..engine_plans import PassSettings
from ..pass_listeners import PassListeners
from ..stage_plan import StagePlan
from ..unit import FlatUnit
from . import hooks
from .execution_order import ExecutionOrder
from .forward_records import agreed_zero_roots
from .gathering import GatherPolicy
from .prefetch_tuning import UNTUNED_DEPTH, AutoPrefetch
from .reduce_schedule import ReduceSchedule
from .state import PassState, TrainingState
from .step_in_backward import StepInBackward

# (args, kwargs) -> (args, kwargs)
InputTransform = Callable[[tuple, dict], "tuple[tuple, dict]"]


# ---------------------------------------------------------------- what a backward raises when gradients
# arrive where the step cannot take them


class LateGradientError(RuntimeError):
    """A parameter's gradient arrived after its unit had finished its backward and reduced.

    What it means: the parameter was used outside the forward of the module that owns it (read from
    another module's forward), so its gradient reached the engine
    after its unit's gradients had been reduced across the ranks. Rather than lose it, the backward
    raises, naming the parameter and its unit.

    What to do: call the owning module instead of reading its parameter elsewhere, or choose a wrap
    policy (``wrap_policy=``, Accelerate's ``wrap_classes``) whose unit contains every module that uses
    the parameter; shared parameters are owned by the lowest unit containing all their users.
    """

    @classmethod
    def for_parameter(cls, name: str, unit_label: str) -> LateGradientError:
        return cls(
            f"The gradient of '{name}' arrived after {unit_label} "
            "had finished its backward and reduced its gradients: the parameter is used outside the "
            "forward of the module that owns it. Call the owning module instead of reading its "
            "parameter elsewhere, or choose a wrap policy whose unit contains every module that uses it."
        )


class UnscaledBackwardError(RuntimeError):
    """fp16: gradients arrived from a backward the loss scaler did not scale.

    What it means: with fp16 mixed precision the loss is multiplied by the loss scale before backward
    and the step divides the gradients by it; a plain ``loss.backward()`` skips the multiplication, so
    its gradients would be divided by the loss scale when the step unscales them. The backward is
    refused instead.

    What to do: call the engine's backward instead of ``loss.backward()``: ``engine.backward(loss)``,
    ``accelerator.backward(loss)``, ``fabric.backward(loss)``, or Lightning's own backward (return the
    loss from ``training_step``). Or train in bf16, which needs no loss scaling.
    """

    @classmethod
    def plain_backward(cls) -> UnscaledBackwardError:
        return cls(
            "fp16 training needs loss scaling, but this backward did not come from engine.backward(loss) "
            "(or accelerator.backward / fabric.backward / Lightning's own backward), so its gradients "
            "would be divided by the loss scale when the step unscales them. Call the engine's backward "
            "instead of loss.backward()."
        )


def warn_accumulation_dropped() -> None:
    warnings.warn(
        "A backward raised during gradient accumulation in ZeRO stage 1, where gradients "
        "accumulate in place: the micro-batches accumulated since the last optimizer step were "
        "discarded with it. The next step uses only the micro-batches that follow.",
        RuntimeWarning,
        stacklevel=5,
    )


class StepRuntime:
    """The pass over the units: implements the events the hooks report (``hooks.PassEvents``)."""

    def __init__(
        self,
        units: list[FlatUnit],
        plan: StagePlan,
        passes: PassSettings,
        *,
        progress: TrainingProgress,
        listeners: PassListeners,
        step_in_backward: StepInBackward | None = None,
        requires_scaled_backward: bool = False,
        input_cast: InputTransform | None = None,
        owner: object | None = None,
    ):
        """``passes``: the prefetch depth, or "auto" (measured and tuned: ``prefetch_tuning.py``)."""
        self.units = units
        self.root = units[0]
        self.plan = plan
        auto_prefetch = None
        if passes.prefetch == "auto":
            auto_prefetch = AutoPrefetch.for_units(units, passes.prefetch_cap_mb, units[0].comm.device)
        depth = UNTUNED_DEPTH if auto_prefetch is not None else passes.prefetch
        self.gathering = GatherPolicy(units, plan, depth, auto_prefetch)
        self.passes = PassState(progress)
        # offload_step_in_backward: the worker told of the backward's progress and of each reduce.
        self.step_in_backward = step_in_backward
        self.reduces = ReduceSchedule(units, told=step_in_backward)
        self._hooks = hooks.StepHooks(units, self)
        self.require_grad_sync = True
        # fp16: every backward that reaches parameters must start from a scaled loss; the
        # engine announces one (announce_scaled_backward) right before it starts it.
        self.requires_scaled_backward = requires_scaled_backward
        # Told at the edges of each forward (pass_listeners.py); any may refuse the forward (raise).
        self.listeners = listeners
        self.input_cast = input_cast  # applied to every unit call (mixed precision)
        self.owner = owner  # the engine over these parts: a model in use keeps it alive (engine.py's ModelOwners)

    # ----------------------------------------------------------- reports
    @property
    def state(self) -> TrainingState:
        return self.passes.state

    @property
    def forwards(self) -> int:
        """Forwards with grad completed since creation."""
        return self.passes.forwards

    @property
    def backwards(self) -> int:
        """Backwards completed since creation."""
        return self.passes.backwards

    @property
    def prefetch(self) -> int:
        """Stage 3: how many units are gathered ahead of the one running."""
        return self.gathering.prefetch

    @prefetch.setter
    def prefetch(self, depth: int) -> None:
        self.gathering.prefetch = depth

    @property
    def auto_prefetch(self) -> AutoPrefetch | None:
        return self.gathering.auto_prefetch

    @property
    def order(self) -> ExecutionOrder:
        return self.gathering.order

    @property
    def peak_live_units(self) -> int:
        return self.gathering.peak_live_units

    @peak_live_units.setter
    def peak_live_units(self, value: int) -> None:
        self.gathering.peak_live_units = value

    @property
    def late_handles(self) -> list[RemovableHandle]:
        """Gradient hooks registered when a frozen parameter was unfrozen."""
        return self._hooks.late_handles

    # ------------------------------------------------------------ install
    def install(self) -> list[RemovableHandle]:
        return self._hooks.install()

    def hook_trainable_params(self) -> None:
        self._hooks.hook_trainable_params()

    # ------------------------------------------------------ interruptions
    def quiesce(self, *, drop_pending_forward: bool = False, model_access: bool = True) -> None:
        """The one entry barrier for everything outside a pass that reads or writes model state
        (steps, gradient reads, exports, loads, full parameters): clean up after a pass that raised,
        and wait for the post-step all-gathers still writing the parameters (stages 1/2). Every rank
        calls it at the same points. ``model_access``: refused while offloaded units stepped early."""
        self.settle(drop_pending_forward=drop_pending_forward)
        if model_access and self.step_in_backward is not None:
            self.step_in_backward.refuse_model_access()
        self.wait_for_refresh()

    def settle_gradients(self, *, drop_pending_forward: bool = False) -> None:
        """Before gradients are read or changed: the barrier, then (hybrid sharding) the reduce across groups."""
        self.quiesce(drop_pending_forward=drop_pending_forward, model_access=False)
        self.reduce_across_groups()

    def wait_for_refresh(self) -> None:
        """Stages 1/2: wait for the post-step all-gathers still writing the parameters. A forward
        waits per unit instead, and any other touch of a parameter through its guard."""
        for unit in self.units:
            if unit.storage.refreshing:
                unit.storage.wait_gathered()

    @property
    def suspended(self) -> bool:
        """Inside :meth:`suspend`: units are neither gathered nor resharded."""
        return self.gathering.suspended

    def suspend(self) -> contextlib.AbstractContextManager[None]:
        """Full parameters are swapped in by the caller (``gathered_parameters``): no gather or reshard."""
        return self.gathering.suspend()

    def settle(self, *, drop_pending_forward: bool = False) -> None:
        """Clean up after a forward or backward that raised, so nothing of it survives.

        With ``drop_pending_forward`` (the optimizer step), a forward whose
        backward never ran is forgotten too: that batch was skipped.
        """
        interrupted_backward = self.passes.interrupted_backward
        if self.passes.interrupted_forward or interrupted_backward:
            self._abandon(backward_too=interrupted_backward)
        if drop_pending_forward:
            self.passes.drop_pending_forwards()

    def _abandon(self, backward_too: bool) -> None:
        """Forget the forward that raised, or the backward that raised (see ``PassState.abandon``)."""
        dropped_earlier = False
        if backward_too:
            if self.step_in_backward is not None:
                self.step_in_backward.settle()  # its worker done before the gradients it reads go
            self.reduces.wait_all(abandoned=True)  # issued on every rank alike; their results are dropped below
            dropped_earlier = any([unit.grads.discard_backward() for unit in self.units])
        self.gathering.abandoned()
        self.reduces.reset()
        self.passes.abandon(backward_too)
        if dropped_earlier:
            warn_accumulation_dropped()

    # ------------------------------------------------------------ forward
    @hooks.profiled("zero::pre_forward")
    def pre_forward(self, unit: FlatUnit, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.input_cast is not None:
            args, kwargs = self.input_cast(args, kwargs)
        if self.passes.recomputing():
            return self._pre_recompute(unit, args, kwargs)
        if not self.passes.active:
            self._begin_outermost_forward(unit)
        if not self.passes.running(unit):
            timed = self.passes.state is TrainingState.FORWARD
            self.gathering.for_forward(unit, self.passes.running_indices(), timed=timed)
        record = self.passes.enter(unit)
        if record is not None:
            if torch.is_grad_enabled():
                args, kwargs = self._wrap_inputs(unit, args, kwargs, recorded=True)
            else:
                self.passes.count_unwrapped_call(unit)  # a reentrant checkpoint wraps its recompute
        return args, kwargs

    def _begin_outermost_forward(self, unit: FlatUnit) -> None:
        self.settle()
        self.listeners.before_outermost_forward()
        if self.step_in_backward is not None:
            self.step_in_backward.refuse_forward()  # after the listeners' refusals, before anything is recorded
        self.hook_trainable_params()
        self.passes.begin_forward()
        self.gathering.forward_started()
        if unit is self.root:
            self.listeners.before_root_forward()

    def _pre_recompute(self, unit: FlatUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A checkpointed unit's forward rerun inside backward: gather it for its backward."""
        self.begin_backward_of(unit)
        covered = self.passes.backward.covered
        reentrant = torch.is_grad_enabled() and any(r.unwrapped_calls[unit.index] for r in covered)
        if reentrant:
            # The original forward ran under no_grad: this recompute's own
            # backward (run right after it by the checkpoint) is the unit's
            # backward, already counted among the calls to finish.
            args, kwargs = self._wrap_inputs(unit, args, kwargs, recorded=False)
        return args, kwargs

    def _wrap_inputs(self, unit: FlatUnit, args: tuple, kwargs: dict, recorded: bool) -> tuple[tuple, dict]:
        """Wrap the call's grad-requiring inputs, so their backward finishes the call's backward;
        ``recorded``: a call of the recorded forward, which counts how its backward ends."""
        wrapped = hooks.wrap_inputs(args, kwargs, functools.partial(self.post_backward, unit))
        if recorded:
            if wrapped is None:
                self.passes.finish_with_backward(unit)
            else:
                self.passes.count_wrapped_call(unit)
        return wrapped if wrapped is not None else (args, kwargs)

    @hooks.profiled("zero::post_forward")
    def post_forward(self, unit: FlatUnit, module: nn.Module, args: tuple, output: Any) -> Any:
        passes = self.passes
        if passes.recomputing() or not passes.running(unit):
            return output  # a recompute keeps the unit gathered for the backward that follows
        passes.complete_call(unit)
        if passes.running(unit):
            return output  # a nested call of a unit still running: the outer call finishes it
        self.gathering.reshard(unit, after_forward=torch.is_grad_enabled())
        if torch.is_grad_enabled() and passes.recording is not None:
            # The outermost call's output hooks hold the record's token: when
            # the user drops those outputs, the record (and what it holds) goes.
            token = passes.keep_record()
            hooked = hooks.hook_outputs(output, functools.partial(self.begin_backward_of, unit), keep_alive=token)
            if passes.active and self.plan.params_sharded_at_rest:
                for tensor in hooked:
                    passes.add_unit_output(tensor)
            if token is not None and not hooked:
                passes.keep_until_step(token)
        if not passes.active:
            self._end_forward(unit)
        return output

    def pre_call(
        self, needed: list[FlatUnit], module: nn.Module, args: tuple, kwargs: dict
    ) -> tuple[tuple, dict] | None:
        """A module called while the units owning its parameters are not running: enter them."""
        if self.passes.recomputing():
            # Checkpointed code rerun in backward: its units only need to be gathered,
            # and its inputs cast as in the forward, so the recompute matches it.
            for unit in needed:
                self.begin_backward_of(unit)
            return self.input_cast(args, kwargs) if self.input_cast is not None else None
        entered = [unit for unit in needed if not self.passes.running(unit)]
        if not entered:
            return None  # the usual case: called inside its unit's forward
        for unit in entered:
            args, kwargs = self.pre_forward(unit, module, args, kwargs)
        self.passes.enter_call(module, entered)
        return args, kwargs

    def post_call(self, module: nn.Module, args: tuple, output: Any) -> Any:
        entered = self.passes.take_entry(module)
        if entered is None:
            return output
        for unit in reversed(entered):
            output = self.post_forward(unit, module, args, output)
        self.passes.entry_completed(module)
        return output

    def after_entry_call(self, module: nn.Module, args: tuple, output: Any) -> None:
        """Also after a call whose forward raised: leave the units it entered."""
        self.passes.after_entry_call(module)

    def after_call(self, unit: FlatUnit, module: nn.Module, args: tuple, output: Any) -> None:
        """After every call of a unit, also one whose forward raised."""
        self.passes.after_unit_call(unit)

    def _end_forward(self, outermost: FlatUnit) -> None:
        self.gathering.forward_ended()
        self.passes.end_forward()
        if outermost is self.root:
            self.listeners.after_root_forward()

    def backward_roots(self, loss: torch.Tensor) -> tuple[list[Any], list[torch.Tensor | None]]:
        """What ``engine.backward(loss)`` starts autograd from (see forward_records.py).

        Stage 3: the loss, plus zero gradients for the unit outputs other ranks'
        losses reach and this rank's does not. The forwards the loss reaches
        (on any rank) are the ones this backward covers.
        """
        self.settle()  # a backward that raised before this one
        records = self.passes.pending_records()
        if not self.plan.params_sharded_at_rest or not any(r.unit_edges for r in records):
            return [loss], [None]
        records, edges, zeros = agreed_zero_roots(loss, records, self.units)
        self.passes.aim_next_backward(records)
        return [loss, *edges], [None, *zeros]

    # ----------------------------------------------------------- backward
    @hooks.profiled("zero::pre_backward")
    def begin_backward_of(self, unit: FlatUnit) -> None:
        """Pre-backward: the unit is about to be back-propagated; gather it (and prefetch)."""
        self._begin_backward()
        if self.passes.gather_for_backward(unit):
            self.gathering.for_backward(unit, self.passes.backward.gathered | self.passes.running_indices())

    def announce_scaled_backward(self) -> None:
        """The next backward starts from a loss the loss scaler multiplied."""
        self.passes.announce_scaled_backward()

    def on_grad(self, unit: FlatUnit, slot_index: int, param: nn.Parameter) -> None:
        self._begin_backward()
        if self.requires_scaled_backward and not self.passes.backward_scaled:
            param.grad = None  # the discarded backward leaves nothing for the next one to add to
            raise UnscaledBackwardError.plain_backward()
        if self.reduces.was_issued(unit):
            param.grad = None
            raise LateGradientError.for_parameter(unit.layout.slots[slot_index].fqns[0], unit.label)
        unit.grads.accumulate(slot_index, param)

    @hooks.profiled("zero::post_backward")
    def post_backward(self, unit: FlatUnit) -> None:
        self._begin_backward()
        if not self.passes.finish_call_backward(unit):
            return
        if not self.passes.running(unit):
            self.gathering.reshard(unit)
        self.reduces.mark_finished(unit)
        if self._reducing():
            self.reduces.advance(self._ready)

    def _ready(self, unit: FlatUnit) -> bool:
        """A unit's gradients are final once its backward finished, or if it did not run."""
        return unit.index not in self.passes.backward.ran or self.reduces.finished(unit)

    def _reducing(self) -> bool:
        return self.require_grad_sync or self.plan.reduce_inside_no_sync

    def reduce_across_groups(self) -> None:
        """Hybrid sharding: each unit's gradients reduced only inside its shard group so far,
        all-reduced across groups (all issued, then all waited for); nothing otherwise."""
        self.reduces.across_groups()

    def _begin_backward(self) -> None:
        if self.step_in_backward is not None and self.passes.state is not TrainingState.BACKWARD:
            self.step_in_backward.refuse_backward()  # before anything of this backward is recorded
        if not self.passes.begin_backward():
            return
        self.reduces.reset()
        if self.step_in_backward is not None:
            self.step_in_backward.backward_begins(self.require_grad_sync, self.reduces.sequence)
        for unit in self.units:
            unit.grads.prepare_backward()
        hooks.at_end_of_backward(self._end_of_backward)

    @hooks.profiled("zero::end_of_backward")
    def _end_of_backward(self) -> None:
        self.passes.begin_post_backward()
        if self._reducing():
            self.reduces.advance(lambda unit: True)
        self.reduces.wait_all()
        for unit in self.units:
            unit.grads.commit_backward()
        self.gathering.reshard_all(keep=self.passes.running_indices())
        if self.require_grad_sync:
            self.reduce_across_groups()  # hybrid sharding: once per synchronising backward, not per micro-batch
        if self.step_in_backward is not None:
            self.step_in_backward.backward_reduced()
        self.gathering.backward_ended()
        self.passes.end_backward()
        self.reduces.reset()
