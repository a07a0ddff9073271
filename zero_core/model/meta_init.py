"""Materialising a model built on the meta device, one unit at a time."""

from __future__ import annotations

from collections.abc import Callable

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


def materialize_modules(modules: list[nn.Module], device: torch.device, param_init_fn: ParamInitFn | None) -> None:
    """Give each module's own meta tensors real storage on ``device`` and initialise them.

    The new storage is swapped into the existing tensor objects, so parameter
    identity, and with it weight tying and the optimizer's references, survives.
    Children are initialised before their parents (``modules`` is in pre-order),
    as in construction, where a parent's ``__init__`` may adjust what its
    children initialised.
    """
    for module in reversed(modules):
        if not _has_meta_tensors(module):
            continue
        for tensor in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            if tensor.is_meta:
                real = torch.empty_like(tensor, device=device)
                if isinstance(tensor, nn.Parameter):
                    real = nn.Parameter(real, requires_grad=tensor.requires_grad)
                torch.utils.swap_tensors(tensor, real)
        with torch.no_grad():
            if param_init_fn is not None:
                param_init_fn(module)
            else:
                module.reset_parameters()
