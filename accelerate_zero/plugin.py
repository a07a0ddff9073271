"""``ZeroPlugin``: the ZeRO settings of an Accelerate run.

Like Accelerate's own DeepSpeed and FSDP plugins, every field left unset is
read from an environment variable the launcher sets (``ACCELERATE_USE_ZERO``,
``ACCELERATE_ZERO_*``); explicit arguments win. The same fields are the keys
of the YAML file ``accelerate-zero launch --zero_config_file`` takes.
"""

from __future__ import annotations

import os
from dataclasses import field, fields, make_dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zero_core import MixedPrecision, Setting, ZeroConfig, user_settings
from zero_core.deepspeed import DeepSpeedSettings, from_deepspeed, muon_clipping_problem
from zero_core.settings import parse_bool

USE_ZERO_ENV = "ACCELERATE_USE_ZERO"
ENV_PREFIX = "ACCELERATE_ZERO_"
# accelerate-zero launch --zero_config_file ds.json: the file, for its optimizer and scheduler sections, which
# ZeroAccelerator builds in place of DummyOptim/DummyScheduler (the settings travel as the variables above).
DEEPSPEED_CONFIG_ENV = ENV_PREFIX + "DEEPSPEED_CONFIG_FILE"
# accelerate-zero launch with Accelerate's DeepSpeed gradient_clipping (its flag, or its YAML block's key): the norm
# each optimizer step clips at, as DeepSpeed's engine clips with it (as a JSON config's gradient_clipping does).
DEEPSPEED_CLIPPING_ENV = ENV_PREFIX + "DEEPSPEED_GRADIENT_CLIPPING"
# The keys of a DeepSpeed config that make its global batch (checked in each process: deepspeed_batch.py).
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu")
# DeepSpeed 0.19's gradient_clipping for a config without one; Accelerate fills an "auto" with the same.
DEEPSPEED_DEFAULT_CLIPPING = 1.0

# Accelerate's mixed_precision values -> the core's policy (fp32 master and reduction).
MIXED_PRECISION_POLICIES = {
    "no": MixedPrecision(),
    "bf16": MixedPrecision(compute_dtype=torch.bfloat16),
    "fp16": MixedPrecision(compute_dtype=torch.float16),
}


# A DeepSpeed config's precision -> Accelerate's mixed_precision.
MIXED_PRECISION_OF_DEEPSPEED = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}

_SETTINGS = user_settings()


class _PluginBehaviour:
    """What ``ZeroPlugin`` does with its fields, which are generated from the schema (below)."""

    def __post_init__(self) -> None:
        for setting in _SETTINGS:
            name = setting.text.name
            value = getattr(self, name)
            if value is None:
                value = _from_environment(setting)
            else:
                value = setting.text.normalize(value)
            object.__setattr__(self, name, setting.text.default if value is None else value)
        self.zero_config(MixedPrecision())  # validate every field now, with the core's messages
        launched_with = os.environ.get(DEEPSPEED_CONFIG_ENV)
        clipping = os.environ.get(DEEPSPEED_CLIPPING_ENV)
        if launched_with:  # its sections alone: the launcher turned the rest into the settings and flags
            translated = from_deepspeed(launched_with, stage_given=True)
            # The batch keys too: the launcher cannot know the micro-batch an "auto" leaves to the DataLoader. With
            # a train_batch_size the config's accumulation is one of its three numbers (else the script's decides).
            keys = (*BATCH_KEYS, "gradient_accumulation_steps") if "train_batch_size" in translated.loop else ()
            batch = {k: v for k, v in translated.loop.items() if k in keys}
            sections = DeepSpeedSettings(
                optimizer=translated.optimizer,
                scheduler=translated.scheduler,
                loop={**engine_clipping(translated), **batch},
                source=translated.source,
            )
            if clipping is not None:  # the launcher's, which the file's agrees with or leaves out
                sections.loop["gradient_clipping"] = float(clipping)
            _check_muon_clipping(sections)
            object.__setattr__(self, "deepspeed_loop", sections)  # read by ZeroAccelerator
            object.__setattr__(self, "deepspeed_source", launched_with)  # ZeroTrainer reads it as transformers would
        elif clipping is not None:  # Accelerate's DeepSpeed gradient_clipping without a JSON config
            clipped = DeepSpeedSettings(loop={"gradient_clipping": float(clipping)}, source="the launch's")
            object.__setattr__(self, "deepspeed_loop", clipped)

    @classmethod
    def from_mapping(cls, values: dict[str, Any], source: str = "the ZeRO config") -> ZeroPlugin:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{source}: unknown key(s) {unknown}; the keys are {sorted(known)}.")
        return cls(**values)

    @classmethod
    def from_deepspeed(cls, config: Any, engine_clips: bool = True) -> ZeroPlugin:
        """A DeepSpeed config (dict or JSON file) as the plugin; keys without an equivalent are refused
        (``zero_core.deepspeed``). Its precision and accumulation are the Accelerator's:
        ``ZeroAccelerator(zero_plugin=...)`` checks them against its own arguments. Its clipping is applied in
        each optimizer step, as DeepSpeed's engine applies it under Accelerate (``engine_clips``; ZeroTrainer,
        which clips at ``max_grad_norm`` itself, passes False)."""
        translated = from_deepspeed(config)
        translated.loop.update(engine_clipping(translated) if engine_clips else {})
        if not engine_clips:
            translated.loop.pop("gradient_clipping", None)
        _check_muon_clipping(translated)
        plugin = cls(**translated.settings)
        object.__setattr__(plugin, "deepspeed_loop", translated)  # read by ZeroAccelerator
        object.__setattr__(plugin, "deepspeed_source", config)  # ZeroTrainer reads it as transformers would
        return plugin

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> ZeroPlugin:
        return cls.from_mapping(read_yaml(path), str(path))

    def environment(self) -> dict[str, str]:
        """The variables that hand these settings to the launched processes."""
        env = {USE_ZERO_ENV: "true"}
        for setting in _SETTINGS:
            env[env_variable(setting)] = setting.text.format(getattr(self, setting.text.name))
        return env

    def zero_config(self, mixed_precision: MixedPrecision, model: nn.Module | None = None) -> ZeroConfig:
        values = {s.name: s.text.resolve(getattr(self, s.text.name), model) for s in _SETTINGS}
        return ZeroConfig(mixed_precision=mixed_precision, **values)


