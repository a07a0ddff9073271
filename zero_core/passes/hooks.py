"""The module and gradient hooks: torch's events, translated into calls of the pass.

:class:`StepHooks` registers, per unit, a forward pre-hook, a forward hook and
an always-called forward hook, and a post-accumulate-grad hook per trainable
parameter; per module called directly while the units owning its parameters
are not running, the same three forward hooks. Each hook only calls the
matching method of :class:`PassEvents` (the runtime). The helpers below hook a
call's inputs (their backward marks the end of the call's backward) and its
outputs (the first gradient reaching them starts the unit's backward). None of
them holds step state: what a pass keeps lives in ``state.PassState``.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.autograd.profiler import record_function
from torch.utils.hooks import RemovableHandle

from ..hook_copies import InertWhenCopied
from ..unit import FlatUnit


class PassEvents(Protocol):
    """What the hooks report; the runtime implements it."""

    def pre_forward(self, unit: FlatUnit, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]: ...

    def post_forward(self, unit: FlatUnit, module: nn.Module, args: tuple, output: Any) -> Any: ...

    def after_call(self, unit: FlatUnit, module: nn.Module, args: tuple, output: Any) -> None: ...

    def pre_call(
        self, needed: list[FlatUnit], module: nn.Module, args: tuple, kwargs: dict
    ) -> tuple[tuple, dict] | None: ...

    def post_call(self, module: nn.Module, args: tuple, output: Any) -> Any: ...

    def after_entry_call(self, module: nn.Module, args: tuple, output: Any) -> None: ...

    def on_grad(self, unit: FlatUnit, slot_index: int, param: nn.Parameter) -> None: ...


class _PostBackward(torch.autograd.Function):
    """Identity on the unit's inputs; its backward runs once the unit's backward is done."""

    @staticmethod
    def forward(ctx: Any, on_backward: Any, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.on_backward = on_backward
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.on_backward()
        return (None, *grads)


def output_tensors(output: Any, depth: int = 2) -> list[torch.Tensor]:
    """The tensors of a module's output: pytree leaves, and the attributes of
    objects pytree does not open (a model's own output class), a few levels down."""
    tensors = []
    for leaf in pytree.tree_leaves(output):
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
        elif depth > 0 and hasattr(leaf, "__dict__") and not isinstance(leaf, (type, nn.Module)):
            tensors.extend(output_tensors(list(vars(leaf).values()), depth - 1))
    return tensors


def wrap_inputs(args: tuple, kwargs: dict, on_backward: Callable[[], None]) -> tuple[tuple, dict] | None:
    """The call's arguments with their grad-requiring tensors passed through :class:`_PostBackward`,
    whose backward calls ``on_backward``; None when no input requires grad (nothing to wrap)."""
    flat, spec = pytree.tree_flatten((args, kwargs))
    positions = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not positions:
        return None
    wrapped = _PostBackward.apply(on_backward, *(flat[i] for i in positions))
    for i, tensor in zip(positions, wrapped):
        flat[i] = tensor
    return pytree.tree_unflatten(flat, spec)


def _gradient_reached(begin_backward: Callable[[], None], keep_alive: object, grad: torch.Tensor | None) -> None:
    begin_backward()


def hook_outputs(output: Any, begin_backward: Callable[[], None], keep_alive: object) -> list[torch.Tensor]:
    """On every grad-requiring tensor of ``output``, a hook calling ``begin_backward`` when the first
    gradient reaches it, and holding ``keep_alive`` (the forward record's token); returns those tensors."""
    hook = functools.partial(_gradient_reached, begin_backward, keep_alive)
    hooked = []
    for tensor in output_tensors(output):
        if tensor.requires_grad:
            tensor.register_hook(hook)
            hooked.append(tensor)
    return hooked


def at_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` when autograd finishes the backward running now."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


class _EagerHook(InertWhenCopied):
    """A module hook run as plain Python under torch.compile (a graph break each), as FSDP2's are: it gathers,
    reshards and keeps step state, none of which belongs in a graph. A deep copy of the module gets an inert
    hook (``hook_copies.py``)."""

    __slots__ = ()

    # The wrapper's own call is what is excluded, not only the hook inside it: Dynamo would otherwise trace
    # into this __call__, break at the excluded hook, then compile the __call__ frame itself for every hook
    # call (one more break each, recompiled per argument type until it hits torch's recompile limit).
    __call__ = torch.compiler.disable(InertWhenCopied.__call__, recursive=True)


def eager(hook: Any) -> Any:
    return _EagerHook(hook)


def profiled(label: str) -> Any:
    """Name a unit-level hook in torch profiler traces (``zero::pre_forward``, ...), as FSDP2 names
    its own: the benchmark's breakdown counts the time spent in hooks from these."""

    def decorate(method: Any) -> Any:
        @functools.wraps(method)
        def profiled(*args: Any, **kwargs: Any) -> Any:
            with record_function(label):
                return method(*args, **kwargs)

        return profiled

    return decorate


class _GradHook:
    """A parameter's post-accumulate-grad hook, holding the runtime and the unit weakly. Torch keeps the hook
    in the parameter's C++ side, where the garbage collector cannot see it: a strong reference from there
    back to the runtime (and through it to the model and the engine) would keep a dropped engine and its
    model alive until the process exits. Registered inside ``InertWhenCopied``, as every hook of ours is."""

    def __init__(self, events: PassEvents, unit: FlatUnit, slot_index: int):
        self.on_grad = weakref.WeakMethod(events.on_grad)
        self.unit = weakref.ref(unit)
        self.slot_index = slot_index

    def __call__(self, param: nn.Parameter) -> None:
        on_grad, unit = self.on_grad(), self.unit()
        if on_grad is not None and unit is not None:
            on_grad(unit, self.slot_index, param)


class StepHooks:
    """Registers the hooks of a model's units, each calling ``events``."""

    def __init__(self, units: list[FlatUnit], events: PassEvents):
        self.units = units
        self.root = units[0]
        self.events = events
        self._unhooked: list[tuple[FlatUnit, int, nn.Parameter]] = []  # frozen parameters, hooked when unfrozen
        self.late_handles: list[RemovableHandle] = []

    def install(self) -> list[RemovableHandle]:
        events, handles = self.events, []
        for unit in self.units:
            module = unit.module
            pre_forward = eager(functools.partial(events.pre_forward, unit))
            handles.append(module.register_forward_pre_hook(pre_forward, with_kwargs=True, prepend=True))
            handles.append(module.register_forward_hook(eager(functools.partial(events.post_forward, unit))))
            # Registered after the post-forward hook, so it runs after it; it also runs when forward raised.
            after_call = eager(functools.partial(events.after_call, unit))
            handles.append(module.register_forward_hook(after_call, always_call=True))
            self._unhooked += [(unit, slot.index, param) for slot, param in zip(unit.layout.slots, unit.params)]
        self.hook_trainable_params()
        for module, needed in self._units_needed_by_calls():
            # Registered after the unit hooks: the pre-hook runs before them (prepend), the others after.
            pre_call = eager(functools.partial(events.pre_call, needed))
            handles.append(module.register_forward_pre_hook(pre_call, with_kwargs=True, prepend=True))
            handles.append(module.register_forward_hook(eager(events.post_call)))
            handles.append(module.register_forward_hook(eager(events.after_entry_call), always_call=True))
        return handles

    def hook_trainable_params(self) -> None:
        """Gradient hooks on the parameters that require grad now; a frozen one gets
        its hook when it is unfrozen (torch takes none on a frozen tensor). Called
        at install and before each outermost forward (``late_handles``)."""
        if not self._unhooked:
            return
        still_frozen = []
        for unit, slot_index, param in self._unhooked:
            if param.requires_grad:
                hook = InertWhenCopied(_GradHook(self.events, unit, slot_index))
                self.late_handles.append(param.register_post_accumulate_grad_hook(hook))
            else:
                still_frozen.append((unit, slot_index, param))
        self._unhooked = still_frozen

    def _units_needed_by_calls(self) -> list[tuple[nn.Module, list[FlatUnit]]]:
        """For each module outside the non-root units: the units outside its subtree
        that own parameters it uses.

        Calling such a module directly (a submodule below the root, a GAN's
        discriminator, a Hugging Face encoder inside generate()) must gather
        those units for the call, and back-propagating it must reduce them,
        exactly as if their own module had been called. Ancestors come first.
        Modules inside a unit (the layers of a transformer block) get no hooks,
        so the forward's hot path pays nothing: called directly, their unit is
        not gathered and stage 3 refuses with ParameterAtRestError naming it.
        """
        unit_of = {id(p): unit for unit in self.units for p in unit.params}
        inside_units = {id(m) for unit in self.units[1:] for m in unit.module.modules() if m is not unit.module}
        result = []
        for module in self.root.module.modules():
            if id(module) in inside_units:
                continue
            inside = {id(m) for m in module.modules()}
            needed = {unit_of[id(p)] for p in module.parameters() if id(p) in unit_of}
            needed = sorted((u for u in needed if id(u.module) not in inside), key=lambda u: u.index)
            if needed:
                result.append((module, needed))
        return result
