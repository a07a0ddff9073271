"""How a unit's collectives travel (ZeRO++), derived once from the settings, like ``StagePlan``.

Three pieces:

- ``quantize_weights`` (qwZ): stage 3's forward and backward parameter all-gathers carry int8 blocks of
  ``quantization_block_size`` elements, each with an fp32 scale (``quantization.py``,
  ``collectives/quantized_gather.py``). It changes the values a forward computes with, never the fp32
  masters: the optimizer, checkpoints, ``gathered_parameters()`` and exports read and gather them exactly.
- ``quantize_gradients`` (qgZ): stages 2 and 3 reduce gradients as all-to-alls of int4 (or int8) blocks,
  dequantized and summed in fp32, in two hops with secondary groups (``collectives/quantized_reduce.py``);
  under hybrid sharding the across-groups all-reduce travels quantized too. Like qwZ it changes numbers:
  the gradients the optimizer steps with, never the masters it steps.
- ``secondary_shard_group_size`` (hpZ): a unit's parameters stay in pieces over k ranks between its forward
  and its backward, whose all-gather then stays inside those ranks (``SecondaryShard`` in
  ``unit/storage.py``). The numbers do not change.

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
    # hpZ: a unit's pieces kept over this many ranks between its forward and its backward; None: none kept.
    secondary_size: int | None = None
    # qgZ: gradient reductions carry blocks of this many elements, each value gradient_bits wide; None: exact.
    gradient_block_size: int | None = None
    gradient_bits: int = 4

    @classmethod
    def from_config(cls, config: Any) -> WirePlan:
        """From a ``ZeroConfig`` (checked by :func:`check_wire` first)."""
        block = config.quantization_block_size
        return cls(
            weight_block_size=block if config.quantize_weights else None,
            secondary_size=config.secondary_shard_group_size,
            gradient_block_size=block if config.quantize_gradients else None,
            gradient_bits=config.gradient_quantization_bits,
        )

    @property
    def quantizes_weights(self) -> bool:
        return self.weight_block_size is not None


def check_wire(config: Any) -> None:
    """The ZeRO++ settings of a ``ZeroConfig``: each a valid value, and only where it means something."""
    check_flags(config, ("quantize_weights", "quantize_gradients"))
    if not is_count(config.quantization_block_size, minimum=1):
        raise ValueError(
            f"ZeroConfig.quantization_block_size={config.quantization_block_size!r} is invalid: use a number of "
            "elements >= 1 per quantization block (each block sends one fp32 scale; the default is 128)."
        )
    if config.gradient_quantization_bits not in (4, 8) or isinstance(config.gradient_quantization_bits, bool):
        raise ValueError(
            f"ZeroConfig.gradient_quantization_bits={config.gradient_quantization_bits!r} is invalid: use 4 "
            "(int4, ZeRO++'s choice: a quarter of bf16's bytes) or 8 (int8: half of them, closer values)."
        )
    size = config.secondary_shard_group_size
    if size is not None and not is_count(size, minimum=1):
        raise ValueError(
            f"ZeroConfig.secondary_shard_group_size={size!r} is invalid: use a number of ranks >= 1 that divides "
            "the shard group (usually the devices per node), or None for no secondary shards."
        )
    if size is not None and config.stage != 3:
        raise ValueError(
            f"ZeroConfig.secondary_shard_group_size keeps stage 3's units in pieces between forward and backward; "
            f"stage {config.stage} keeps the full parameters. Use stage=3, or leave it unset."
        )
    if config.quantize_weights and config.stage != 3:
        raise ValueError(
            f"ZeroConfig.quantize_weights quantizes stage 3's parameter all-gathers; stage {config.stage} keeps "
            "the full parameters and all-gathers them once after each step, exactly. Use stage=3, or leave "
            "quantize_weights off."
        )
    if config.quantize_gradients and config.stage == 1:
        raise ValueError(
            "ZeroConfig.quantize_gradients quantizes the gradient reduce-scatter of stages 2 and 3; stage 1 keeps "
            "full gradients and reduces them in place once per optimizer step, exactly. Use stage=2 (the same "
            "memory for the optimizer state, sharded gradients too), or leave quantize_gradients off."
        )
