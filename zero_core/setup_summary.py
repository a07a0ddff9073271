"""One line that says what ZeRO is doing: the adapters log it at setup, on rank 0, through their
framework's logger (Lightning's and Fabric's info lines, Accelerate's logger); a plain engine's user
can print it."""

from __future__ import annotations

import torch

from .engine import ZeroEngine
from .memory.predicted import UnitElements, ddp_bytes, model_state_bytes
from .offload_plan import OffloadTier
from .sizes import human_bytes

ADAM_STATE_BYTES = 8  # per parameter: the formulas' assumption, said in the line


def _mib(count: float) -> str:
    return f"{count / 2**20:,.1f} MiB"


def _count(count: float) -> str:
    for limit, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= limit:
            return f"{count / limit:.2f}{suffix}"
    return f"{count:.0f}"


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _split(engine: ZeroEngine) -> str:
    size = engine.comm.tensor_parallel_size
    return f" on each of {size} tensor-parallel ranks" if size > 1 else ""


def _load_staging(engine: ZeroEngine) -> str:
    """offload_optimizer="nvme": what a checkpoint load stages in offload_dir beside the state (each offloaded
    unit's loaded moments and fp32 master, until every rank has read it), so its room is known at setup."""
    if engine.config.offload.optimizer is not OffloadTier.NVME:
        return ""
    staged = (4 + ADAM_STATE_BYTES) * sum(report.shard_numel for report in engine.unit_reports() if report.offloaded)
    return f"; a checkpoint load stages up to {human_bytes(staged)} more there"


def setup_summary(engine: ZeroEngine) -> str:
    """``ZeRO stage 3: 14 units (largest 12.60M parameters) of 168.07M parameters, ...``: the stage, the
    units, the shard group, the precision, the prefetch, the offload and the model states per rank beside
    DDP's (formulas)."""
    reports = engine.unit_reports()
    config, precision, plan = engine.config, engine.config.mixed_precision, engine.config.offload
    numel, shards = engine.num_parameters, engine.shard_group_size
    elements = UnitElements(numel, numel, numel, shards)  # the model as one unit, every parameter trainable
    on_cpu = engine.comm.device.type == "cpu"
    ours = model_state_bytes(engine.stage, elements, precision, ADAM_STATE_BYTES, plan, plan.fraction, on_cpu)
    ddp = ddp_bytes(elements, precision, ADAM_STATE_BYTES)
    where = ""
    if ours.host_bytes or ours.nvme_bytes:
        where = f" ({_mib(ours.device_bytes)} on the device, {_mib(ours.host_bytes)} on the host"
        where += f", {_mib(ours.nvme_bytes)} on disk{_load_staging(engine)})" if ours.nvme_bytes else ")"
    offload = plan.optimizer.value
    if plan.optimizer.offloads:
        offload += f" ({sum(report.offloaded for report in reports)} of the units)"
    if plan.params.offloads:
        offload += f"; offload_params {plan.params.value} ({sum(r.params_offloaded for r in reports)} of the units)"
    wire = ""
    if config.wire.quantizes_weights:  # ZeRO++'s qwZ
        wire = f" (gathers in int8 blocks of {config.wire.weight_block_size})"
    if config.wire.secondary_size is not None:  # ZeRO++'s hpZ
        wire += f" (backward gathers inside groups of {config.wire.secondary_size})"
    chosen = f"; memory_budget: {engine.fit.summary()}" if engine.fit is not None else ""
    return (
        f"ZeRO stage {engine.stage}: {len(reports)} units (largest {_count(max(r.numel for r in reports))} "
        f"parameters) of {_count(numel)} parameters{_split(engine)}, sharded over {shards} of {engine.world_size} "
        f"{'data-parallel ' if engine.comm.tensor_parallel_size > 1 else ''}ranks; "
        f"compute {_dtype(precision.compute_dtype)}, reduce {_dtype(precision.reduce_dtype)}; "
        f"prefetch {config.prefetch}{wire}; offload_optimizer {offload}; model states per rank about "
        f"{_mib(ours.model_state_bytes)}{where} (DDP: {_mib(ddp.model_state_bytes)}; with Adam's 8 bytes of "
        f"state){chosen}"
    )
