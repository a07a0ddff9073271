"""DeepSpeed's ``zero_optimization`` section (and its two offload sections) as our settings."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..config import OFFLOAD_MODES
from .common import _ALWAYS, AUTO, DeepSpeedSettings, _number, _prefetch_cap, _refusal


def _zero_section(section: Any, result: DeepSpeedSettings, refused: list[str]) -> None:
    if not isinstance(section, Mapping):
        refused.append(f"zero_optimization={section!r} (a JSON object of ZeRO options)")
        return
    for key, value in section.items():
        name = f"zero_optimization.{key}"
        if key == "stage":
            if isinstance(value, bool) or value not in (1, 2, 3):
                refused.append(f"{name}={value!r} (stages 1, 2 and 3; for stage 0 use plain DDP)")
            else:
                result.settings["stage"] = value
        elif key == "offload_optimizer":
            _offload(name, value, result, refused)
        elif key == "offload_param":
            _offload_param(name, value, result, refused)
        elif key == "stage3_param_persistence_threshold":
            if value != AUTO:
                _number(name, value, lambda n: result.settings.__setitem__("persistence_threshold", int(n)), refused)
        elif key == "stage3_prefetch_bucket_size":
            if value != AUTO:
                _number(name, value, lambda n: _prefetch_cap(n, result), refused)
        elif key in ("reduce_bucket_size", "allgather_bucket_size"):
            # DeepSpeed's communication buffers; ours are the units (wrap classes or bucket_size_mb), which
            # these must not resize (a 5e8-element unit would be gathered whole at stage 3). Training is the
            # same whatever they are.
            if value != AUTO:
                _number(name, value, lambda n: None, refused)
        elif key in _ALWAYS and value == _ALWAYS[key]:
            pass
        else:
            refused.append(_refusal(name, value))


def _offload(name: str, section: Any, result: DeepSpeedSettings, refused: list[str]) -> None:
    if not isinstance(section, Mapping):
        refused.append(f"{name}={section!r} (a JSON object with device, nvme_path, ratio)")
        return
    for key, value in section.items():
        if key == "device":
            if value not in OFFLOAD_MODES:
                refused.append(f"{name}.device={value!r} (none, cpu or nvme)")
            else:
                result.settings["offload_optimizer"] = value
        elif key == "nvme_path":
            _nvme_path(f"{name}.nvme_path", value, result, refused)
        elif key == "ratio":  # Twin-Flow: the share of the optimizer offloaded
            if value != AUTO:
                _number(f"{name}.ratio", value, lambda n: result.settings.__setitem__("offload_fraction", n), refused)
        elif key in ("pin_memory", "fast_init") or (key == "buffer_count" and isinstance(value, int)):
            pass  # host buffers are pinned on GPUs; the NVMe tier's reads ahead are offload_units_in_memory
        else:
            refused.append(_refusal(f"{name}.{key}", value))


def _nvme_path(name: str, value: Any, result: DeepSpeedSettings, refused: list[str]) -> None:
    """Both offload sections may name a path: ours is one offload_dir, so they must agree."""
    earlier = result.settings.get("offload_dir")
    if earlier is not None and earlier != str(value):
        refused.append(f"{name}={value!r} (the other offload section's nvme_path is {earlier!r}: one directory)")
    else:
        result.settings["offload_dir"] = str(value)


def _offload_param(name: str, section: Any, result: DeepSpeedSettings, refused: list[str]) -> None:
    if section is None:
        return  # DeepSpeed reads null as no parameter offload
    if not isinstance(section, Mapping):
        refused.append(f"{name}={section!r} (a JSON object with device)")
        return
    for key, value in section.items():
        if key == "device":
            if value not in OFFLOAD_MODES:
                refused.append(f"{name}.device={value!r} (none, cpu or nvme)")
            elif value != "none":
                result.settings["offload_params"] = value
        elif key == "nvme_path":
            _nvme_path(f"{name}.nvme_path", value, result, refused)
        elif key in ("pin_memory", "buffer_count", "buffer_size", "max_in_cpu"):
            pass  # pinned on GPUs; DeepSpeed's NVMe staging buffers: ours are offload_units_in_memory
        else:
            refused.append(_refusal(f"{name}.{key}", value))
