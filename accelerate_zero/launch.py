"""``accelerate-zero launch``: ``accelerate launch`` with ZeRO settings.

    accelerate-zero launch [--zero_config_file zero.yaml] [--zero_<setting> VALUE ...]
        <every accelerate launch argument> script.py [script args]

``accelerate-zero launch --help`` lists the settings' flags, each with what it
does and its default (they are generated from ``zero_core.user_settings()``).
The ZeRO settings are checked first (an unknown key or a bad value stops
here, before any process starts), exported as ``ACCELERATE_USE_ZERO`` /
``ACCELERATE_ZERO_*``, and Accelerate's own launcher does the rest. Flags
override the file. An Accelerate config written for DeepSpeed (``--config_file accel.yaml`` with
``distributed_type: DEEPSPEED``) is read too: its ``deepspeed_config`` block as Accelerate's DeepSpeed flags
(``accelerate_yaml.py``), its ``deepspeed_config_file`` as ``--zero_config_file`` reads a JSON config. On CPU:
``ACCELERATE_USE_CPU=1 accelerate-zero launch --multi_gpu --num_processes 2 ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from zero_core import Setting, user_settings

from .accelerate_yaml import take_accelerate_yaml
from .deepspeed_flags import CONFIG_FILE, FROM_YAML, settings_from_deepspeed_file, take_deepspeed_flags
from .plugin import ENV_PREFIX, ZeroPlugin, read_yaml

GROUP_TITLE = "ZeRO (accelerate-zero)"


def _help(setting: Setting) -> str:
    default = setting.text.format(setting.text.default) or "none"
    return f"{setting.doc} (default: {default})".replace("%", "%%")  # argparse formats help with %


def _dest(setting: Setting) -> str:
    return f"zero_setting_{setting.text.name}"


def _showing_our_group(base: type[argparse.HelpFormatter]) -> type[argparse.HelpFormatter]:
    """Accelerate's help formatter hides, once other arguments are given (``--multi_gpu --help``),
    the groups it does not list as always shown; list ours there too."""

    class HelpFormatter(base):  # type: ignore[valid-type, misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            titles = getattr(self, "titles", None)
            if isinstance(titles, list):
                titles.append(GROUP_TITLE)

    return HelpFormatter


def launch_parser() -> argparse.ArgumentParser:
    """Accelerate's own launch parser plus ours, so the script and its
    arguments are told apart exactly as ``accelerate launch`` does."""
    from accelerate.commands.launch import launch_command_parser

    parser = launch_command_parser()
    parser.formatter_class = _showing_our_group(parser.formatter_class)
    group = parser.add_argument_group(GROUP_TITLE, "Flags override the file.")
    keys = ", ".join(s.text.name for s in user_settings())
    group.add_argument(
        "--zero_config_file",
        metavar="FILE",
        help=f"a YAML file of ZeRO settings (its keys: {keys}), or a DeepSpeed JSON config",
    )
    for setting in user_settings():
        name = setting.text.name
        group.add_argument(
            setting.text.flag, dest=_dest(setting), metavar=name.upper(), type=setting.text.parse, help=_help(setting)
        )
    return parser


def plugin_from_arguments(argv: list[str]) -> tuple[ZeroPlugin, argparse.Namespace]:
    """Our settings out of ``argv`` (file, then flags); the rest is Accelerate's launch arguments."""
    args = launch_parser().parse_args(argv)
    take_accelerate_yaml(args)  # --config_file with distributed_type DEEPSPEED: its block as DeepSpeed's flags
    # Unset fields take the defaults, not stale variables of an earlier run:
    # clear them before the plugin reads the environment.
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            del os.environ[name]
    config_file = args.zero_config_file
    deepspeed_file = getattr(args, CONFIG_FILE, None)  # Accelerate's way to name a DeepSpeed JSON config
    if deepspeed_file is not None:
        if config_file is not None:
            raise ValueError(f"--zero_config_file {config_file} and --{CONFIG_FILE} {deepspeed_file}: give one file.")
        config_file = deepspeed_file
        setattr(args, CONFIG_FILE, None)  # ours now; Accelerate's launcher must not act on it
    if config_file and (config_file == deepspeed_file or _is_deepspeed_config(config_file)):
        stage_flag = next(_dest(s) for s in user_settings() if s.name == "stage")
        stage_given = args.zero_stage is not None or getattr(args, stage_flag) is not None  # DeepSpeed's or ours
        values = settings_from_deepspeed_file(config_file, args, stage_given)
    else:
        values = read_yaml(config_file) if config_file else {}
    del args.zero_config_file
    given_our_way = set()
    for setting in user_settings():
        value = getattr(args, _dest(setting))
        delattr(args, _dest(setting))
        if value is not None:
            values[setting.text.name] = value
            given_our_way.add(setting.text.name)
    take_deepspeed_flags(args, values, given_our_way)  # --zero_stage 1 is honoured, never dropped
    if hasattr(args, FROM_YAML):
        delattr(args, FROM_YAML)  # ours, for the messages; Accelerate's launcher gets its own arguments only
    return ZeroPlugin.from_mapping(values, config_file or "the ZeRO settings"), args


def _is_deepspeed_config(path: str) -> bool:
    """A DeepSpeed config is one JSON object, whatever the file is called (open-instruct's are ``.conf``); a ZeRO
    settings file is YAML (``.yaml``/``.yml``), whose reader then names any key it does not know."""
    if path.endswith((".yaml", ".yml")):
        return False
    if path.endswith(".json"):
        return True
    try:
        return isinstance(json.loads(Path(path).read_text()), dict)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False


def run_through_the_check(launch_args: argparse.Namespace) -> None:
    """Each process runs the script under ``accelerate_zero.launched``, which refuses training that a plain
    Accelerator or Trainer would do without the ZeRO settings (``plain_training.py``). A command launched
    with ``--no_python`` is not Python to watch and runs as given."""
    if getattr(launch_args, "no_python", False):
        return
    as_module = ["--module"] if getattr(launch_args, "module", False) else []
    launch_args.training_script_args = [*as_module, launch_args.training_script, *launch_args.training_script_args]
    launch_args.training_script = "accelerate_zero.launched"
    launch_args.module = True


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "launch":
        print(__doc__, file=sys.stderr)
        return 2
    try:
        plugin, launch_args = plugin_from_arguments(argv[1:])
    except (ValueError, OSError) as error:
        print(f"accelerate-zero: {error}", file=sys.stderr)
        return 2
    run_through_the_check(launch_args)
    os.environ.update(plugin.environment())
    from accelerate.commands.launch import launch_command

    launch_command(launch_args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
