"""Model-state memory per rank before launch, for DDP and ZeRO stages 1-3.

    zero-estimate --params 7e9 --world-size 8 [--precision bf16] [--budget 80GiB]
    zero-estimate --model my_pkg.models:build_model --world-size 8 --offload-optimizer cpu

``--model module:factory`` calls ``factory()`` under ``torch.device("meta")``: parameters are
counted (frozen and shared ones as the engine holds them) without allocating them. The flags of the
settings shared with the engine are generated from ZeroConfig's schema (``zero_core.user_settings()``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .config import MixedPrecision, ZeroConfig
from .memory.estimate import (
    STAGES,
    WHOLE_TENSOR_OPTIMIZERS,
    ZeroEstimate,
    estimate,
    largest_fitting_model,
    shared_config,
    shared_settings,
)
from .settings import BYTE_UNITS, Setting, parse_quantity
from .sizes import human_bytes

PRECISIONS = {
    "fp32": MixedPrecision(),
    "bf16": MixedPrecision(compute_dtype=torch.bfloat16),
    "fp16": MixedPrecision(compute_dtype=torch.float16),
}
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def _quantity(text: str, units: dict[str, int], example: str) -> int:
    try:
        return parse_quantity(text, units, example)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def bytes_argument(text: str) -> int:
    """``80GiB``, ``80GB``, ``8.5e10`` (bytes), as argparse takes a type (settings.parse_bytes, its error)."""
    return _quantity(text, BYTE_UNITS, "80GiB, 40GB or 8e10")


def parse_count(text: str) -> int:
    """``7e9``, ``7B``, ``350M``, ``125000``."""
    return _quantity(text, _COUNT_UNITS, "7e9, 7B or 350M")


def load_model(spec: str) -> nn.Module:
    """``module:factory`` -> ``factory()`` built on the meta device."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"--model {spec!r}: use module:factory, e.g. my_pkg.models:build_model")
    if os.getcwd() not in sys.path:  # a console script does not look in the current directory
        sys.path.insert(0, os.getcwd())
    factory = getattr(importlib.import_module(module_name), attribute, None)
    if not callable(factory):
        raise ValueError(f"--model {spec!r}: {module_name} has no callable {attribute!r}")
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model {spec!r}: {attribute}() returned a {type(model).__name__}, not an nn.Module")
    return model


def format_table(result: ZeroEstimate, budget: int | None) -> str:
    settings = result.settings
    config, plan = settings.config, settings.config.offload
    precision = config.mixed_precision
    offload = plan.optimizer.offloads or plan.params.offloads
    dtypes = {v.compute_dtype: k for k, v in PRECISIONS.items()}
    lines = [
        f"{result.numel:,} parameters ({result.trainable_numel:,} trainable) in {result.units} unit(s); "
        f"{settings.world_size} ranks, shards over {settings.shard_size}",
        f"compute {dtypes[precision.compute_dtype]}, reduce {dtypes[precision.reduce_dtype]}; "
        f"optimizer state {settings.optimizer_state_bytes_per_param} bytes/parameter; "
        f"offload_optimizer={config.offload_optimizer!r}"
        + (f", offload_fraction={config.offload_fraction:g}" if plan.optimizer.offloads else "")
        + (f", offload_params={config.offload_params!r} (stage 3)" if plan.params.offloads else ""),
        "model-state bytes per rank (optimizer: with the fp32 master where it is a separate copy):",
    ]
    header = ["", "params", "grads", "optimizer", "device"] + (["host", "nvme"] if offload else [])
    if budget is not None:
        header.append(f"largest in {human_bytes(budget)}")
    rows = [header]
    for stage in STAGES:
        report = result[stage]
        row = ["DDP" if stage == 0 else f"stage {stage}"]
        row += [human_bytes(b) for b in (report.parameter_bytes, report.gradient_bytes, report.optimizer_state_bytes)]
        row.append(human_bytes(report.device_bytes))
        if offload:
            row += [human_bytes(report.host_bytes), human_bytes(report.nvme_bytes)]
        if budget is not None:
            row.append(f"{largest_fitting_model(budget, stage, settings):,} params")
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines += [
        "  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))) for row in rows
    ]
    if offload:
        lines.append(
            "DDP: no offload. host: offloaded master, optimizer state and gradient copies, and (stage 3, "
            "offload_params='cpu') the parameter shards; nvme: files (optimizer state, parameter shards)."
        )
    if config.secondary_shard_group_size is not None:
        lines.append(
            f"stage 3 with secondary_shard_group_size={config.secondary_shard_group_size}: "
            f"{human_bytes(result.secondary_piece_bytes)} more on the device from each unit's forward to its "
            "backward (hpZ's pieces; gone by the peak after a backward that the table shows)."
        )
    lines += _quantization_lines(result, config)
    if result.checkpoint_staging_bytes:
        lines.append(
            f"stages 1-3 with asynchronous_checkpoints: {human_bytes(result.checkpoint_staging_bytes)} more of host "
            "memory per rank from the first asynchronous save on (its copy of the rank's shards, refilled by "
            "each later save)."
        )
    if result.whole_tensor_sent_bytes or result.whole_tensor_working_bytes:
        lines.append(
            f"stages 1-3, a whole-tensor optimizer: each step a rank sends up to "
            f"{human_bytes(result.whole_tensor_sent_bytes)} to the tensors' owners and back (the traffic report's "
            f"'send'), and an owner builds up to {human_bytes(result.whole_tensor_working_bytes)} of whole tensors "
            "at once during the step."
        )
    return "\n".join(lines)


