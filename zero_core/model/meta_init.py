"""Materialising a model built on the meta device, in the order eager construction initialises it.

Eager construction runs each module's ``__init__`` (and with it, for torch's layers, its
``reset_parameters()``) after its children's, the children in the order they are created,
which is the order they are registered. Replaying the initialisations in that order draws the
same random numbers for the same tensors, so the same seed gives the same weights as building
the model eagerly (DDP's weights), and leaves the generator where eager construction leaves it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch import nn

ParamInitFn = Callable[[nn.Module], None]


def _has_meta_tensors(module: nn.Module) -> bool:
    tensors = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
    return any(t.is_meta for t in tensors)


def model_is_on_meta(model: nn.Module) -> bool:
    return any(_has_meta_tensors(m) for m in model.modules())


def check_meta_initialisable(model: nn.Module, param_init_fn: ParamInitFn | None) -> None:
    """Raise before any work if some meta module has no way to be initialised."""
    if param_init_fn is not None:
        return
    missing = [
        name or type(model).__name__
        for name, module in model.named_modules()
        if _has_meta_tensors(module) and not callable(getattr(module, "reset_parameters", None))
    ]
    if missing:
        raise ValueError(
            "The model is on the meta device and these modules have no reset_parameters() to "
            f"initialise them: {missing[:10]}{' ...' if len(missing) > 10 else ''}. Pass "
            "param_init_fn=<callable(module)> that initialises a module's own tensors in place."
        )


def construction_order(model: nn.Module) -> list[nn.Module]:
    """Every module once, children before their parent and in registration order (post-order)."""
    order: list[nn.Module] = []
    seen: set[int] = set()

    def visit(module: nn.Module) -> None:
        seen.add(id(module))
        for child in module.children():
            if id(child) not in seen:
                visit(child)
        order.append(module)

    visit(model)
    return order


class _OwnTensor(NamedTuple):
    registry: dict[str, torch.Tensor | None]  # the module's _parameters or _buffers
    name: str
    tensor: torch.Tensor


class MetaMaterialiser:
    """Gives a meta model's tensors real storage on ``device`` and initialises them, one module
    at a time, called in ``construction_order``.

    A tensor registered by several modules (tied weights, ``later.weight = first.weight``) was
    initialised by each of them before the tie, and kept the first one's values: a later module
    that is not an ancestor of the first initialises a scratch tensor in its place (drawing the
    random numbers eager construction drew), while an ancestor's initialisation, which eager
    construction runs after the tie, writes the shared tensor itself.
    """

    def __init__(self, model: nn.Module, device: torch.device, param_init_fn: ParamInitFn | None):
        self.device, self.param_init_fn = device, param_init_fn
        order = construction_order(model)
        self._position = {id(m): i for i, m in enumerate(order)}
        self._subtree_start: dict[int, int] = {}  # the position of the first module under each module
        for position, module in enumerate(order):
            children = [self._subtree_start[id(c)] for c in module.children() if id(c) in self._subtree_start]
            self._subtree_start[id(module)] = min(children, default=position)
        self._meta_at_start = {id(t.tensor) for m in order for t in _own_tensors(m) if t.tensor.is_meta}
        self._initialised_at: dict[int, int] = {}  # tensor id -> position of the first module that initialised it

    def initialise(self, module: nn.Module) -> None:
        """Initialise ``module``'s own tensors that were on the meta device (no-op for the others)."""
        own = [t for t in _own_tensors(module) if id(t.tensor) in self._meta_at_start]
        if not own:
            return
        position, start = self._position[id(module)], self._subtree_start[id(module)]
        scratch: list[_OwnTensor] = []
        for entry in own:
            first = self._initialised_at.setdefault(id(entry.tensor), position)
            if entry.tensor.is_meta:
                torch.utils.swap_tensors(entry.tensor, self._empty_like(entry.tensor))
            elif first != position and not start <= first < position:
                scratch.append(entry)
        with _registered_instead(scratch, self._empty_like), torch.no_grad():
            if self.param_init_fn is not None:
                self.param_init_fn(module)
            else:
                module.reset_parameters()

    def _empty_like(self, tensor: torch.Tensor) -> torch.Tensor:
        real = torch.empty_like(tensor, device=self.device)
        return nn.Parameter(real, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else real


def _own_tensors(module: nn.Module) -> list[_OwnTensor]:
    registries: list[dict[str, torch.Tensor | None]] = [module._parameters, module._buffers]  # type: ignore[list-item]
    return [_OwnTensor(r, name, t) for r in registries for name, t in r.items() if t is not None]


@contextmanager
def _registered_instead(entries: list[_OwnTensor], make: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """Each entry's module holds a fresh tensor under the entry's name for the duration."""
    for entry in entries:
        entry.registry[entry.name] = make(entry.tensor)
    try:
        yield
    finally:
        for entry in entries:
            entry.registry[entry.name] = entry.tensor
