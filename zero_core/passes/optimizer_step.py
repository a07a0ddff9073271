"""What runs around the optimizer's own ``step()``: the ZeRO part of an optimizer step.

The engine registers :meth:`OptimizerStep.before` and :meth:`OptimizerStep.after`
as the optimizer's step pre- and post-hooks, so ``optimizer.step()`` (and
whatever calls it: Lightning, Accelerate, a scheduler-driven loop) runs them.

Before: the runtime's entry barrier (a forward never back-propagated is a
skipped batch), one agreement across ranks (which parameters have a gradient,
an overflow anywhere, the same work done and the same param groups
everywhere), fp16 unscaling and the loss scaler's update (or, with ``skip_nonfinite_steps``, the step
skipped when a gradient holds inf or NaN on some rank), the prefetch depth
``prefetch="auto"`` chose, and the reduced gradients attached to the master
pieces the optimizer then updates. After: the updated shards all-gathered back
into the compute parameters (stages 1/2; with ``overlap_param_refresh`` left
in flight for each unit's next forward to wait for), the gradients consumed,
and the step's traffic recorded.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from .. import agreement
from ..collectives import CommContext, CommStats
from ..engine_plans import StepSettings
from ..host_memory import wait_for_host_copies
from ..offload.shard_files import ShardFiles
from ..offload.state_files import StateFiles
from ..optim import grad_ops
from ..optim.attachment import compare_param_groups
from ..optim.host_step import fused_on_host, raw_step_of
from ..optim.loss_scaling import LossScaler
from ..optim.param_groups import OptimizerGroups
from ..optim.whole_tensor_step import WholeTensorStep
from ..pass_listeners import BackgroundWork
from ..unit import FlatUnit
from ..whole_tensor_plan import whole_tensor_rule
from .prefetch_tuning import AutoPrefetch
from .runtime import StepRuntime
from .step_in_backward import EarlySteps, StepInBackward

logger = logging.getLogger("zero_core")


def _refuse_closure(args: tuple, kwargs: dict | None) -> None:
    # torch hands step pre-hooks the step's own arguments, the optimizer first.
    closure = (kwargs or {}).get("closure", args[1] if len(args) > 1 else None)
    if closure is not None:
        # The step's agreement and reductions run before the optimizer's own step, which
        # would then call the closure's forward and backward too late for this update.
        raise ValueError(
            "optimizer.step(closure) is not supported under ZeRO: run the closure first "
            "(loss = closure(), which calls engine.backward), then optimizer.step()."
        )


class OptimizerStep:
    """The optimizer step's own state (steps taken, traffic, whether gradients are unscaled) and its two hooks."""

    def __init__(
        self,
        units: list[FlatUnit],
        comm: CommContext,
        runtime: StepRuntime,
        settings: StepSettings,
        loss_scaler: LossScaler | None,
        nvme: StateFiles | None = None,
        param_files: ShardFiles | None = None,
        background: BackgroundWork | None = None,
    ):
        self.units = units
        # An asynchronous checkpoint's write: collected at the first step every rank's has finished.
        self.background = background if background is not None else BackgroundWork()
        # Optimizers that need whole tensors (Muon): each tensor stepped here, at an owner rank of the shard group.
        self.whole_tensors = WholeTensorStep(units, comm)
        self.nvme = nvme  # offload_optimizer="nvme": the step runs here, unit by unit
        self.param_files = param_files  # offload_params="nvme": a failed read in backward is raised before the step
        # offload_optimizer: the offloaded units step on the host, with torch's fused CPU kernel where it applies.
        self.steps_on_host = any(unit.offloaded for unit in units)
        self.comm = comm
        self.runtime = runtime
        self.settings = settings
        self.loss_scaler = loss_scaler
        self.auto_prefetch: AutoPrefetch | None = runtime.auto_prefetch  # prefetch="auto": told of each step
        # offload_step_in_backward: the units stepped in backward (the runtime's worker, told of each reduce).
        self.in_backward: StepInBackward | None = runtime.step_in_backward
        self.grads_unscaled = False  # fp16: the accumulated gradients were divided by the loss scale
        self._step_calls = 0  # optimizer steps called (overflow-skipped ones too), compared across ranks
        # The last step was skipped (an fp16 overflow, or with skip_nonfinite_steps an inf or NaN gradient, on some
        # rank): the parameters did not change. Reset when each step starts; read by the step's post-hook and by
        # the adapters (schedulers skip that step too).
        self.last_step_skipped = False
        # skip_nonfinite_steps (without fp16, whose loss scaler decides): steps skipped so far, for the log line.
        self.nonfinite_skips = 0
        self._traffic_at_last_step = comm.stats.snapshot()
        self.last_step_traffic = CommStats.difference(self._traffic_at_last_step, self._traffic_at_last_step)
        self._span_traffic_at_last_step = comm.stats.span_snapshot()
        self.last_step_traffic_by_span = CommStats.difference(
            self._span_traffic_at_last_step, self._span_traffic_at_last_step
        )

    # -------------------------------------------------------------- gradients
    @property
    def steps_taken(self) -> int:
        """Optimizer steps applied (overflow-skipped ones not counted): the comm's progress holds the count."""
        return self.comm.progress.steps

    @steps_taken.setter
    def steps_taken(self, steps: int) -> None:  # a resume
        self.comm.progress.steps = steps

    def unscale_grads_once(self) -> None:
        if self.loss_scaler is None or self.grads_unscaled:
            return
        grad_ops.scale_grads(self.units, 1.0 / self.loss_scaler.scale)
        self.grads_unscaled = True

    def refresh_parameters(self) -> None:
        """The compute copies (full parameters in stages 1/2) brought up to date with the master shards, now."""
        if self.param_files is not None:
            self.param_files.rewrite_all()
        for unit in self.units:
            unit.storage.start_refresh(guard=False)
        self.runtime.wait_for_refresh()

    def discard_grads(self) -> None:
        """The accumulated gradients are consumed (by a step) or discarded (a load)."""
        for unit in self.units:
            unit.reset_grads()
        self.grads_unscaled = False

    @property
    def holds_grads(self) -> bool:
        """Some gradient arrived since the last step or ``zero_grad``."""
        return any(unit.grads.holds_grads for unit in self.units)

    def zero_grads(self, slots_by_unit: dict[int, frozenset[int]] | None, set_to_none: bool) -> None:
        """``zero_grad``: drop the gradients of the slots named per unit (None: every slot of every unit)."""
        for unit in self.units:
            if slots_by_unit is None or unit.index in slots_by_unit:
                unit.grads.zero_grads(None if slots_by_unit is None else slots_by_unit[unit.index], set_to_none)
        if slots_by_unit is None:
            self.grads_unscaled = False  # nothing is left that was unscaled

    # ------------------------------------------------------------------ before
    def before(self, groups: OptimizerGroups, args: tuple = (), kwargs: dict | None = None) -> None:
        """The optimizer's step pre-hook: everything up to the optimizer's own update."""
        try:
            self._before(groups, args, kwargs)
        except BaseException:
            if self.in_backward is not None:
                self.in_backward.step_raised()  # units that stepped during backward cannot be taken back
            raise

    def _before(self, groups: OptimizerGroups, args: tuple, kwargs: dict | None) -> None:
        _refuse_closure(args, kwargs)
        # A forward whose backward never ran (a skipped batch) ends here.
        # A step with no forward since the last waits here for that step's all-gathers.
        self.runtime.settle_gradients(drop_pending_forward=True)
        if self.param_files is not None:
            self.param_files.agree(self.comm, "before an optimizer step")
        self.last_step_skipped = False
        self._step_calls += 1
        # Groups added or replaced since the last step train from this one. A refused group is reported
        # after the step agreement, so a rank that alone added one does not leave the others waiting.
        refused_group = None
        try:
            groups.read()
        except ValueError as error:
            refused_group = error
        if self.loss_scaler is not None:
            self.unscale_grads_once()
        # offload_step_in_backward: a unit's step that raised on some rank is raised alike on every rank.
        early_failed = self.in_backward is not None and self.in_backward.failed_on_this_rank()
        agreed = self._agree(groups, refused=refused_group is not None, early_failed=early_failed)
        if refused_group is not None:
            raise refused_group
        if agreed.everywhere[0]:  # every rank's background write is done: its error raised on every rank alike
            self.background.collect()
        # Hyperparameters that differ (the agreement's checksum), or groups changed since they were
        # last compared (progressive unfreezing), are compared field by field: the same ValueError on
        # every rank names the difference. Every rank decides alike: the agreement found the same names.
        if agreed.checks_differ or groups.changed_since_compared:
            compare_param_groups(self.comm, groups)
        if self.auto_prefetch is not None:
            depth = self.auto_prefetch.on_optimizer_step(self.comm)
            if depth is not None:
                self.runtime.prefetch = depth
        # offload_step_in_backward: the units stepped while backward went on (their gradients are not attached
        # again); refused here if they cannot count as this step's (see step_in_backward.py).
        early = self.in_backward.finish(groups) if self.in_backward is not None else EarlySteps(None, frozenset())
        self._attach_master_grads(agreed, early.stepped)
        # Last, once nothing else can raise: the optimizer's own step updates this rank's pieces (with the
        # NVMe tier, they are stepped here unit by unit, and the optimizer's own step finds no gradient).
        groups.show_pieces()
        if not self.last_step_skipped and whole_tensor_rule(groups.optimizer) is not None:
            # Muon's groups: each tensor at its owner; their pieces' gradients let go once stepped.
            self.whole_tensors.step(groups, agreed.slot_flags)
        if not self.last_step_skipped and (self.nvme is not None or self.steps_on_host):
            self._step_offloaded(groups, early)
        if self.in_backward is not None:
            self.in_backward.step_done()

    def _step_offloaded(self, groups: OptimizerGroups, early: EarlySteps) -> None:
        """Offload: the step runs here (unit by unit with the NVMe tier), under the host's fused kernel, whose
        flag is restored whatever happens; the optimizer's own step that follows finds no gradient."""
        optimizer = groups.optimizer
        try:
            with fused_on_host(optimizer) if self.steps_on_host else contextlib.nullcontext():
                if self.nvme is not None:
                    self.nvme.step(groups, raw_step_of(optimizer), earlier=early.walk)
                else:
                    raw_step_of(optimizer)(optimizer)
        finally:
            for unit in self.units:
                for master in unit.master_pieces:
                    master.param.grad = None  # stepped (or failed) here: the optimizer's own step skips them

    def _agree(self, groups: OptimizerGroups, refused: bool, early_failed: bool) -> agreement.StepAgreement:
        """One all-reduce: which parameters have a gradient anywhere, an overflow anywhere, and the
        same work and param groups on every rank (or the same error everywhere)."""
        counters = {
            "forwards with grad": self.runtime.forwards,
            "backwards": self.runtime.backwards,
            "optimizer steps": self._step_calls,
            "units reduced, as a sum of unit numbers (ranks froze different parameters?)": (
                self.runtime.reduces.issued_fingerprint
            ),
            "optimizer param groups (add_param_group on some ranks only?)": len(groups.names),
            "optimizer param groups, as a checksum of their parameter names": groups.fingerprint,
            "refused add_param_group calls": int(refused),
            "host steps during backward that raised (offload_step_in_backward)": int(early_failed),
        }
        # Hyperparameters only report a difference; the comparison after the agreement then names it.
        settings = {"optimizer hyperparameters": groups.settings_fingerprint}
        # The finite check rides on this all-reduce, which runs every step: turning it on adds no collective.
        check_finite = self.loss_scaler is not None or self.settings.skip_nonfinite_steps
        finished = [self.background.finished_here()]
        return agreement.agree_on_step(
            self.units, self.comm, counters, check_finite=check_finite, checks=settings, everywhere=finished
        )

    def _attach_master_grads(self, agreed: agreement.StepAgreement, stepped: frozenset[int]) -> None:
        if self.loss_scaler is not None:
            self.loss_scaler.update(agreed.found_inf)
        elif agreed.found_inf:  # skip_nonfinite_steps: every rank found the same flag
            self.nonfinite_skips += 1
            if self.comm.rank == 0:
                logger.info(
                    "ZeRO: a gradient holds inf or NaN on some rank, optimizer step skipped on every rank "
                    "(skip_nonfinite_steps; %d so far)",
                    self.nonfinite_skips,
                )
        if agreed.found_inf:
            # With no .grad anywhere the optimizer leaves every parameter alone.
            for unit in self.units:
                unit.attach_master_grads([False] * len(unit.grads.slot_has_grad))
            self.last_step_skipped = True
        if not self.last_step_skipped:
            for unit, flags in zip(self.units, agreed.slot_flags):
                if unit.index not in stepped:
                    unit.attach_master_grads(flags)
            if self.steps_on_host:
                wait_for_host_copies(self.comm.device)  # the offloaded units' gradient shards have landed

    # ------------------------------------------------------------------- after
    def after(self, groups: OptimizerGroups) -> None:
        """The optimizer's step post-hook: refresh the compute parameters, consume the gradients."""
        groups.show_model_parameters()
        if not self.last_step_skipped:
            # With overlap_param_refresh, issued and not waited for: each unit's next forward
            # waits for its own all-gather, so the later ones run while the first units compute.
            # Not while a torch profiler records: a collective issued under it and waited for
            # after it stopped crashes the process (torch 2.13, gloo; a profiler schedule stops
            # at a step boundary, exactly where these would still be in flight).
            overlap = self.settings.overlap_param_refresh and not torch.autograd._profiler_enabled()
            for unit in self.units:
                unit.storage.start_refresh(guard=overlap)
            if not overlap:
                self.runtime.wait_for_refresh()
            self.comm.progress.steps += 1
        self.discard_grads()
        self._record_traffic()

    def _record_traffic(self) -> None:
        now = self.comm.stats.snapshot()
        self.last_step_traffic = CommStats.difference(now, self._traffic_at_last_step)
        self._traffic_at_last_step = now
        now = self.comm.stats.span_snapshot()
        self.last_step_traffic_by_span = CommStats.difference(now, self._span_traffic_at_last_step)
        self._span_traffic_at_last_step = now