def _quantization_lines(result: ZeroEstimate, config: ZeroConfig) -> list[str]:
    """ZeRO++'s quantized collectives: the working memory of the largest unit's, beside the table."""
    lines = []
    if config.quantize_weights:
        lines.append(
            f"stage 3 with quantize_weights: up to {human_bytes(result.quantized_gather_bytes)} more on the device "
            "while a unit's quantized all-gather runs (its packed int8 buffers and a float32 pass)."
        )
    if config.quantize_gradients:
        lines.append(
            f"stages 2/3 with quantize_gradients: up to {human_bytes(result.quantized_reduce_bytes)} more on the "
            f"device while a unit's quantized reduce runs (its packed int{config.gradient_quantization_bits} "
            "buffers, a float32 sum and pass)."
        )
    return lines


def _dest(setting: Setting) -> str:
    return setting.text.name


def _flag(setting: Setting) -> str:
    """``--offload-optimizer``: the setting's text name, dashed as the command's other flags."""
    return "--" + setting.text.name.replace("_", "-")


def _parser_of(setting: Setting) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return setting.text.parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is invalid: use {setting.values}") from None

    parse.__name__ = setting.text.name  # what argparse names in its own refusals
    return parse


def _help(setting: Setting) -> str:
    default = setting.text.format(setting.text.default) or "none"
    return f"{setting.doc} (default: {default})".replace("%", "%%")  # argparse formats help with %


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zero-estimate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--params", type=parse_count, help="a parameter count: 7e9, 7B, 350M")
    source.add_argument("--model", help="module:factory, a callable returning the model (built on meta)")
    parser.add_argument("--world-size", type=int, required=True, help="ranks (processes) in all")
    parser.add_argument("--precision", choices=sorted(PRECISIONS), default="fp32", help="compute dtype (reduce: fp32)")
    parser.add_argument(
        "--optimizer-bytes", type=int, default=8, help="optimizer state bytes per parameter: Adam 8, SGD momentum 4"
    )
    parser.add_argument(
        "--whole-tensor-optimizer",
        choices=sorted(WHOLE_TENSOR_OPTIMIZERS),
        default=None,
        help="with --model: torch's Muon over the trainable matrices or Adafactor over every trainable tensor, "
        "each stepped whole at an owner rank: the bytes that step sends and builds (set --optimizer-bytes too: "
        "Muon 4)",
    )
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: host and device are one memory (an offloaded unit's master and gradient shard stay in place)",
    )
    parser.add_argument("--budget", type=bytes_argument, default=None, help="device bytes per rank: 80GiB, 40GB, 8e10")
    group = parser.add_argument_group(
        "settings shared with the engine",
        "ZeroConfig's settings (docs/configuration.md), as Accelerate spells them: --wrap-classes names\n"
        "the model's block classes (with --model); --offload-params applies to stage 3's row.",
    )
    for setting in shared_settings():
        group.add_argument(
            _flag(setting),
            dest=_dest(setting),
            metavar=setting.text.name.upper(),
            type=_parser_of(setting),
            default=None,
            help=_help(setting),
        )
    return parser


def _shared_values(args: argparse.Namespace, model: nn.Module | int) -> dict[str, Any]:
    """The shared settings given, as ZeroConfig holds them (class names looked up in the model)."""
    given = {s: getattr(args, _dest(s)) for s in shared_settings() if getattr(args, _dest(s)) is not None}
    module = model if isinstance(model, nn.Module) else None
    if any(s.name == "wrap_policy" for s in given) and module is None:
        raise ValueError("--wrap-classes needs --model (a parameter count is one unit)")
    return {setting.name: setting.text.resolve(value, module) for setting, value in given.items()}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        model = load_model(args.model) if args.model else args.params
        config = shared_config(PRECISIONS[args.precision], **_shared_values(args, model))
        result = estimate(
            model,
            args.world_size,
            config,
            optimizer_state_bytes_per_param=args.optimizer_bytes,
            host_is_device=args.device == "cpu",
            whole_tensor_optimizer=args.whole_tensor_optimizer,
        )
    except (ValueError, ImportError) as error:
        parser.error(str(error))
    print(format_table(result, args.budget))
    return 0


if __name__ == "__main__":
    sys.exit(main())
