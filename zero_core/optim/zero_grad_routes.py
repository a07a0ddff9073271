"""``optimizer.zero_grad()`` and ``model.zero_grad()`` drop ZeRO's gradients, as they drop ``.grad`` under DDP.

Under ZeRO the gradients accumulated since the last step live in each unit's flat buffers and reduced
shards, not in ``param.grad`` (absent after a synchronising backward), so torch's own ``zero_grad`` finds
nothing to drop: a step skipped on a non-finite norm would leave its gradients in for every later step.
Torch has no ``zero_grad`` hook, so both calls are routed to the engine's discard first:

- the optimizer: its class is switched to a subclass of its own class (same name) whose ``zero_grad``
  discards, then runs the class's own. A switch, rather than an attribute on the object, also reaches the
  wrappers that subclass the optimizer's class when they are made (Lightning's ``LightningOptimizer``,
  Fabric's ``_FabricOptimizer``) besides those that call it (Accelerate's ``AcceleratedOptimizer``);
  ``unit/guard.py`` switches parameter classes for the same reason. The switch is undone when the engine
  lets go of the optimizer; a wrapper made meanwhile then runs torch's own ``zero_grad`` only.
- the model: each of its modules gets a ``zero_grad`` of its own, so ``model.zero_grad()`` (Hugging Face's
  ``Trainer`` calls it) and ``model.head.zero_grad()`` drop the gradients of that module's parameters.
  A copy of the model (``copy.deepcopy``) keeps the method, bound to the copy, whose parameters the
  engine passes over.
"""

from __future__ import annotations

import copyreg
import functools
import inspect
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

# (the parameters whose gradients go, set_to_none): the engine's discard (passes/gradient_reads.py).
Discard = Callable[[Iterable[torch.Tensor], bool], None]


class ZeroGradRoute:
    """One engine's discard, reached by the routed ``zero_grad`` methods until :meth:`remove`."""

    def __init__(self, discard: Discard):
        self.discard: Discard | None = discard
        self._undo: list[Callable[[], None]] = []

    def __call__(self, parameters: Iterable[torch.Tensor], set_to_none: bool) -> None:
        if self.discard is not None:
            self.discard(parameters, set_to_none)

    def route_optimizer(
        self, optimizer: torch.optim.Optimizer, parameters: Callable[[], list[nn.Parameter]]
    ) -> ZeroGradRoute:
        """``optimizer.zero_grad()`` drops the gradients of ``parameters()`` (its groups' model parameters)."""
        own_class = type(optimizer)
        namespace = {
            "zero_grad": self._routed(own_class.zero_grad, lambda _: parameters()),
            # Named as its own class: messages, checks by name and the ranks' setup agreement see no difference.
            "__module__": own_class.__module__,
            "__qualname__": own_class.__qualname__,
            # A pickle or a copy is of its own class (pickle finds that class by name; a copy's zero_grad is
            # torch's own, not this engine's).
            "__reduce_ex__": lambda self, protocol: _as_class(own_class, object.__reduce_ex__(self, protocol)),
        }
        routed = type(own_class.__name__, (own_class,), namespace)
        optimizer.__class__ = routed

        def undo() -> None:
            if type(optimizer) is routed:
                optimizer.__class__ = own_class

        self._undo.append(undo)
        return self

    def route_model(self, model: nn.Module) -> ZeroGradRoute:
        """``module.zero_grad()`` of ``model`` or any module in it drops that module's parameters' gradients.
        (A module holding the model, such as ``torch.compile``'s or Fabric's wrapper, has a ``zero_grad`` of
        its own class, which this does not reach.)"""
        routed = {}
        for module in model.modules():
            method = types.MethodType(self._routed(type(module).zero_grad, nn.Module.parameters), module)
            # In the instance's own dict: nn.Module.__setattr__ of a subclass may do more than store it.
            routed[module] = module.__dict__["zero_grad"] = method

        def undo() -> None:
            for module, method in routed.items():
                if module.__dict__.get("zero_grad") is method:
                    del module.__dict__["zero_grad"]

        self._undo.append(undo)
        return self

    def _routed(
        self, own: Callable[..., Any], parameters: Callable[[Any], Iterable[torch.Tensor]]
    ) -> Callable[..., Any]:
        """``own`` (a class's ``zero_grad``) after the discard of ``parameters(its object)``' gradients, with ``own``'s
        signature (Accelerate reads it) and arguments: ``set_to_none`` as ``own`` takes it, True without one."""
        signature = inspect.signature(own)

        @functools.wraps(own)
        def zero_grad(this: Any, *args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(this, *args, **kwargs)
            bound.apply_defaults()
            self(parameters(this), bool(bound.arguments.get("set_to_none", True)))
            return own(this, *args, **kwargs)  # torch's own: the local .grad (stage 1's, a no_sync backward's)

        return zero_grad

    def remove(self) -> None:
        """The engine let go (``unshard``, a new optimizer, ``remove_hooks``): plain ``zero_grad`` again."""
        self.discard = None
        for undo in self._undo:
            undo()
        self._undo.clear()


def _as_class(own_class: type, reduced: Any) -> Any:
    """``object.__reduce_ex__``'s answer, rebuilt as ``own_class`` (stdlib's reconstructor: pickle refuses
    ``__newobj__`` of another class than the object's)."""
    return (copyreg._reconstructor, (own_class, object, None), *reduced[2:])
