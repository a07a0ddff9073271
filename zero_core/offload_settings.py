"""The offload settings' modes and their checks, apart from ``config.py`` as the loss-scaling checks are
(``precision.py``): ``ZeroConfig`` calls :func:`check_offload` when it is built."""

from __future__ import annotations

from typing import Any

from .settings import check_flags, is_count

OFFLOAD_MODES = ("none", "cpu", "nvme")


def check_offload(config: Any) -> None:
    """Raises ``ValueError`` saying what to use for the first offload setting of ``config`` (a
    ``ZeroConfig``) that is invalid, alone or beside the others."""
    for name in ("offload_optimizer", "offload_params"):
        if getattr(config, name) not in OFFLOAD_MODES:
            modes = " or ".join(repr(m) for m in OFFLOAD_MODES)
            raise ValueError(f"ZeroConfig.{name}={getattr(config, name)!r} is invalid: use {modes}.")
    if isinstance(config.offload_fraction, bool) or not 0 < config.offload_fraction <= 1:
        raise ValueError(
            f"ZeroConfig.offload_fraction={config.offload_fraction!r} is invalid: use a share in (0, 1] "
            "(1: the whole optimizer state; for none, leave offload_optimizer at 'none')."
        )
    if not is_count(config.offload_units_in_memory, minimum=1):
        raise ValueError(
            f"ZeroConfig.offload_units_in_memory={config.offload_units_in_memory!r} is invalid: use an integer >= 1."
        )
    if config.offload_params != "none" and config.stage != 3:
        raise ValueError(
            f"ZeroConfig.offload_params={config.offload_params!r} needs stage=3: at stage {config.stage} every rank "
            "keeps the full parameters on the device to compute with. Use stage=3, or offload_optimizer to "
            "move the optimizer's part off the device."
        )
    check_flags(config, ("offload_activations", "partition_activations", "offload_step_in_backward"))
    if config.steps_in_backward and config.mixed_precision.uses_loss_scaling:
        raise ValueError(
            "ZeroConfig.offload_step_in_backward=True cannot run with fp16 loss scaling: a step may be skipped "
            "for an overflow found only after backward. Use bf16, or turn offload_step_in_backward off."
        )
    if config.offload_dir is not None and not isinstance(config.offload_dir, str):
        raise ValueError("ZeroConfig.offload_dir must be a path (a string) or None.")
