"""Lightning's ``grad_norm`` for a ZeRO-sharded module.

``lightning.pytorch.utilities.grad_norm`` reads ``param.grad``, which ZeRO
does not fill with full gradients (each rank holds a shard). This drop-in
returns the same dictionary, with the true norms over all ranks::

    from lightning_zero import grad_norm

    def on_before_optimizer_step(self, optimizer):
        self.log_dict(grad_norm(self, norm_type=2))   # every rank calls it (one small all-reduce)
"""

from __future__ import annotations

import torch
from torch import nn

from zero_core import engine_owning, total_norm


def grad_norm(module: nn.Module, norm_type: float | int | str, group_separator: str = "/") -> dict[str, torch.Tensor]:
    """``{"grad_2.0_norm/<name>": ..., "grad_2.0_norm_total": ...}`` for ``module``'s parameters,
    named as ``module.named_parameters()`` names them (tied parameters once)."""
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
    found = engine_owning(module)
    if found is None:
        raise ValueError("grad_norm: the module is not part of a model sharded by lightning-zero.")
    engine, _ = found
    norms = engine.grad_norms(norm_type)
    head = f"grad_{norm_type}_norm"
    result = {}
    for name, param in module.named_parameters():
        value = norms.get(f"{head}/{engine.canonical_name(param)}")
        if value is not None:
            result[f"{head}{group_separator}{name}"] = value
    if result:
        result[f"{head}_total"] = total_norm(list(result.values()), norm_type)
    return result
