"""``ZeroPlugin``: the ZeRO settings of an Accelerate run.

Like Accelerate's own DeepSpeed and FSDP plugins, every field left unset is
read from an environment variable the launcher sets (``ACCELERATE_USE_ZERO``,
``ACCELERATE_ZERO_*``); explicit arguments win. The same fields are the keys
of the YAML file ``accelerate-zero launch --zero_config_file`` takes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zero_core import MixedPrecision, WrapPolicy, ZeroConfig

USE_ZERO_ENV = "ACCELERATE_USE_ZERO"
ENV_PREFIX = "ACCELERATE_ZERO_"

# Accelerate's mixed_precision values -> the core's policy (fp32 master and reduction).
MIXED_PRECISION_POLICIES = {
    "no": MixedPrecision(),
    "bf16": MixedPrecision(compute_dtype=torch.bfloat16),
    "fp16": MixedPrecision(compute_dtype=torch.float16),
}


def parse_bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{value!r} is not a boolean; use true or false.")


def _parse_classes(value: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    names = value.split(",") if isinstance(value, str) else value
    return tuple(str(name).strip() for name in names if str(name).strip())


def _parse_optional_int(value: str) -> int | None:
    return None if value.strip().lower() in ("", "none") else int(value)


def parse_prefetch(value: str) -> int | str:
    """A depth, or "auto" (chosen from measured times)."""
    return "auto" if value.strip().lower() == "auto" else int(value)


_PARSERS = {
    "stage": int,
    "bucket_size_mb": float,
    "prefetch": parse_prefetch,
    "prefetch_cap_mb": float,
    "broadcast_buffers": parse_bool,
    "wrap_classes": _parse_classes,
    "overlap_param_refresh": parse_bool,
    "shard_group_size": _parse_optional_int,
    "persistence_threshold": int,
}


@dataclass(frozen=True)
class ZeroPlugin:
    """stage: 1, 2 or 3. wrap_classes: names of the module classes that become
    units (transformer blocks), e.g. ``("GPTBlock",)``; default: by size.
    bucket_size_mb, prefetch (a depth, or "auto"), prefetch_cap_mb, broadcast_buffers, overlap_param_refresh,
    persistence_threshold: as in ``zero_core.ZeroConfig``.
    shard_group_size: hybrid sharding: shard inside groups of this many processes (usually
    the processes per machine, with ``--num_machines``) and replicate across them;
    default: every process."""

    stage: int | None = None
    bucket_size_mb: float | None = None
    prefetch: int | str | None = None
    prefetch_cap_mb: float | None = None
    broadcast_buffers: bool | None = None
    wrap_classes: tuple[str, ...] | None = None
    overlap_param_refresh: bool | None = None
    shard_group_size: int | None = None
    persistence_threshold: int | None = None

    def __post_init__(self) -> None:
        defaults = ZeroConfig()
        for field in fields(self):
            value = getattr(self, field.name)
            if value is None:
                raw = os.environ.get(ENV_PREFIX + field.name.upper())
                if raw is not None:
                    try:
                        value = _PARSERS[field.name](raw)
                    except ValueError as error:
                        raise ValueError(f"{ENV_PREFIX}{field.name.upper()}={raw!r}: {error}") from None
            elif field.name == "wrap_classes":
                value = _parse_classes(value)
            if value is None:
                value = () if field.name == "wrap_classes" else getattr(defaults, field.name)
            object.__setattr__(self, field.name, value)
        self.zero_config(MixedPrecision())  # validate every field now, with the core's messages

    @classmethod
    def from_mapping(cls, values: dict[str, Any], source: str = "the ZeRO config") -> "ZeroPlugin":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{source}: unknown key(s) {unknown}; the keys are {sorted(known)}.")
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> "ZeroPlugin":
        return cls.from_mapping(read_yaml(path), str(path))

    def environment(self) -> dict[str, str]:
        """The variables that hand these settings to the launched processes."""
        env = {USE_ZERO_ENV: "true"}
        for field in fields(self):
            value = getattr(self, field.name)
            env[ENV_PREFIX + field.name.upper()] = ",".join(value) if field.name == "wrap_classes" else str(value)
        return env

    def zero_config(self, mixed_precision: MixedPrecision, model: nn.Module | None = None) -> ZeroConfig:
        return ZeroConfig(
            stage=self.stage,
            bucket_size_mb=self.bucket_size_mb,
            prefetch=self.prefetch,
            prefetch_cap_mb=self.prefetch_cap_mb,
            broadcast_buffers=self.broadcast_buffers,
            overlap_param_refresh=self.overlap_param_refresh,
            shard_group_size=self.shard_group_size,
            persistence_threshold=self.persistence_threshold,
            mixed_precision=mixed_precision,
            wrap_policy=self._wrap_policy(model),
        )

    def _wrap_policy(self, model: nn.Module | None) -> WrapPolicy:
        if not self.wrap_classes or model is None:
            return WrapPolicy()
        by_name = {type(m).__name__: type(m) for m in model.modules()}
        missing = [name for name in self.wrap_classes if name not in by_name]
        if missing:
            raise ValueError(
                f"wrap_classes: the model has no module class named {missing}; it has {sorted(by_name)[:20]}."
            )
        return WrapPolicy(module_classes=tuple(by_name[name] for name in self.wrap_classes))


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """The settings a ZeRO YAML file sets (its keys are checked by ``ZeroPlugin.from_mapping``)."""
    import yaml

    values = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a mapping of ZeRO settings, found {type(values).__name__}.")
    return values


def zero_requested() -> bool:
    return parse_bool(os.environ.get(USE_ZERO_ENV, "false"))
