"""Turning a sharded checkpoint directory into full weights on one machine,
without a process group.

    zero-consolidate CHECKPOINT_DIR OUTPUT [--format safetensors|lightning]

``safetensors``: the model's full fp32 weights (and buffers) in one file.
``lightning``: a file ``LightningModule.load_from_checkpoint`` and
``Trainer(ckpt_path=...)`` read: ``state_dict``, ``optimizer_states`` and the
extra state saved beside them.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .agreed_steps import RankAgreement
from .checkpoint_error import CheckpointError
from .checkpoint_records import MODEL_KEY
from .directory import read_shards
from .loading import open_checkpoint


def _set_nested(tree: dict, path: tuple, value: Any) -> None:
    """Place ``value`` at ``path`` in nested dicts (integer parts stay dict keys until
    :func:`_lists_where_dense`, so a forged index cannot make a list a billion long)."""
    node = tree
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise CheckpointError(f"entry path {path!r} runs through a value")
    node[path[-1]] = value


def _lists_where_dense(node: Any) -> Any:
    """Dicts keyed exactly 0..n-1 become lists (param groups), as DCP flattened them."""
    if not isinstance(node, dict):
        return node
    converted = {key: _lists_where_dense(child) for key, child in node.items()}
    if converted and all(isinstance(k, int) for k in converted):
        if sorted(converted) != list(range(len(converted))):
            raise CheckpointError(f"list indices {sorted(converted)[:10]} are not 0..{len(converted) - 1}")
        return [converted[i] for i in range(len(converted))]
    return converted


def _read_full(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every entry as full tensors in nested dicts, and the extra state saved beside them."""
    agreement = RankAgreement(None, f"consolidating checkpoint {Path(path).absolute()}")
    checkpoint = open_checkpoint(agreement, path)
    flat: dict[str, Any] = {}
    for key, entry in checkpoint.metadata.state_dict_metadata.items():
        flat[key] = (
            torch.empty(entry.size, dtype=entry.properties.dtype) if isinstance(entry, TensorStorageMetadata) else None
        )
    agreement.run(
        "reading the shards", lambda: read_shards(checkpoint.directory, checkpoint.metadata, checkpoint.manifest, flat)
    )
    mappings = checkpoint.metadata.planner_data or {}

    def assemble() -> dict[str, Any]:
        nested: dict = {}
        for key, value in flat.items():
            _set_nested(nested, tuple(mappings.get(key, (key,))), value)
        return _lists_where_dense(nested)

    nested, _ = agreement.run("assembling the entries", assemble)
    return nested, checkpoint.extra


def load_full_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Everything in the directory, as full tensors in nested dicts (keys ``model``, ``optimizer_0``, ...),
    after verifying every file; no process group needed."""
    return _read_full(path)[0]


def consolidate_checkpoint(path: str | os.PathLike, output: str | os.PathLike, fmt: str = "safetensors") -> Path:
    """Write full weights (``safetensors``) or a Lightning checkpoint file (``lightning``)."""
    if fmt not in ("safetensors", "lightning"):
        raise ValueError(f"format {fmt!r} is not supported; use 'safetensors' or 'lightning'.")
    checkpoint, extra, model = _read_model_checkpoint(path)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(model, str(output))
        return output
    torch.save(_as_lightning_checkpoint(checkpoint, extra, model), output)
    return output


def lightning_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """The directory as the dict a Lightning checkpoint file holds (``state_dict`` with full tensors,
    ``optimizer_states``, and the saved extra state: epoch, loops, hyperparameters, callbacks)."""
    return _as_lightning_checkpoint(*_read_model_checkpoint(path))


def _read_model_checkpoint(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Any], dict[str, torch.Tensor]]:
    """Everything in the directory, its extra state, and the model's full tensors (contiguous, as files want)."""
    checkpoint, extra = _read_full(path)
    if MODEL_KEY not in checkpoint:
        raise CheckpointError(f"{path} holds no '{MODEL_KEY}' entry; it is not a model checkpoint.")
    return checkpoint, extra, {k: v.contiguous() for k, v in checkpoint[MODEL_KEY].items()}


def _as_lightning_checkpoint(
    checkpoint: dict[str, Any], extra: dict[str, Any], model: dict[str, torch.Tensor]
) -> dict[str, Any]:
    result: dict[str, Any] = {**extra, "state_dict": model}
    optimizers = sorted((k for k in checkpoint if k.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    if optimizers:
        result["optimizer_states"] = [checkpoint[k] for k in optimizers]
    if "pytorch-lightning_version" not in result:
        try:
            result["pytorch-lightning_version"] = importlib.metadata.version("lightning")
        except importlib.metadata.PackageNotFoundError:
            pass
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="zero-consolidate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint", help="the sharded checkpoint directory")
    parser.add_argument("output", help="the file to write")
    parser.add_argument(
        "--format",
        choices=("safetensors", "lightning"),
        default=None,
        help="default: from the output's suffix (.safetensors, else lightning)",
    )
    args = parser.parse_args(argv)
    fmt = args.format or ("safetensors" if args.output.endswith(".safetensors") else "lightning")
    try:
        written = consolidate_checkpoint(args.checkpoint, args.output, fmt)
    except CheckpointError as error:
        print(f"zero-consolidate: {error}", file=sys.stderr)
        return 2
    print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
