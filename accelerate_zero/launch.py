"""``accelerate-zero launch``: ``accelerate launch`` with ZeRO settings.

    accelerate-zero launch [--zero_config_file zero.yaml] [--zero_sharding_stage N]
        [--zero_prefetch N] [--zero_bucket_size_mb MB] [--zero_wrap_classes A,B]
        <every accelerate launch argument> script.py [script args]

The ZeRO settings are checked first (an unknown key or a bad value stops
here, before any process starts), exported as ``ACCELERATE_USE_ZERO`` /
``ACCELERATE_ZERO_*``, and Accelerate's own launcher does the rest. Flags
override the file. (``--zero_stage`` is Accelerate's DeepSpeed flag, hence
``--zero_sharding_stage``.) On CPU:
``ACCELERATE_USE_CPU=1 accelerate-zero launch --multi_gpu --num_processes 2 ...``.
"""

from __future__ import annotations

import argparse
import os
import sys

from .plugin import ZeroPlugin

_FLAGS = {
    "--zero_sharding_stage": ("stage", int),
    "--zero_prefetch": ("prefetch", int),
    "--zero_bucket_size_mb": ("bucket_size_mb", float),
    "--zero_wrap_classes": ("wrap_classes", str),
    "--zero_broadcast_buffers": ("broadcast_buffers", str),
}


def _zero_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--zero_config_file", default=None)
    for flag, (dest, kind) in _FLAGS.items():
        parser.add_argument(flag, dest=dest, type=kind, default=None)
    return parser


def plugin_from_arguments(argv: list[str]) -> tuple[ZeroPlugin, list[str]]:
    """Our settings out of ``argv`` (file, then flags); the rest is Accelerate's."""
    # Only ours are taken: stop at the script, whose own arguments may look alike.
    ours, rest = _zero_parser().parse_known_args(argv)
    values = ZeroPlugin.from_yaml(ours.zero_config_file).__dict__.copy() if ours.zero_config_file else {}
    for dest, _ in _FLAGS.values():
        if getattr(ours, dest) is not None:
            values[dest] = getattr(ours, dest)
    if isinstance(values.get("broadcast_buffers"), str):
        from .plugin import _parse_bool

        values["broadcast_buffers"] = _parse_bool(values["broadcast_buffers"])
    for key in [k for k, v in values.items() if v is None]:
        del values[key]
    # Unset fields must not come from stale variables of an earlier run.
    for name in list(os.environ):
        if name.startswith("ACCELERATE_ZERO_"):
            del os.environ[name]
    return ZeroPlugin.from_mapping(values), rest


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "launch":
        print(__doc__, file=sys.stderr)
        return 2
    try:
        plugin, rest = plugin_from_arguments(argv[1:])
    except (ValueError, OSError) as error:
        print(f"accelerate-zero: {error}", file=sys.stderr)
        return 2
    os.environ.update(plugin.environment())
    from accelerate.commands.launch import launch_command, launch_command_parser

    launch_command(launch_command_parser().parse_args(rest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
