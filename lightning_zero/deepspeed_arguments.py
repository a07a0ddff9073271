"""Lightning's ``DeepSpeedStrategy`` keyword arguments, taken by ``ZeroStrategy`` and ``ZeroFabricStrategy``:
a DeepSpeed user's ``DeepSpeedStrategy(stage=3, offload_optimizer=True, offload_parameters=True, ...)`` becomes
``ZeroStrategy(<the same keywords>)`` and trains as the same settings would.

One mapping serves every keyword: the keywords become the DeepSpeed config ``DeepSpeedStrategy`` itself builds
from them (``_create_default_config`` in lightning/pytorch/strategies/deepspeed.py and
lightning/fabric/strategies/deepspeed.py, Lightning 2.6.6; reproduced here, as importing it needs DeepSpeed),
and that config is read as every DeepSpeed config is (``zero_core.deepspeed``: each key mapped, accepted without
effect and listed at setup, or refused with what to do). So the keywords take DeepSpeedStrategy's defaults
where those decide what trains: the stage (2) and, for fp16, DeepSpeed's loss scaling (see ``fp16_section``).

The keywords DeepSpeedStrategy shares with ours by name keep our meaning, which is theirs: ``stage``,
``partition_activations``, ``loss_scale``, ``loss_scale_window``, ``min_loss_scale``, ``config`` and DDP's
arguments. ``offload_optimizer`` takes both spellings: our "none"/"cpu"/"nvme", and DeepSpeedStrategy's bool
(True: the device ``offload_optimizer_device`` names, "cpu" by default; False: none).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, NamedTuple, TypeVar

from lightning.fabric.utilities.rank_zero import rank_zero_info

from zero_core import user_settings
from zero_core.deepspeed import DeepSpeedSettings, from_deepspeed, read_deepspeed_config

from .deepspeed_config import Config, settings_with_config

ClassT = TypeVar("ClassT", bound=type)
_OPTIMIZER, _PARAM = "zero_optimization.offload_optimizer", "zero_optimization.offload_param"


class Keyword(NamedTuple):
    """One of DeepSpeedStrategy's own keywords (none of our settings has its name)."""

    annotation: Any  # DeepSpeedStrategy's; the signature here adds None, its default: "not given"
    default: Any  # DeepSpeedStrategy's
    keys: tuple[str, ...] = ()  # where its config puts the value (dotted); none: Lightning uses it itself
    here: str = ""  # accepted without effect: why (a keyword with keys is checked as its config key too)


def _keys(*keys: str) -> tuple[str, ...]:
    return keys


