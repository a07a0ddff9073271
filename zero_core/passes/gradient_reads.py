"""Reading and editing the reduced gradients between the last backward and the optimizer step.

Every read first waits for all gradients to be reduced (the runtime's gradient barrier). Under fp16
the clips unscale the gradients in place, once (the step then does not unscale them again); the norms
divide by the loss scale without touching them. Every rank calls each of them: they reduce across ranks.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

import torch

from .. import agreement
from ..collectives import CommContext
from ..optim import grad_ops
from ..optim.loss_scaling import LossScaler
from ..unit import FlatUnit
from .optimizer_step import OptimizerStep
from .runtime import StepRuntime

Parameters = torch.Tensor | Iterable[torch.Tensor] | None  # as torch.nn.utils.clip_grad_norm_ takes them


class GradientReads:
    def __init__(
        self,
        units: list[FlatUnit],
        comm: CommContext,
        runtime: StepRuntime,
        optimizer_step: OptimizerStep,
        loss_scaler: LossScaler | None,
    ):
        self._units, self._comm, self._runtime = units, comm, runtime
        self._optimizer_step, self._loss_scaler = optimizer_step, loss_scaler
        self._slot_of = {id(p): (unit.index, i) for unit in units for i, p in enumerate(unit.params)}

    def clip_grad_norm(self, max_norm: float, norm_type: float, parameters: Parameters = None) -> torch.Tensor:
        self._refuse_after_early_step("clip_grad_norm_")
        selected = self._select(parameters, "clip_grad_norm_")
        self._runtime.settle_gradients()
        self._optimizer_step.unscale_grads_once()
        return grad_ops.clip_grad_norm(self._units, self._comm, max_norm, norm_type, selected)

    def clip_grad_value(self, clip_value: float, parameters: Parameters = None) -> None:
        self._refuse_after_early_step("clip_grad_value_")
        selected = self._select(parameters, "clip_grad_value_")
        self._runtime.settle_gradients()
        self._optimizer_step.unscale_grads_once()
        grad_ops.clip_grad_value(self._units, clip_value, selected)

    def _refuse_after_early_step(self, what: str) -> None:
        if self._runtime.step_in_backward is not None:
            self._runtime.step_in_backward.refuse(what)

    def _select(self, parameters: Parameters, what: str) -> grad_ops.Selection | None:
        """``parameters`` (some of the model's; all when None) as unit slots, the same on every rank: ranks
        that picked different parameters would each clip by another norm, so that is refused on all of them."""
        if parameters is None:
            return None
        given = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        unknown = [p for p in given if id(p) not in self._slot_of]
        if unknown:
            raise ValueError(
                f"{what}: {len(unknown)} of the tensors given are not parameters of the sharded model; pass "
                "model.parameters() or some of them (for example model.head.parameters())."
            )
        selected = frozenset(self._slot_of[id(p)] for p in given)
        names = ",".join(sorted(f"{unit}.{slot}" for unit, slot in selected))
        checks = {f"{what}: the parameters given, as a checksum of their slots": zlib.crc32(names.encode())}
        agreement.agree_on_values(self._comm, checks, f"{what} of some parameters")
        # The whole model (Accelerate passes model.parameters()): the shards as they are, as without parameters.
        return None if len(selected) == len(self._slot_of) else selected

    def norms(self, norm_type: float) -> dict[str, torch.Tensor]:
        """``{"grad_<p>_norm/<name>": ..., "grad_<p>_norm_total": ...}``, Lightning's ``grad_norm`` keys,
        over every parameter some rank has a gradient for, by its canonical name."""
        self._runtime.settle_gradients()
        scaled = self._loss_scaler is not None and not self._optimizer_step.grads_unscaled
        factor = 1.0 / self._loss_scaler.scale if scaled else 1.0
        norms = grad_ops.grad_norms(self._units, self._comm, norm_type, factor)
        prefix = f"grad_{norm_type}_norm"
        result = {f"{prefix}/{name}": value for name, value in norms.items()}
        if norms:
            result[f"{prefix}_total"] = grad_ops.total_norm(list(norms.values()), norm_type)
        return result

    def discard(self, parameters: Parameters = None, set_to_none: bool = True) -> None:
        """``zero_grad``: the gradients accumulated since the last step are dropped, of ``parameters`` only
        if given (tensors that are not the model's parameters are passed over, as a copy of the model's
        are). Local, as under DDP: no rank waits for another."""
        self._refuse_after_early_step("zero_grad()")
        # Only what a pass that raised left behind: the post-step all-gathers (overlap_param_refresh) write
        # parameters, not gradients, and go on into the next forward.
        self._runtime.settle()
        if self._optimizer_step.holds_grads:
            self._optimizer_step.zero_grads(self._slots_by_unit(parameters), set_to_none)

    def _slots_by_unit(self, parameters: Parameters) -> dict[int, frozenset[int]] | None:
        """The slots of ``parameters`` per unit index; None when they are every parameter of the model."""
        if parameters is None:
            return None
        given = [parameters] if isinstance(parameters, torch.Tensor) else parameters
        slots = {self._slot_of[id(p)] for p in given if id(p) in self._slot_of}
        with torch._C.DisableTorchFunctionSubclass():  # stage 3's resting parameters answer it anyway
            trainable = {(u.index, i) for u in self._units for i, param in enumerate(u.params) if param.requires_grad}
        if slots >= trainable:  # frozen parameters have no gradient to keep
            return None
        by_unit: dict[int, set[int]] = {}
        for unit_index, slot in slots:
            by_unit.setdefault(unit_index, set()).add(slot)
        return {unit_index: frozenset(found) for unit_index, found in by_unit.items()}
