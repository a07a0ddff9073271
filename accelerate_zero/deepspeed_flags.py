"""Accelerate's DeepSpeed flags given to ``accelerate-zero launch``, and a DeepSpeed JSON config given to
``--zero_config_file``: honoured where a ZeRO setting means the same thing, refused otherwise, never ignored.

``accelerate launch`` reads them only with ``--use_deepspeed``; anywhere else its parser accepts them and
drops them. A DeepSpeed user's ``accelerate-zero launch --zero_stage 1`` would then train at our default
stage 3 without a word. So the ones with a meaning here become settings (a conflict with the same setting
given our way is refused), and every other one, or asking Accelerate for another framework, stops the
launch with what to do instead.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from zero_core import user_settings
from zero_core.deepspeed import from_deepspeed

from .plugin import DEEPSPEED_CLIPPING_ENV, DEEPSPEED_CONFIG_ENV, MIXED_PRECISION_OF_DEEPSPEED

# Accelerate's flag (its argparse dest) -> the setting it means.
HONOURED = {
    "zero_stage": "stage",
    "offload_optimizer_device": "offload_optimizer",
    "offload_optimizer_nvme_path": "offload_dir",
    "offload_param_device": "offload_params",
    "offload_param_nvme_path": "offload_dir",
}

# Accepted, and what the run does is what these ask for anyway (listed on one line, never silent).
ACCEPTED = {
    "zero3_init_flag": "the model is built as the script builds it and stage 3 shards it unit by unit when it is "
    "prepared (build it on the meta device for one larger than host memory); the numbers trained are the same",
    "zero3_save_16bit_model": "accelerator.save_model and get_state_dict always gather the full weights, at any stage",
}
# Read as a DeepSpeed JSON config, as --zero_config_file ds.json is.
CONFIG_FILE = "deepspeed_config_file"
# Becomes the Accelerator's default, as a DeepSpeed config's gradient_accumulation_steps does.
ACCUMULATION = "gradient_accumulation_steps"
ACCUMULATION_VARIABLE = "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"

# Clips the gradient norm in each optimizer step, as DeepSpeed's engine does with the same value.
CLIPPING = "gradient_clipping"
CLIPPING_VARIABLE = DEEPSPEED_CLIPPING_ENV
# DeepSpeed's launcher for each node: "standard" is torch's own (torchrun), which is how every launch here runs.
LAUNCHER = "deepspeed_multinode_launcher"
STANDARD_LAUNCHER = "standard"

_MULTINODE = (
    "multi-node runs start torch's own launcher on each machine (DeepSpeed's \"standard\"): give Accelerate's "
    "--num_machines, --machine_rank and --main_process_ip"
)
REFUSED = {
    "deepspeed_hostfile": _MULTINODE,
    "deepspeed_exclusion_filter": _MULTINODE,
    "deepspeed_inclusion_filter": _MULTINODE,
    "deepspeed_moe_layer_cls_names": "name the layer classes to shard as units with --zero_wrap_classes",
}
OTHER_FRAMEWORKS = {"use_deepspeed": "DeepSpeed", "use_fsdp": "FSDP", "use_megatron_lm": "Megatron-LM"}


# Where each DeepSpeed flag came from when an Accelerate YAML's deepspeed_config block gave it (accelerate_yaml.py):
# the messages then name the file and the block, not a flag that was never typed.
FROM_YAML = "zero_deepspeed_block_of"


def _flag(dest: str, args: argparse.Namespace | None = None) -> str:
    path = getattr(args, FROM_YAML, {}).get(dest) if args is not None else None
    return f"{path}: deepspeed_config.{dest}" if path else "--" + dest


def take_deepspeed_flags(args: argparse.Namespace, values: dict[str, Any], given_our_way: set[str]) -> None:
    """Move the honoured flags of ``args`` into ``values`` (settings by name), or raise ValueError."""
    for dest, framework in OTHER_FRAMEWORKS.items():
        if getattr(args, dest, False):
            raise ValueError(
                f"{_flag(dest)} asks Accelerate for {framework}, but accelerate-zero launch runs lightning-zero's "
                f"ZeRO: drop {_flag(dest)} (or launch {framework} with `accelerate launch`)."
            )
    _take_launcher(args)
    refused = [f"{_flag(dest, args)}: {why}" for dest, why in REFUSED.items() if getattr(args, dest, None) is not None]
    if refused:
        raise ValueError("DeepSpeed's launch options have no meaning here; " + "; ".join(refused) + ".")
    _take_accepted(args)
    _take_accumulation(args)
    _take_clipping(args)
    settings = {setting.text.name: setting for setting in user_settings()}
    honoured: dict[str, str] = {}  # setting name -> the DeepSpeed flag that gave it
    for dest, name in HONOURED.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        setattr(args, dest, None)  # ours now; Accelerate's launcher must not act on it either
        setting = settings[name]
        parsed = setting.text.parse(value) if isinstance(value, str) else value
        if name in given_our_way and values[name] != parsed:
            raise ValueError(
                f"{_flag(dest, args)} {value} and {setting.text.flag} {setting.text.format(values[name])} disagree: "
                f"give the {name} once."
            )
        if name in honoured and values[name] != parsed:  # both offload flags' nvme paths: one offload_dir
            raise ValueError(
                f"{_flag(dest, args)} {value} and {honoured[name]} {values[name]} disagree: give one {name}."
            )
        values[name], honoured[name] = parsed, _flag(dest, args)


def _take_accepted(args: argparse.Namespace) -> None:
    accepted = []
    for dest, why in ACCEPTED.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        if str(value).lower() not in ("true", "false"):
            raise ValueError(f"{_flag(dest, args)} {value}: true or false.")
        setattr(args, dest, None)  # ours now, as the honoured ones
        accepted.append(f"{_flag(dest, args)} {str(value).lower()} ({why})")
    if accepted:
        print(f"accelerate-zero: accepted without effect: {'; '.join(accepted)}.", file=sys.stderr)


def _take_accumulation(args: argparse.Namespace) -> None:
    """The micro-batches per step, as the Accelerator's default (``Accelerator(gradient_accumulation_steps=)``
    in the script still decides, as it does over ``accelerate launch --gradient_accumulation_steps``)."""
    value = getattr(args, ACCUMULATION, None)
    if value is None:
        return
    setattr(args, ACCUMULATION, None)
    if not str(value).isdigit() or int(value) < 1:
        raise ValueError(f"{_flag(ACCUMULATION, args)} {value}: an integer >= 1.")
    os.environ[ACCUMULATION_VARIABLE] = str(int(value))


def _take_launcher(args: argparse.Namespace) -> None:
    """``standard`` asks for what every launch here is (TRL's and many recipes' YAMLs carry it); the others are
    DeepSpeed's ssh- and MPI-based launchers, which start no torch launcher."""
    value = getattr(args, LAUNCHER, None)
    if value is None:
        return
    setattr(args, LAUNCHER, None)
    if str(value) != STANDARD_LAUNCHER:
        raise ValueError(
            f"{_flag(LAUNCHER, args)} {value}: DeepSpeed's {value} launcher is not used here; {_MULTINODE} (or set "
            f"it to {STANDARD_LAUNCHER}, which is torch's launcher, what accelerate-zero launch runs)."
        )