# DeepSpeedStrategy.__init__'s keywords that are not ours, with the config keys _create_default_config writes.
KEYWORDS: dict[str, Keyword] = {
    "zero_optimization": Keyword(bool, True, _keys("zero_optimization")),
    "remote_device": Keyword(
        str,
        None,
        here="configure_model builds on the meta device; each unit is made in its shard, where offload_params puts it",
    ),
    "offload_parameters": Keyword(bool, False, _keys(_PARAM)),
    "offload_params_device": Keyword(str, "cpu", _keys(f"{_PARAM}.device")),
    "nvme_path": Keyword(str, "/local_nvme", _keys(f"{_OPTIMIZER}.nvme_path", f"{_PARAM}.nvme_path")),
    "params_buffer_count": Keyword(int, 5, _keys(f"{_PARAM}.buffer_count")),
    "params_buffer_size": Keyword(int, 100_000_000, _keys(f"{_PARAM}.buffer_size")),
    "max_in_cpu": Keyword(int, 1_000_000_000, _keys(f"{_PARAM}.max_in_cpu")),
    "offload_optimizer_device": Keyword(str, "cpu", _keys(f"{_OPTIMIZER}.device")),
    "optimizer_buffer_count": Keyword(int, 4, _keys(f"{_OPTIMIZER}.buffer_count")),
    "block_size": Keyword(int, 1048576, _keys("aio.block_size")),
    "queue_depth": Keyword(int, 8, _keys("aio.queue_depth")),
    "single_submit": Keyword(bool, False, _keys("aio.single_submit")),
    "overlap_events": Keyword(bool, True, _keys("aio.overlap_events")),
    "thread_count": Keyword(int, 1, _keys("aio.thread_count")),
    "pin_memory": Keyword(bool, False, _keys(f"{_OPTIMIZER}.pin_memory", f"{_PARAM}.pin_memory")),
    "sub_group_size": Keyword(int, 1_000_000_000_000, _keys("zero_optimization.sub_group_size")),
    "contiguous_gradients": Keyword(bool, True, _keys("zero_optimization.contiguous_gradients")),
    "overlap_comm": Keyword(bool, True, _keys("zero_optimization.overlap_comm")),
    "allgather_partitions": Keyword(bool, True, _keys("zero_optimization.allgather_partitions")),
    "reduce_scatter": Keyword(bool, True, _keys("zero_optimization.reduce_scatter")),
    "allgather_bucket_size": Keyword(int, 200_000_000, _keys("zero_optimization.allgather_bucket_size")),
    "reduce_bucket_size": Keyword(int, 200_000_000, _keys("zero_optimization.reduce_bucket_size")),
    "zero_allow_untested_optimizer": Keyword(bool, True, _keys("zero_allow_untested_optimizer")),
    # The Trainer's DeepSpeedStrategy defaults to "auto", Fabric's to None: neither writes the key.
    "logging_batch_size_per_gpu": Keyword(
        int | str,
        "auto",
        _keys("train_micro_batch_size_per_gpu"),
        here="DeepSpeed's throughput log only; the DataLoader's batch size decides",
    ),
    "logging_level": Keyword(int, 30, here="the level of DeepSpeed's own logger; Lightning's logs here"),
    "initial_scale_power": Keyword(int, 16, _keys("fp16.initial_scale_power")),
    "hysteresis": Keyword(int, 2, _keys("fp16.hysteresis")),
    "cpu_checkpointing": Keyword(bool, False, _keys("activation_checkpointing.cpu_checkpointing")),
    "contiguous_memory_optimization": Keyword(
        bool, False, _keys("activation_checkpointing.contiguous_memory_optimization")
    ),
    "synchronize_checkpoint_boundary": Keyword(
        bool, False, _keys("activation_checkpointing.synchronize_checkpoint_boundary")
    ),
    "load_full_weights": Keyword(
        bool, False, here="a checkpoint path is read as what it is: a sharded directory or one consolidated file"
    ),
    "exclude_frozen_parameters": Keyword(
        bool, False, here="checkpoints hold every parameter, frozen ones too (larger files; the same model loads)"
    ),
}
# Ours by name, with DeepSpeedStrategy's meaning: its config key, and its default (where it differs from ours).
SHARED = {
    "stage": ("zero_optimization.stage", 2),
    "partition_activations": ("activation_checkpointing.partition_activations", False),
    "offload_optimizer": (_OPTIMIZER, False),  # DeepSpeedStrategy's bool; our "none"/"cpu"/"nvme" is ours alone
    "loss_scale": ("fp16.loss_scale", 0),
    "loss_scale_window": ("fp16.loss_scale_window", 1000),
    "min_loss_scale": ("fp16.min_loss_scale", 1),
}
LIGHTNING_DEFAULTS = {**{name: k.default for name, k in KEYWORDS.items()}, **{n: d for n, (_, d) in SHARED.items()}}
# The fp16 knobs' spellings here, where they differ from DeepSpeedStrategy's (one knob given both ways).
_SCALER_SPELLINGS = {"initial_scale_power": "initial_loss_scale", "hysteresis": "loss_scale_hysteresis"}
_FP16_KNOBS = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale")
# Keywords the config builder places itself (the rest go to their keys).
_PLACED_APART = ("zero_optimization", "stage", "offload_optimizer", "offload_parameters", "logging_batch_size_per_gpu")
assert not KEYWORDS.keys() & {s.name for s in user_settings()}, "a DeepSpeed keyword would shadow a setting"


