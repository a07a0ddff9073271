"""How a unit's collectives travel (ZeRO++), derived once from the settings, like ``StagePlan``.

``quantize_weights`` (qwZ) is the one piece built so far: stage 3's forward and backward parameter
all-gathers carry int8 blocks of ``quantization_block_size`` elements, each with an fp32 scale
(``quantization.py``, ``collectives/quantized_gather.py``). It changes the values a forward computes
with, never the fp32 masters: the optimizer, checkpoints, ``gathered_parameters()`` and exports read and
gather the masters exactly.

``ZeroConfig`` calls :func:`check_wire` when it is built (the checks live here, beside the plan).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .settings import check_flags, is_count


@dataclass(frozen=True)
class WirePlan:
    # qwZ: stage 3's compute gathers carry int8 blocks of this many elements; None: they gather exactly.
    weight_block_size: int | None = None

    @classmethod
    def from_config(cls, config: Any) -> WirePlan:
        """From a ``ZeroConfig`` (checked by :func:`check_wire` first)."""
        return cls(weight_block_size=config.quantization_block_size if config.quantize_weights else None)

    @property
    def quantizes_weights(self) -> bool:
        return self.weight_block_size is not None


def check_wire(config: Any) -> None:
    """The ZeRO++ settings of a ``ZeroConfig``: each a valid value, and only where it means something."""
    check_flags(config, ("quantize_weights",))
    if not is_count(config.quantization_block_size, minimum=1):
        raise ValueError(
            f"ZeroConfig.quantization_block_size={config.quantization_block_size!r} is invalid: use a number of "
            "elements >= 1 per quantization block (each block sends one fp32 scale; the default is 2048)."
        )
    if config.quantize_weights and config.stage != 3:
        raise ValueError(
            f"ZeroConfig.quantize_weights quantizes stage 3's parameter all-gathers; stage {config.stage} keeps "
            "the full parameters and all-gathers them once after each step, exactly. Use stage=3, or leave "
            "quantize_weights off."
        )
