"""The user's optimizer attached to the shards: rebuilt in place, its param-group view, its hooks, and
what stays behind when the engine gives the model back."""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .. import agreement
from ..collectives import CommContext
from ..offload.nvme_load import NvmeLoad
from ..offload.nvme_save import NvmeSaveReads
from ..offload.state_files import StateFiles
from ..pass_listeners import PassListener
from ..unit import FlatUnit
from .host_step import raw_step_of
from .param_groups import OptimizerGroups
from .rebuild import check_optimizer_supported, reset_optimizer_state
from .whole_tensor_step import check_whole_tensor_settings
from .zero_grad_routes import Discard, ZeroGradRoute

# Optimizers of unsharded engines -> the hooks that keep them refusing to step (and their
# state_dict() working) until an engine attaches them again.
_RETIRED_OPTIMIZERS: "weakref.WeakKeyDictionary[torch.optim.Optimizer, list[Any]]" = weakref.WeakKeyDictionary()

# (groups, step's args, step's kwargs) before the optimizer's own step; (groups) after it.
StepHooks = tuple[Callable[[OptimizerGroups, tuple, dict], None], Callable[[OptimizerGroups], None]]


# torch wraps each optimizer class's ``step`` in its hook runner the first time the class is built. A subclass
# whose ``step`` calls ``super().step()`` of a class that was built too (any AdamW earlier in the process) runs
# the instance's step hooks once per level: ours must run once per step the user takes (a second pre-hook
# counted the step twice; with offload it stepped again from inside the step, without end).
_HOOK_RUNNER = torch.optim.Optimizer.profile_hook_step(lambda *args, **kwargs: None).__code__


def _inside_a_step_of(optimizer: torch.optim.Optimizer) -> bool:
    """True when the hook runner of a step of ``optimizer`` is on the stack more than once: the hooks being
    run now are those of a ``super().step()`` inside the step the user called. Read from the stack, so a step
    that raised leaves nothing behind that could make the next one look nested."""
    levels = 0
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code is _HOOK_RUNNER and frame.f_locals.get("self") is optimizer:
            levels += 1
            if levels > 1:
                return True
        frame = frame.f_back
    return False


def compare_param_groups(comm: CommContext, groups: OptimizerGroups) -> None:
    """Every rank's groups (by name) and hyperparameters alike, or the same ValueError everywhere.
    Every rank must call it together."""
    agreement.agree_on_setup(comm, agreement.describe_optimizer(groups.optimizer, {}, groups.names))
    groups.mark_compared()


def _refuse_step_after_unshard(*_: Any) -> None:
    raise RuntimeError(
        "This optimizer was rebuilt over ZeRO shards, and engine.unshard() gave the model back: its state no "
        "longer matches the model's parameters. Make a new optimizer over model.parameters()."
    )