def config_keys(name: str) -> tuple[str, ...]:
    """Where DeepSpeedStrategy's config puts a keyword's value; none: Lightning uses it itself."""
    return (SHARED[name][0],) if name in SHARED else KEYWORDS[name].keys


def take_deepspeed_keywords(arguments: dict[str, Any]) -> dict[str, Any]:
    """Remove DeepSpeedStrategy's own keywords from ``arguments`` and return those given (not None), with
    ``offload_optimizer`` when it is DeepSpeedStrategy's bool."""
    given = {name: arguments.pop(name) for name in KEYWORDS if name in arguments}
    if isinstance(arguments.get("offload_optimizer"), bool):
        given["offload_optimizer"] = arguments.pop("offload_optimizer")
    return {name: value for name, value in given.items() if value is not None}


def settings_with_deepspeed(
    owner: str, config: Config, keywords: dict[str, Any], explicit: dict[str, Any]
) -> tuple[dict[str, Any], DeepSpeedSettings | None]:
    """The settings of ``owner(config=config, **keywords, **explicit)``. Our own spelling alone is read as
    always; with a config or DeepSpeedStrategy's keywords, the DeepSpeed config they make is read by
    ``settings_with_config``, ``explicit`` on top (which must not contradict it)."""
    if config is None and not keywords:
        return settings_with_config(None, explicit)
    without_effect = _check_keywords(owner, config, keywords, explicit)
    built = config is None
    if built:
        config, dropped = lightning_config({**_shared(explicit), **keywords})
        without_effect.update(dropped)
        rank_zero_info(f"{owner}: DeepSpeedStrategy's keywords, as the DeepSpeed config it builds from them: {config}")
    if without_effect:
        listed = "; ".join(f"{name}={keywords[name]!r} ({why})" for name, why in without_effect.items())
        rank_zero_info(f"{owner}: DeepSpeedStrategy keyword(s) accepted without effect here: {listed}.")
    # DeepSpeedStrategy adds an fp16 section at setup to a config that has none, when the precision is 16. Its
    # knobs act in fp16 only, so they are read now whatever the precision, beneath our own spelling's values.
    scaler = {} if "fp16" in read_deepspeed_config(config) else _fp16_settings(owner, keywords)
    try:
        explicit = _ours_at_default_give_way(keywords, explicit, config if built else None, scaler)
        return settings_with_config(config, {**scaler, **explicit})
    except ValueError as error:
        if not built:
            raise
        raise ValueError(f"{owner}: {_read_as(keywords, explicit)} {error}") from None


