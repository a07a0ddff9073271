"""``accelerate-zero launch``: ``accelerate launch`` with ZeRO settings.

    accelerate-zero launch [--zero_config_file zero.yaml] [--zero_<setting> VALUE ...]
        <every accelerate launch argument> script.py [script args]

``accelerate-zero launch --help`` lists the settings' flags, each with what it
does and its default (they are generated from ``zero_core.user_settings()``).
The ZeRO settings are checked first (an unknown key or a bad value stops
here, before any process starts), exported as ``ACCELERATE_USE_ZERO`` /
``ACCELERATE_ZERO_*``, and Accelerate's own launcher does the rest. Flags
override the file. On CPU:
``ACCELERATE_USE_CPU=1 accelerate-zero launch --multi_gpu --num_processes 2 ...``.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
from pathlib import Path
from typing import Any

from zero_core import Setting, user_settings

from .deepspeed_flags import settings_from_deepspeed_file, take_deepspeed_flags
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
    # Unset fields take the defaults, not stale variables of an earlier run:
    # clear them before the plugin reads the environment.
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            del os.environ[name]
    config_file = args.zero_config_file
    if config_file and config_file.endswith(".json"):  # a DeepSpeed config, as DeepSpeed's users have it
        values = settings_from_deepspeed_file(config_file, args)
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
    return ZeroPlugin.from_mapping(values, config_file or "the ZeRO settings"), args


def script_imports_us(script: str) -> bool | None:
    """Whether the script file itself imports ``accelerate_zero`` (None: not a file we can read as Python).

    A plain ``accelerate.Accelerator`` or ``transformers.Trainer`` never reads the ZeRO settings and trains with
    DDP; nothing in Accelerate lets the launched process notice that without patching it, so the launcher looks
    at the script instead, before any process starts (a module the script imports is not read)."""
    try:
        tree = ast.parse(Path(script).read_text(encoding="utf-8"), filename=script)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        else:
            continue
        if any(name == "accelerate_zero" or name.startswith("accelerate_zero.") for name in names):
            return True
    return False


PLAIN_SCRIPT_WARNING = (
    "accelerate-zero: warning: {script} does not import accelerate_zero: a plain accelerate.Accelerator or "
    "transformers.Trainer ignores the ZeRO settings and trains with DDP. Build accelerate_zero.ZeroAccelerator "
    "instead of Accelerator, or accelerate_zero.ZeroTrainer instead of Trainer (the same arguments). If a module "
    "the script imports builds one of them, ignore this warning."
)


def warn_about_a_plain_script(launch_args: argparse.Namespace) -> None:
    if getattr(launch_args, "module", False) or getattr(launch_args, "no_python", False):
        return  # a module or a command, not a Python file to read
    script = launch_args.training_script
    if script_imports_us(script) is False:
        print(PLAIN_SCRIPT_WARNING.format(script=script), file=sys.stderr)


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
    warn_about_a_plain_script(launch_args)
    os.environ.update(plugin.environment())
    from accelerate.commands.launch import launch_command

    launch_command(launch_args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
