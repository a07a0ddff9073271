"""``accelerate-zero launch``: ``accelerate launch`` with ZeRO settings.

    accelerate-zero launch [--zero_config_file zero.yaml] [--zero_sharding_stage N]
        [--zero_prefetch N|auto] [--zero_prefetch_cap_mb MB] [--zero_bucket_size_mb MB] [--zero_wrap_classes A,B]
        [--zero_broadcast_buffers B] [--zero_overlap_param_refresh B] [--zero_shard_group_size N]
        [--zero_persistence_threshold N]
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

from .plugin import ENV_PREFIX, ZeroPlugin, parse_bool, parse_prefetch, read_yaml

_FLAGS = {
    "--zero_sharding_stage": ("stage", int),
    "--zero_prefetch": ("prefetch", parse_prefetch),
    "--zero_prefetch_cap_mb": ("prefetch_cap_mb", float),
    "--zero_bucket_size_mb": ("bucket_size_mb", float),
    "--zero_wrap_classes": ("wrap_classes", str),
    "--zero_broadcast_buffers": ("broadcast_buffers", parse_bool),
    "--zero_overlap_param_refresh": ("overlap_param_refresh", parse_bool),
    "--zero_shard_group_size": ("shard_group_size", int),
    "--zero_persistence_threshold": ("persistence_threshold", int),
}


def _launch_parser() -> argparse.ArgumentParser:
    """Accelerate's own launch parser plus ours, so the script and its
    arguments are told apart exactly as ``accelerate launch`` does."""
    from accelerate.commands.launch import launch_command_parser

    parser = launch_command_parser()
    group = parser.add_argument_group("ZeRO (accelerate-zero)")
    group.add_argument("--zero_config_file", default=None)
    for flag, (field, kind) in _FLAGS.items():
        group.add_argument(flag, dest=f"zero_setting_{field}", type=kind, default=None)
    return parser


def plugin_from_arguments(argv: list[str]) -> tuple[ZeroPlugin, argparse.Namespace]:
    """Our settings out of ``argv`` (file, then flags); the rest is Accelerate's launch arguments."""
    args = _launch_parser().parse_args(argv)
    # Unset fields take the defaults, not stale variables of an earlier run:
    # clear them before the plugin reads the environment.
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            del os.environ[name]
    config_file = args.zero_config_file
    values = read_yaml(config_file) if config_file else {}
    del args.zero_config_file
    for field, _ in _FLAGS.values():
        value = getattr(args, f"zero_setting_{field}")
        delattr(args, f"zero_setting_{field}")
        if value is not None:
            values[field] = value
    return ZeroPlugin.from_mapping(values, config_file or "the ZeRO settings"), args


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
    os.environ.update(plugin.environment())
    from accelerate.commands.launch import launch_command

    launch_command(launch_args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
