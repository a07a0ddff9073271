"""The records of model-state memory: a rank's bytes (:class:`MemoryReport`), measured or predicted alike,
and one unit as the engine sees it (:class:`UnitReport`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MemoryReport:
    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int  # includes the fp32 master shard when it is a separate tensor
    nvme_bytes: int = 0  # in the NVMe tier's files now, not in memory: optimizer state, parameter shards
    # Of the three above, what the offloaded units keep in host memory: their master shards, optimizer state
    # and gradient copies (offload_optimizer) and their parameter shards at rest (offload_params). The rest
    # is on the device.
    host_bytes: int = 0
    # ZeRO++'s quantized collectives in flight now: the packed buffers of gathers (qwZ, prefetched or waiting)
    # and of reduces (qgZ, issued in backward, waited for by its end), on the device.
    # Transient communication memory, in none of the figures above; 0 between steps.
    communication_bytes: int = 0
    # The host copies an asynchronous save staged this rank's state into, kept from one save to the next to be
    # refilled (checkpoint/background_save.py); host memory, in none of the figures above; 0 before the first.
    checkpoint_staging_bytes: int = 0

    @property
    def model_state_bytes(self) -> int:
        """In memory, device and host together (not the NVMe files)."""
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_state_bytes

    @property
    def device_bytes(self) -> int:
        return self.model_state_bytes - self.host_bytes


@dataclass(frozen=True)
class UnitReport:
    """One unit (the parameters gathered, reduced and sharded together) as ``engine.unit_reports()`` sees it now."""

    name: str  # the module path of the unit's root module ("" for the model's root)
    numel: int  # parameter elements (each shared parameter once)
    trainable_numel: int  # of those, the elements of parameters that require grad now
    padded_numel: int  # elements one all-gather or reduce-scatter of the whole unit moves
    persistent: bool  # stage 3: kept gathered between steps (persistence_threshold)
    refreshing: bool  # stages 1/2: the post-step all-gather may still be writing its parameters
    offloaded: bool = False  # offload_optimizer: its master shard and optimizer state live on the host
    params_offloaded: bool = False  # offload_params: its parameter shard rests on the host between gathers
    shard_numel: int = 0  # this rank's shard of it (padded_numel / shard group size)
    trainable_shard_numel: int = 0  # of this rank's shard, the elements of parameters that require grad now
