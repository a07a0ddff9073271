"""``accelerate-zero launch --config_file accel.yaml``: an Accelerate config as ``accelerate config`` writes it for
DeepSpeed (``distributed_type: DEEPSPEED`` and a ``deepspeed_config:`` block) runs on the ZeRO engine.

The block's keys are exactly Accelerate's DeepSpeed launch flags (``--zero_stage``, ``--offload_param_device``,
``--deepspeed_config_file``, ...; Accelerate's launcher reads the block into those flags), so each is treated as
the flag is (``deepspeed_flags.py``), a flag typed on the command line winning over the file as under Accelerate.
Accelerate gets the rest of the file unchanged, with ``distributed_type`` the plain data-parallel one and no
``deepspeed_config`` block: a copy, written next to nothing of the user's and removed when the launch ends.
"""

from __future__ import annotations

import argparse
import atexit
import shutil
import tempfile
from pathlib import Path
from typing import Any

from .deepspeed_flags import ACCEPTED, ACCUMULATION, CLIPPING, CONFIG_FILE, FROM_YAML, HONOURED, LAUNCHER, REFUSED

# The block's keys: every DeepSpeed flag of Accelerate's launcher has a treatment here.
BLOCK_KEYS = (
    frozenset(HONOURED) | frozenset(REFUSED) | frozenset(ACCEPTED) | {ACCUMULATION, CONFIG_FILE, CLIPPING, LAUNCHER}
)


def _read(path: str) -> dict[str, Any]:
    import yaml

    try:
        values = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as error:
        raise ValueError(f"{path}: the Accelerate config cannot be read ({error}).") from error
    return values if isinstance(values, dict) else {}


def _plain_distributed_type(config: dict[str, Any]) -> str:
    """What Accelerate runs without DeepSpeed for the same processes and machines: its torchrun launcher, as
    DeepSpeed's is (``use_cpu: true`` still makes its processes use the CPU, as ``--multi_gpu --cpu`` does)."""
    processes = int(config.get("num_processes") or 1) * int(config.get("num_machines") or 1)
    return "MULTI_GPU" if processes > 1 else "NO"


def take_accelerate_yaml(args: argparse.Namespace) -> None:
    """A DeepSpeed ``--config_file``: its ``deepspeed_config`` block into ``args`` as the flags it means (a flag
    given on the command line wins), and ``args.config_file`` pointed at the copy Accelerate launches from.
    Any other Accelerate config is left to Accelerate, as ``accelerate launch`` reads it."""
    path = getattr(args, "config_file", None)
    if not path:
        return
    config = _read(path)
    if config.get("distributed_type") != "DEEPSPEED":
        return
    block = config.pop("deepspeed_config", None) or {}
    if not isinstance(block, dict):
        raise ValueError(f"{path}: deepspeed_config is {block!r}; Accelerate writes it as a mapping of its keys.")
    unknown = sorted(set(block) - BLOCK_KEYS)
    if unknown:
        raise ValueError(
            f"{path}: deepspeed_config has key(s) {unknown} that Accelerate's DeepSpeed launch does not take either "
            f"(its keys: {sorted(BLOCK_KEYS)}): correct or remove them."
        )
    from_file = getattr(args, FROM_YAML, {})
    for key, value in block.items():
        if getattr(args, key, None) is None and value is not None:
            setattr(args, key, value if isinstance(value, str) else str(value).lower())  # as typed on the line
            from_file[key] = path  # for the messages: the file's key, not a flag
    setattr(args, FROM_YAML, from_file)
    config["distributed_type"] = _plain_distributed_type(config)
    args.config_file = _write_copy(config, Path(path).name)


def _write_copy(config: dict[str, Any], name: str) -> str:
    import yaml

    folder = tempfile.mkdtemp(prefix="accelerate-zero-")
    atexit.register(shutil.rmtree, folder, True)  # the launch runs in this process: removed after it ends
    copy = Path(folder) / name
    copy.write_text(yaml.safe_dump(config))
    return str(copy)
