"""DeepSpeed's ``zero_optimization`` section (and its two offload sections) as our settings.

Every key of DeepSpeed's ``DeepSpeedZeroConfig`` (and its offload configs) has a row here. Most of them tune
DeepSpeed's own buffers and streams: our units, streams and host buffers do those jobs, and the numbers
trained are the same whatever their value, so they are accepted without effect and listed at setup.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..config import OFFLOAD_MODES
from .common import (
    AUTO,
    DeepSpeedSettings,
    Treatment,
    _number,
    _prefetch_cap,
    _refusal,
    apply_row,
    equals,
    is_number,
    rows_of,
)

MAPPED, WITHOUT_EFFECT, REFUSED = Treatment.MAPPED, Treatment.WITHOUT_EFFECT, Treatment.REFUSED
_UNITS = "units are our buffers: whole modules (wrap classes) or bucket_size_mb"
_STREAMS = "collectives always run on their own streams, overlapped with compute"
_PINNED = "host buffers are pinned whenever a GPU is used"
_NVME_READS = "NVMe reads and writes are staged unit by unit, offload_units_in_memory at a time"
_GATHERED = "stage 3 keeps the running unit and `prefetch` units gathered, and releases each after its pass"


# The values a key accepted without effect may take (a wrong type is still refused, naming the key).
def _is_size(value: Any) -> bool:
    return value == AUTO or is_number(value)


_BOOL = (lambda value: isinstance(value, bool) or value == AUTO, 'true, false or "auto"')
_SIZE = (_is_size, 'a number >= 0, or "auto"')


def _ACCEPTED_IF(test: Callable[[Any], bool]) -> tuple[Callable[[Any], bool], str]:
    return test, "accepted when it asks for what we do"


# (DeepSpeed's alias, its field name) where the two differ: DeepSpeed reads either.
_ALIASES = {
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "stage3_model_persistence_threshold": "model_persistence_threshold",
    "stage3_max_live_parameters": "max_live_parameters",
    "stage3_max_reuse_distance": "max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save": "gather_16bit_weights_on_model_save",
    "stage3_module_granularity_threshold": "module_granularity_threshold",
    "stage3_use_all_reduce_for_fetch_params": "use_all_reduce_for_fetch_params",
    "stage3_allgather_sequential": "allgather_sequential",
}

_ZERO = (
    (
        "stage",
        MAPPED,
        "stage (1, 2 or 3; DeepSpeed's 0 is plain data parallelism: use DDP); with it skip_nonfinite_steps, as "
        "DeepSpeed's ZeRO skips a step whose gradients hold inf or NaN (bf16 at stages 1 and 2: unless "
        "bf16.check_grad_overflow is false)",
    ),
    ("offload_optimizer", MAPPED, "its keys below"),
    ("offload_param", MAPPED, "its keys below (null: no parameter offload)"),
    ("stage3_param_persistence_threshold", MAPPED, 'persistence_threshold ("auto": ours, 0)'),
    ("stage3_prefetch_bucket_size", MAPPED, 'prefetch "auto" with prefetch_cap_mb of that many fp32 elements'),
    ("cpu_offload", MAPPED, 'true: offload_optimizer "cpu" (DeepSpeed\'s older spelling)'),
    ("cpu_offload_param", MAPPED, 'true: offload_params "cpu" (DeepSpeed\'s older spelling)'),
    ("contiguous_gradients", WITHOUT_EFFECT, "gradients always live in flat per-unit buffers", _BOOL),
    ("reduce_scatter", WITHOUT_EFFECT, "gradients are always reduce-scattered (an all-reduce sums the same)", _BOOL),
    ("reduce_bucket_size", WITHOUT_EFFECT, _UNITS, _SIZE),
    ("allgather_bucket_size", WITHOUT_EFFECT, _UNITS, _SIZE),
    ("allgather_partitions", WITHOUT_EFFECT, "parameters are always all-gathered (a broadcast moves the same)", _BOOL),
    ("use_multi_rank_bucket_allreduce", WITHOUT_EFFECT, _UNITS),
    ("overlap_comm", WITHOUT_EFFECT, _STREAMS, _BOOL),
    ("compute_grad_norm", WITHOUT_EFFECT, "the gradient norm is computed when clipping asks for it", _BOOL),
    ("elastic_checkpoint", WITHOUT_EFFECT, "checkpoints always load at another world size", _BOOL),
    ("sub_group_size", WITHOUT_EFFECT, "the offloaded step already runs unit by unit", _SIZE),
    ("cpu_offload_use_pin_memory", WITHOUT_EFFECT, _PINNED, _BOOL),
    ("stage3_model_persistence_threshold", WITHOUT_EFFECT, "stage3_param_persistence_threshold alone decides", _SIZE),
    ("stage3_max_live_parameters", WITHOUT_EFFECT, _GATHERED, _SIZE),
    ("stage3_max_reuse_distance", WITHOUT_EFFECT, _GATHERED, _SIZE),
    ("stage3_gather_16bit_weights_on_model_save", WITHOUT_EFFECT, "a full save always gathers the weights", _BOOL),
    ("stage3_gather_fp16_weights_on_model_save", WITHOUT_EFFECT, "a full save always gathers the weights", _BOOL),
    ("stage3_module_granularity_threshold", WITHOUT_EFFECT, _UNITS, _SIZE),
    ("stage3_use_all_reduce_for_fetch_params", WITHOUT_EFFECT, _STREAMS, _BOOL),
    ("stage3_allgather_sequential", WITHOUT_EFFECT, _STREAMS, _BOOL),
    (
        "ignore_unused_parameters",
        WITHOUT_EFFECT,
        "a parameter without a gradient is skipped, as DDP's find_unused",
        _BOOL,
    ),
    ("legacy_stage1", WITHOUT_EFFECT, "one stage-1 implementation; the same numbers", _BOOL),
    ("round_robin_gradients", WITHOUT_EFFECT, "offloaded gradients are copied unit by unit", _BOOL),
    ("parameter_alignment", WITHOUT_EFFECT, "shards are padded to the alignment collectives need", _SIZE),
    ("memory_efficient_linear", WITHOUT_EFFECT, "linear layers are the model's own", _BOOL),
    ("pipeline_loading_checkpoint", WITHOUT_EFFECT, "checkpoints load shard by shard", _BOOL),
    (
        "override_module_apply",
        WITHOUT_EFFECT,
        "model.apply on a sharded model is the engine's (see model access)",
        _BOOL,
    ),
    (
        "log_trace_cache_warnings",
        WITHOUT_EFFECT,
        "no trace cache: units run in the order the forward calls them",
        _BOOL,
    ),
    ("enable_sanity_checks", WITHOUT_EFFECT, "the engine always checks the ranks agree on the setup", _BOOL),
    ("save_muon_momentum_buffer_in_memory", WITHOUT_EFFECT, "the optimizer's state is torch's", _BOOL),
    ("leaf_module", WITHOUT_EFFECT, _UNITS),
    (
        "zero_hpz_partition_size",
        MAPPED,
        "secondary_shard_group_size (ZeRO++'s hpZ; 1, DeepSpeed's default: none; stage 3 only)",
    ),
    (
        "load_from_fp32_weights",
        REFUSED,
        "checkpoints always load the fp32 masters; remove the key",
        _ACCEPTED_IF(equals(True)),
    ),
    (
        "zero_quantized_weights",
        MAPPED,
        "quantize_weights (ZeRO++'s qwZ: stage 3's compute all-gathers in int8 blocks; stage 3 only)",
    ),
    (
        "zero_quantized_nontrainable_weights",
        REFUSED,
        "frozen weights kept in int8 at rest are not built; quantize_weights quantizes every gather, frozen too",
        _ACCEPTED_IF(equals(False)),
    ),
    (
        "zero_quantized_gradients",
        MAPPED,
        "quantize_gradients (ZeRO++'s qgZ: the gradient reduce-scatter as all-to-alls of int4 blocks; stages 2 and 3)",
    ),
    (
        "zenflow",
        REFUSED,
        "ZenFlow's delayed updates change the numbers; remove the key",
        _ACCEPTED_IF(lambda v: v is None),
    ),
)
_OFFLOAD_OPTIMIZER = (
    ("device", MAPPED, 'offload_optimizer ("none", "cpu" or "nvme")'),
    ("nvme_path", MAPPED, "offload_dir (both offload sections must name the same one)"),
    ("ratio", MAPPED, "offload_fraction (the share of the optimizer offloaded)"),
    ("pin_memory", WITHOUT_EFFECT, _PINNED, _BOOL),
    ("buffer_count", WITHOUT_EFFECT, _NVME_READS, _SIZE),
    ("pipeline_read", WITHOUT_EFFECT, _NVME_READS, _BOOL),
    ("pipeline_write", WITHOUT_EFFECT, _NVME_READS, _BOOL),
    ("fast_init", WITHOUT_EFFECT, _NVME_READS, _BOOL),
    ("super_offload", WITHOUT_EFFECT, "the offloaded step runs on the host with torch's optimizer", _BOOL),
    ("cpuadam_cores_perc", WITHOUT_EFFECT, "the offloaded step runs on the host with torch's optimizer", _SIZE),
)
_OFFLOAD_PARAM = (
    ("device", MAPPED, 'offload_params ("none", "cpu" or "nvme"; stage 3)'),
    ("nvme_path", MAPPED, "offload_dir (both offload sections must name the same one)"),
    ("pin_memory", WITHOUT_EFFECT, _PINNED, _BOOL),
    ("buffer_count", WITHOUT_EFFECT, _NVME_READS, _SIZE),
    ("buffer_size", WITHOUT_EFFECT, _NVME_READS, _SIZE),
    ("max_in_cpu", WITHOUT_EFFECT, _NVME_READS, _SIZE),
)


_ALIAS_OF_FIELD = {field: alias for alias, field in _ALIASES.items()}  # read as the alias
ZERO_ROWS = rows_of("zero_optimization.", _ZERO, _ALIASES)
OFFLOAD_OPTIMIZER_ROWS = rows_of("zero_optimization.offload_optimizer.", _OFFLOAD_OPTIMIZER)
OFFLOAD_PARAM_ROWS = rows_of("zero_optimization.offload_param.", _OFFLOAD_PARAM)
ROWS = (*ZERO_ROWS.values(), *OFFLOAD_OPTIMIZER_ROWS.values(), *OFFLOAD_PARAM_ROWS.values())


def _zero_section(section: Any, result: DeepSpeedSettings, refused: list[str]) -> None:
    if not isinstance(section, Mapping):
        refused.append(f"zero_optimization={section!r} (a JSON object of ZeRO options)")
        return
    for key, value in section.items():
        key = _ALIAS_OF_FIELD.get(key, key)
        name = f"zero_optimization.{key}"
        mapper = _MAPPERS.get(key)
        if mapper is not None:
            mapper(name, value, result, refused)
        elif key in ZERO_ROWS:
            apply_row(ZERO_ROWS[key], name, value, result, refused)
        else:
            refused.append(_refusal(name, value, ZERO_ROWS))


def _stage(name: str, value: Any, result: DeepSpeedSettings, refused: list[str]) -> None:
    if isinstance(value, bool) or value not in (1, 2, 3) or not isinstance(value, int):
        refused.append(f"{name}={value!r} (the integer 1, 2 or 3; for stage 0 use plain DDP)")
    else:
        result.settings["stage"] = value
        # DeepSpeed's ZeRO skips a step whose gradients hold inf or NaN: at stage 3 always, at stages 1 and 2 in
        # fp32 and fp16, and in bf16 unless bf16.check_grad_overflow is false (which precision.py reads).
        if value == 3 or "skip_nonfinite_steps" not in result.settings:
            result.settings["skip_nonfinite_steps"] = True


def _persistence(name: str, value: Any, result: DeepSpeedSettings, refused: list[str]) -> None:
    if value == AUTO:
        result.without_effect[name] = '"auto": our default, 0 (every unit sharded)'
    else:
        _number(name, value, lambda n: result.settings.__setitem__("persistence_threshold", int(n)), refused)


def _prefetch(name: str, value: Any, result: DeepSpeedSettings, refused: list[str]) -> None:
    if value == AUTO:
        result.without_effect[name] = '"auto": our default prefetch, 1 unit ahead'
    else:
        _number(name, value, lambda n: _prefetch_cap(n, result), refused)


def _bool_key(setting: str, when_true: Any = True, when_false: Any = False) -> Callable[..., None]:
    """A DeepSpeed boolean key that sets ``setting`` (``when_false`` None: false leaves it as it is)."""

    def read(name: str, value: Any, result: DeepSpeedSettings, refused: list[str]) -> None:
        if not isinstance(value, bool):
            refused.append(f"{name}={value!r} (true or false)")
        elif value or when_false is not None:
            result.settings[setting] = when_true if value else when_false

    return read


def _secondary(name: str, value: Any, result: DeepSpeedSettings, refused: list[str]) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        refused.append(f"{name}={value!r} (an integer >= 1: the ranks per node, or 1 for none)")
    elif value > 1:
        result.settings["secondary_shard_group_size"] = value


def _offload(name: str, section: Any, result: DeepSpeedSettings, refused: list[str]) -> None:
    if section is None:
        return  # DeepSpeed reads null as no offload
    if not isinstance(section, Mapping):
        refused.append(f"{name}={section!r} (a JSON object with device, nvme_path, ...)")
        return
    optimizer = name.endswith("optimizer")
    rows = OFFLOAD_OPTIMIZER_ROWS if optimizer else OFFLOAD_PARAM_ROWS
    setting = "offload_optimizer" if optimizer else "offload_params"
    for key, value in section.items():
        if key == "device":
            if value not in OFFLOAD_MODES:
                refused.append(f'{name}.device={value!r} ("none", "cpu" or "nvme")')
            elif value != "none":
                result.settings[setting] = value
        elif key == "nvme_path":
            _nvme_path(f"{name}.nvme_path", value, result, refused)
        elif key == "ratio" and key in rows:  # Twin-Flow: the share of the optimizer offloaded
            if value != AUTO:
                _number(f"{name}.ratio", value, lambda n: result.settings.__setitem__("offload_fraction", n), refused)
        elif key in rows:
            apply_row(rows[key], f"{name}.{key}", value, result, refused)
        else:
            refused.append(_refusal(f"{name}.{key}", value, rows))


def _nvme_path(name: str, value: Any, result: DeepSpeedSettings, refused: list[str]) -> None:
    """Both offload sections may name a path: ours is one offload_dir, so they must agree."""
    if value is None:
        return  # DeepSpeed's default: no path (only an "nvme" device needs one)
    if not isinstance(value, str) or not value:
        refused.append(f"{name}={value!r} (a directory path, as a string)")
        return
    earlier = result.settings.get("offload_dir")
    if earlier is not None and earlier != value:
        refused.append(f"{name}={value!r} (the other offload section's nvme_path is {earlier!r}: one directory)")
    else:
        result.settings["offload_dir"] = value


_MAPPERS = {
    "stage": _stage,
    "offload_optimizer": _offload,
    "offload_param": _offload,
    "stage3_param_persistence_threshold": _persistence,
    "stage3_prefetch_bucket_size": _prefetch,
    "cpu_offload": _bool_key("offload_optimizer", "cpu", None),  # DeepSpeed's older spellings
    "cpu_offload_param": _bool_key("offload_params", "cpu", None),
    "zero_quantized_weights": _bool_key("quantize_weights"),
    "zero_quantized_gradients": _bool_key("quantize_gradients"),
    "zero_hpz_partition_size": _secondary,
}