def lightning_config(keywords: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The config ``DeepSpeedStrategy._create_default_config`` builds from ``keywords``, key for key, and the
    keywords its layout drops (keyword -> why). Only the keywords given are written: a keyword left out is
    Lightning's default, which changes nothing here (and, written, would be listed at setup as set), except
    where the default decides what trains: the stage (2), an offload section's device ("cpu") and an "nvme"
    device's nvme_path ("/local_nvme"). The fp16 knobs are ``fp16_section``'s."""
    config: dict[str, Any] = {"zero_optimization": {"stage": keywords.get("stage", SHARED["stage"][1])}}
    for switch, section in (("offload_optimizer", _OPTIMIZER), ("offload_parameters", _PARAM)):
        if keywords.get(switch) is True:
            _put(config, f"{section}.device", "cpu")
    dropped = {}
    for name, value in keywords.items():
        keys = [] if name in _PLACED_APART else [key for key in config_keys(name) if not key.startswith("fp16.")]
        placed = [key for key in keys if not _in_offload_section(key) or _section(config, _parent(key)) is not None]
        for key in placed:
            _put(config, key, value)
        if keys and not placed:
            switches = dict.fromkeys(
                "offload_optimizer" if key.startswith(_OPTIMIZER) else "offload_parameters" for key in keys
            )
            dropped[name] = f"DeepSpeedStrategy reads it only with {' or '.join(f'{s}=True' for s in switches)}"
    if keywords.get("logging_batch_size_per_gpu", "auto") != "auto":
        config["train_micro_batch_size_per_gpu"] = keywords["logging_batch_size_per_gpu"]
    for section in (_OPTIMIZER, _PARAM):  # Lightning writes nvme_path into both; only an nvme device reads it
        offload = _section(config, section)
        if offload is not None and offload["device"] == "nvme":
            offload.setdefault("nvme_path", KEYWORDS["nvme_path"].default)
    return config, dropped


def fp16_section(keywords: Mapping[str, Any]) -> dict[str, Any]:
    """The fp16 section DeepSpeedStrategy adds to a config without one when the precision is 16
    (``_format_precision_config``, lightning/fabric/strategies/deepspeed.py): its loss-scaling keywords, or
    their defaults (DeepSpeed's). "enabled": "auto", not true: the framework's flag decides, as there."""
    return {"enabled": "auto", **{knob: keywords.get(knob, LIGHTNING_DEFAULTS[knob]) for knob in _FP16_KNOBS}}


def _fp16_settings(owner: str, keywords: Mapping[str, Any]) -> dict[str, Any]:
    """Our loss-scaling settings for ``fp16_section(keywords)``. Only DeepSpeedStrategy's own knobs are passed:
    loss_scale and the others we share are the settings on top, checked as ours."""
    try:
        return from_deepspeed({"fp16": fp16_section(keywords)}, stage_given=True).settings
    except ValueError as error:
        raise ValueError(f"{owner}: {_read_as(keywords, {})} {error}") from None


def _ours_at_default_give_way(
    keywords: Mapping[str, Any], explicit: dict[str, Any], built: dict[str, Any] | None, scaler: Mapping[str, Any]
) -> dict[str, Any]:
    """``explicit`` without the settings at our default that DeepSpeedStrategy's keywords set otherwise: LightningCLI
    passes every setting, with its default. Another value must agree: the config built from the keywords is held
    to it by ``settings_with_config``, an fp16 knob given both ways (``hysteresis``, ``loss_scale_hysteresis``) here."""
    derived = dict(from_deepspeed(built, stage_given=True).settings) if built is not None else {}
    knobs = {setting: name for name, setting in _SCALER_SPELLINGS.items() if name in keywords and setting in scaler}
    derived.update({setting: scaler[setting] for setting in knobs})
    defaults = {s.name: s.keyword.default for s in user_settings()}
    kept = {}
    for name, value in explicit.items():
        if name in derived and value != derived[name] and value == defaults[name]:
            continue  # ours at its default gives way
        if name in knobs and value != derived[name]:
            raise ValueError(f"{knobs[name]}={keywords[knobs[name]]!r} and {name}={value!r} set one knob: give one")
        kept[name] = value
    return kept


def _shared(explicit: Mapping[str, Any]) -> dict[str, Any]:
    return {name: explicit[name] for name in SHARED if name in explicit}


def _check_keywords(owner: str, config: Config, keywords: dict[str, Any], explicit: dict[str, Any]) -> dict[str, str]:
    """Refuse, by name and with what to do, what cannot be honoured; return the keywords Lightning uses
    outside the config, accepted without effect here (keyword -> why)."""
    refused = _ignored_with_config(config, keywords) if config is not None else []
    if keywords.get("zero_optimization") is False:
        refused.append("zero_optimization=False trains plain data parallelism, without ZeRO: use DDPStrategy")
    if explicit.get("offload_optimizer", "none") != "none" and "offload_optimizer_device" in keywords:
        refused.append(
            f"offload_optimizer_device={keywords['offload_optimizer_device']!r} goes with offload_optimizer=True, "
            f"and offload_optimizer={explicit['offload_optimizer']!r} names the device itself: give one"
        )
    stage = explicit.get("stage", SHARED["stage"][1])
    if config is None and keywords.get("offload_parameters") is True and stage != 3:
        refused.append(
            "offload_parameters=True needs stage=3 (DeepSpeedStrategy's default stage is 2, where DeepSpeed does "
            f"not offload parameters; stage={stage!r} here): pass stage=3"
        )
    if keywords.get("remote_device", "cpu") not in ("cpu", "nvme"):
        refused.append(f'remote_device={keywords["remote_device"]!r} ("cpu" or "nvme", as DeepSpeed takes it)')
    for name in ("load_full_weights", "exclude_frozen_parameters"):
        if not isinstance(keywords.get(name, False), bool):
            refused.append(f"{name}={keywords[name]!r} (True or False)")
    level = keywords.get("logging_level", 0)
    if isinstance(level, bool) or not isinstance(level, int):
        refused.append(f"logging_level={level!r} (a logging level, an integer such as logging.WARN)")
    if refused:
        raise ValueError(f"{owner}: DeepSpeedStrategy's keyword(s) that cannot be honoured here: {'; '.join(refused)}.")
    return {name: KEYWORDS[name].here for name in keywords if name in KEYWORDS and KEYWORDS[name].here}


def _ignored_with_config(config: Config, keywords: Mapping[str, Any]) -> list[str]:
    """Given a config, DeepSpeedStrategy builds none: the keywords it builds from are unused there, and its
    fp16 knobs too when the config has an fp16 section of its own."""
    has_fp16, refused = "fp16" in read_deepspeed_config(config), []
    for name, value in keywords.items():
        keys = config_keys(name)
        fp16 = bool(keys) and keys[0].startswith("fp16.")
        if not keys or (fp16 and not has_fp16):
            continue  # used with a config too: outside the config, or for the fp16 section Lightning adds
        why = "the config's fp16 section decides" if fp16 else "the config is used as it is"
        refused.append(
            f"{name}={value!r} with config=: DeepSpeedStrategy ignores it there ({why}); set {keys[0]} in the "
            "config, or drop the keyword"
        )
    return refused


def _read_as(keywords: Mapping[str, Any], explicit: Mapping[str, Any]) -> str:
    """Which config key each keyword became, to read a refusal of the config built from them by."""
    names = [*keywords, *(name for name in SHARED if name in explicit and name not in keywords)]
    pairs = [f"{name} -> {', '.join(config_keys(name))}" for name in names if config_keys(name)]
    return f"DeepSpeedStrategy's keywords are read as the DeepSpeed config it builds ({'; '.join(pairs)}):"


def _in_offload_section(key: str) -> bool:
    return key.startswith((f"{_OPTIMIZER}.", f"{_PARAM}."))


def _parent(key: str) -> str:
    return key.rsplit(".", 1)[0]


def _section(config: dict[str, Any], dotted: str) -> dict[str, Any] | None:
    node: Any = config
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else None


def _put(config: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def with_deepspeed_keywords(cls: ClassT) -> ClassT:
    """Add DeepSpeedStrategy's keywords to ``cls.__init__``'s signature (keyword-only; None: not given, so
    LightningCLI can set them too) and to its docstring's Args."""
    init = cls.__init__
    signature = inspect.signature(init)
    added = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=keyword.annotation | None)
        for name, keyword in KEYWORDS.items()
    ]
    init.__signature__ = signature.replace(parameters=[*signature.parameters.values(), *added])  # type: ignore[attr-defined]
    lines = [f"        {name}: {_doc(name, keyword)}" for name, keyword in KEYWORDS.items()]
    cls.__doc__ = "\n".join([(cls.__doc__ or "").rstrip(), *lines]) + "\n"
    return cls


def _doc(name: str, keyword: Keyword) -> str:
    parts = [f"read as its config's {', '.join(keyword.keys)}"] if keyword.keys else []
    parts += [f"accepted without effect: {keyword.here}"] if keyword.here else []
    where = "; ".join(parts)
    return f"DeepSpeedStrategy's keyword (default there: {keyword.default!r}), {where}."
