"""Settings for a memory budget before launch: the stage, offload, activation checkpointing and micro-batch.

    zero-fit --hf-config path/to/config.json --world-size 8 --budget 20GiB --global-batch-size 256 \\
        --sequence-length 2048 --precision bf16 --offload-dir /local_nvme
    zero-fit --model my_pkg.models:build_model --world-size 2 --budget "device=12GiB" --device cpu

The model is built on the meta device and run on fake tensors (nothing is allocated), its sample batch one
row of ``--sequence-length`` token ids: ``--hf-config`` builds a Hugging Face causal LM from its config (local
files only), with ``input_ids`` and ``labels``; ``--model module:factory`` calls ``factory()``, and the model
is called with the ids (the loss: the sum of its output). Prints the choice, its predicted peak per tier and
the runner-up, then the settings to pass (``fit()`` in Python takes any batch and loss).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

from .config import ZeroConfig, user_settings
from .estimate_cli import PRECISIONS, load_model
from .memory.fit import DEFAULT_MARGIN, FitResult, fit
from .sizes import human_bytes
from .wrap_policy import wrap_policy_of_names


def load_hf_config_model(path: str) -> nn.Module:
    """A causal LM built from the Hugging Face config at ``path`` (a config.json or its folder) on meta."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise ValueError("--hf-config needs transformers: pip install transformers") from None
    if not Path(path).exists():
        raise ValueError(f"--hf-config {path!r}: no such file or folder (local configs only; nothing is downloaded)")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zero-fit", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="module:factory, a callable returning the model (built on meta)")
    source.add_argument("--hf-config", help="a Hugging Face config.json (or its folder): a causal LM built from it")
    parser.add_argument("--world-size", type=int, required=True, help="ranks (processes) in all")
    parser.add_argument("--budget", required=True, help='per rank: "20GiB" or "device=20GiB,host=200GiB,disk=2TB"')
    parser.add_argument("--sequence-length", type=int, default=512, help="tokens per sample (default: 512)")
    parser.add_argument("--global-batch-size", type=int, default=None, help="samples per optimizer step, all ranks")
    parser.add_argument("--precision", choices=sorted(PRECISIONS), default="fp32", help="compute dtype (reduce: fp32)")
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cpu: host and device are one memory (default: cuda where there is one)",
    )
    parser.add_argument("--offload-dir", default=None, help="where offloaded files may go (without it: no disk tier)")
    parser.add_argument("--wrap-classes", default=None, help="the block classes, by name, comma-separated")
    parser.add_argument("--shard-group-size", type=int, default=None, help="hybrid sharding: ranks of one shard group")
    parser.add_argument("--optimizer-bytes", type=int, default=8, help="optimizer state bytes per parameter (Adam 8)")
    parser.add_argument("--margin", type=float, default=DEFAULT_MARGIN, help="share of the budget kept free")
    return parser


def _settings_lines(result: FitResult) -> list[str]:
    """The chosen settings that differ from ZeroConfig's defaults, by their text names, then the batch."""
    default, chosen = ZeroConfig(), result.config
    lines = []
    for setting in user_settings():
        if setting.name in ("wrap_policy", "offload_dir"):
            continue
        value = getattr(chosen, setting.name)
        if value != getattr(default, setting.name):
            lines.append(f"  {setting.text.name}: {setting.text.format(value)}")
    lines.append(f"  micro-batch size: {result.micro_batch_size}")
    lines.append(f"  gradient accumulation steps: {result.gradient_accumulation_steps}")
    if result.activation_checkpointing:
        blocks = result.checkpointed_blocks
        lines.append(f"  activation checkpointing: {len(blocks)} blocks ({blocks[0]} ... {blocks[-1]})")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        model = load_hf_config_model(args.hf_config) if args.hf_config else load_model(args.model)
        names = tuple(n.strip() for n in args.wrap_classes.split(",") if n.strip()) if args.wrap_classes else ()
        names = names or tuple(getattr(model, "_no_split_modules", None) or ())  # Hugging Face's own blocks
        ids = torch.zeros(1, args.sequence_length, dtype=torch.long)
        result = fit(
            model,
            {"input_ids": ids, "labels": ids} if args.hf_config else ids,
            world_size=args.world_size,
            budget=args.budget,
            global_batch_size=args.global_batch_size,
            wrap_policy=wrap_policy_of_names(names, model),
            shard_group_size=args.shard_group_size,
            precision=PRECISIONS[args.precision],
            optimizer_state_bytes_per_param=args.optimizer_bytes,
            device=args.device,
            offload_dir=args.offload_dir,
            margin=args.margin,
        )
    except (ValueError, ImportError, OSError) as error:
        parser.error(str(error))
    numel = sum(p.numel() for p in model.parameters())
    print(f"{numel:,} parameters, {args.world_size} ranks, {args.sequence_length} tokens per sample, {args.device}")
    print(result.summary())
    print("settings:")
    print("\n".join(_settings_lines(result)))
    if result.choice.predicted.disk:
        print(f"  offload_dir: {args.offload_dir} ({human_bytes(result.choice.predicted.disk)} per rank)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