class OptimizerAttachment(PassListener):
    """At most one optimizer at a time, rebuilt over this rank's shards (``attach``)."""

    def __init__(
        self,
        units: list[FlatUnit],
        comm: CommContext,
        canonical_names: dict[int, str],
        step_hooks: StepHooks,
        agreed_at_setup: torch.optim.Optimizer | None,
        discard: Discard,
        nvme: StateFiles | None = None,
        in_backward: Any = None,
    ):
        self.units, self.comm, self.canonical_names = units, comm, canonical_names
        self.discard = discard  # optimizer.zero_grad()'s, as under DDP (zero_grad_routes.py)
        self.nvme = nvme  # offload_optimizer="nvme": the state lives in files between steps
        self.step_hooks = step_hooks
        self._agreed_at_setup = agreed_at_setup  # attach need not ask the ranks again
        self.optimizer: torch.optim.Optimizer | None = None
        self.groups: OptimizerGroups | None = None  # the optimizer's groups by name, and which view they show
        self.hooks: list[Any] = []
        # offload_step_in_backward's worker (passes/step_in_backward.py, a layer above): told of each optimizer
        # attached, it refuses reading a half-stepped state.
        self.in_backward = in_backward

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        check_optimizer_supported(optimizer)
        check_whole_tensor_settings(optimizer, self.units, self.nvme is not None, self.in_backward is not None)
        if self.nvme is not None or any(unit.offloaded for unit in self.units):
            raw_step_of(optimizer)  # refused now if the offloaded step cannot run it without its hooks
        for handle in _RETIRED_OPTIMIZERS.pop(optimizer, []):  # never stepped (checked above): usable again
            handle.remove()
        if optimizer is not self._agreed_at_setup:
            agreement.agree_on_setup(self.comm, agreement.describe_optimizer(optimizer, self.canonical_names))
        self._agreed_at_setup = None
        self.remove_hooks()
        groups = OptimizerGroups(optimizer, self.units)  # refuses foreign or repeated tensors
        groups.show_pieces()
        reset_optimizer_state(optimizer)
        self.state_replaced()
        groups.show_model_parameters()
        self.groups, self.optimizer = groups, optimizer
        if self.in_backward is not None:
            self.in_backward.optimizer_attached(groups)
        before, after = self.step_hooks
        self.hooks = [
            optimizer.register_step_pre_hook(
                lambda stepped, args, kwargs: None if _inside_a_step_of(stepped) else before(groups, args, kwargs)
            ),
            optimizer.register_step_post_hook(
                lambda stepped, *_: None if _inside_a_step_of(stepped) else after(groups)
            ),
            # Readers of optimizer.state_dict() see the whole state; a loaded one is the state from then on.
            optimizer.register_state_dict_pre_hook(lambda _: self.make_state_resident()),
            optimizer.register_load_state_dict_pre_hook(lambda *_: self.refuse_while_stepped("load_state_dict()")),
            optimizer.register_load_state_dict_post_hook(lambda *_: self.state_replaced()),
            *groups.install_hooks(),
            ZeroGradRoute(self.discard).route_optimizer(optimizer, groups.listed_parameters),
        ]

    def refuse_while_stepped(self, what: str) -> None:
        if self.in_backward is not None:
            self.in_backward.refuse(f"optimizer.{what}")

    def make_state_resident(self) -> None:
        """The whole optimizer state in memory (with the NVMe tier, until the next step writes it out)."""
        self.refuse_while_stepped("state_dict() (or saving it)")
        if self.nvme is not None:
            self.nvme.make_resident()

    def nvme_save_reads(self) -> NvmeSaveReads | None:
        """With the NVMe tier: its state for a reader that goes unit by unit (a save), none brought back into
        memory for good; None without it (the state is in memory)."""
        return NvmeSaveReads(self.nvme) if self.nvme is not None else None

    def nvme_load(self) -> NvmeLoad | None:
        """With the NVMe tier: a load of its units' state (and masters) into its files, a unit at a time."""
        return NvmeLoad(self.nvme) if self.nvme is not None else None

    def bytes_on_disk(self) -> int:
        """Read with the rest of the memory report: units stepping during backward are waited for first."""
        if self.in_backward is not None:
            self.in_backward.wait()
        return self.nvme.bytes_on_disk() if self.nvme is not None else 0

    def state_replaced(self) -> None:
        """``optimizer.state`` holds other tensors now (a load, a reset): the next step adopts them."""
        if self.nvme is not None:
            self.nvme.forget()

    def read_groups(self) -> list[list[str]]:
        """The groups as they are now (a group added since is read in, or refused with ValueError)."""
        return self.groups.read() if self.groups is not None else []

    def group_names(self) -> list[list[str]]:
        """The groups as last read."""
        return self.groups.names if self.groups is not None else []

    def compare_groups(self) -> None:
        assert self.groups is not None
        compare_param_groups(self.comm, self.groups)

    def before_root_forward(self) -> None:
        """The groups list the model's parameters (an optimizer.step() that raised midway left the pieces in)."""
        if self.groups is not None:
            self.groups.show_model_parameters()

    def remove_hooks(self) -> None:
        for handle in self.hooks:
            handle.remove()
        self.hooks = []

    def retire(self) -> None:
        """The model was given back: the optimizer refuses to step until attached again (its state
        belongs to the shards), and its state_dict() still reads the shards' state."""
        if self.optimizer is not None and self.groups is not None:
            _RETIRED_OPTIMIZERS[self.optimizer] = [
                self.optimizer.register_step_pre_hook(_refuse_step_after_unshard),
                *self.groups.install_hooks(),
            ]