def _take_clipping(args: argparse.Namespace) -> None:
    """The norm each optimizer step clips the gradients at, as DeepSpeed's engine clips with it (a DeepSpeed JSON
    config's ``gradient_clipping`` travels the same way, in its file): in each process, ``ZeroPlugin`` reads it."""
    value = getattr(args, CLIPPING, None)
    if value is None:
        return
    setattr(args, CLIPPING, None)
    try:
        clip = float(value)
    except ValueError:
        clip = -1.0
    if not clip >= 0:
        raise ValueError(f"{_flag(CLIPPING, args)} {value}: a number >= 0 (the norm to clip at; 0 clips nothing).")
    config_file = os.environ.get(DEEPSPEED_CONFIG_ENV)  # set just before, where a DeepSpeed JSON config was given
    if config_file is not None:
        in_file = from_deepspeed(config_file, stage_given=True).loop.get(CLIPPING)
        if in_file is not None and in_file != clip:
            raise ValueError(
                f"{_flag(CLIPPING, args)} {value} and {config_file}'s gradient_clipping {in_file} disagree: give "
                "the norm once."
            )
    os.environ[CLIPPING_VARIABLE] = str(clip)


def settings_from_deepspeed_file(path: str, args: argparse.Namespace, stage_given: bool = False) -> dict[str, Any]:
    """``--zero_config_file ds_config.json``: the settings it means; its precision becomes the launch's
    ``--mixed_precision`` (a different one given is refused), its accumulation Accelerate's variable."""
    translated = from_deepspeed(path, stage_given=stage_given)
    if translated.without_effect:
        print(f"accelerate-zero: {translated.without_effect_line()}", file=sys.stderr)  # once, before the launch
    if translated.precision is not None:
        wanted = MIXED_PRECISION_OF_DEEPSPEED[translated.precision]
        given = getattr(args, "mixed_precision", None)
        if given not in (None, wanted):
            raise ValueError(f"{path} asks for {translated.precision}, --mixed_precision says {given}: give one.")
        args.mixed_precision = wanted
    # Read again in each process (plugin.py): its optimizer and scheduler sections are built there, and its
    # clipping applied in each optimizer step, as DeepSpeed's engine does.
    os.environ[DEEPSPEED_CONFIG_ENV] = os.path.abspath(path)
    steps = translated.loop.get("gradient_accumulation_steps")
    if steps is not None:  # the Accelerator's default, as the flag sets it (take_deepspeed_flags)
        given = getattr(args, ACCUMULATION, None)
        if given is not None and str(given) != str(steps):
            raise ValueError(
                f"{path} accumulates {steps} micro-batches, {_flag(ACCUMULATION, args)} says {given}: give one."
            )
        setattr(args, ACCUMULATION, str(steps))
    # train_micro_batch_size_per_gpu: the DataLoader's batch size decides, as under DeepSpeed.
    return translated.settings