def engine_clipping(translated: DeepSpeedSettings) -> dict[str, float]:
    """The norm DeepSpeed's engine clips at under Accelerate: the config's number, else (absent, or "auto" as
    Accelerate fills it) DeepSpeed's default; 0 clips nothing."""
    return {"gradient_clipping": translated.loop.get("gradient_clipping", DEEPSPEED_DEFAULT_CLIPPING)}


def _check_muon_clipping(translated: DeepSpeedSettings) -> None:
    """The clipping DeepSpeed's engine would apply under Accelerate (its default 1.0 where the config sets none),
    which it applies to a Muon update: refused as the config reader refuses a number."""
    problem = muon_clipping_problem(translated.optimizer, translated.loop.get("gradient_clipping"))
    if problem:
        raise ValueError(
            f"{translated.source}: under Accelerate DeepSpeed's engine clips at the config's gradient_clipping, "
            f'{DEEPSPEED_DEFAULT_CLIPPING} where it sets none or "auto": {problem}.'
        )


def env_variable(setting: Setting) -> str:
    return ENV_PREFIX + setting.text.name.upper()


def _from_environment(setting: Setting) -> Any:
    name = env_variable(setting)
    raw = os.environ.get(name)
    if raw is None:
        return None
    try:
        return setting.text.parse(raw)
    except ValueError as error:
        raise ValueError(f"{name}={raw!r}: {error}") from None


_PLUGIN_INTRO = """The ZeRO settings of an Accelerate run: ``ZeroPlugin(stage=3, wrap_classes=("GPTBlock",))``.

    Its fields are generated from ``zero_core.user_settings()``, in their Accelerate spelling
    (``wrap_classes``: the names of the module classes that become units). A field left
    None is read from ``ACCELERATE_ZERO_<FIELD>``, else takes the core's default. With
    hybrid sharding, a group is usually the processes of one machine (``--num_machines``).

    Fields:
    """


def _plugin_doc() -> str:
    lines = [f"        {s.text.name}: {s.doc}." for s in _SETTINGS]
    return "\n".join([_PLUGIN_INTRO.rstrip(), *lines]) + "\n"


# A frozen dataclass whose fields are the settings, each optional (None: from the environment).
ZeroPlugin = make_dataclass(
    "ZeroPlugin",
    [(s.text.name, s.text.annotation | None, field(default=None)) for s in _SETTINGS],
    bases=(_PluginBehaviour,),
    frozen=True,
)
ZeroPlugin.__module__ = __name__  # where pickle finds it (make_dataclass takes module= only from 3.12)
ZeroPlugin.__doc__ = _plugin_doc()


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """The settings a ZeRO YAML file sets (its keys are checked by ``ZeroPlugin.from_mapping``)."""
    import yaml

    values = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a mapping of ZeRO settings, found {type(values).__name__}.")
    return values


def zero_requested() -> bool:
    return parse_bool(os.environ.get(USE_ZERO_ENV, "false"))
