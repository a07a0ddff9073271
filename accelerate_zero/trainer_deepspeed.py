"""A ``TrainingArguments(deepspeed=...)`` config as ``ZeroTrainer`` reads it: its "auto"s filled in, and its
numbers checked against the arguments, by Hugging Face's own rules (``HfTrainerDeepSpeedConfig``'s
``trainer_config_process`` and ``trainer_config_finalize`` in ``transformers/integrations/deepspeed.py``), then
read as ZeRO settings by ``zero_core.deepspeed``.

The rules, as transformers has them: each key below that the config sets to "auto" takes the arguments' value;
one set to a number must equal it (else the run is refused, listing every mismatch), except the "fill only"
keys, whose numbers stand. A key the config leaves out stays out.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from zero_core.deepspeed import AUTO, read_deepspeed_config

if TYPE_CHECKING:  # transformers is imported by ZeroTrainer, which calls these
    from transformers import TrainingArguments


class _Fill(NamedTuple):
    key: str  # dotted DeepSpeed key
    argument: str  # the TrainingArguments value it takes, in transformers' mismatch wording
    value: Callable[[TrainingArguments], Any]
    must_match: bool = True


def _train_batch_size(args: TrainingArguments) -> int:
    return args.world_size * args.per_device_train_batch_size * args.gradient_accumulation_steps


# trainer_config_process: what the arguments decide. Batch sizes need not match with auto_find_batch_size.
_FROM_ARGUMENTS = (
    _Fill("train_micro_batch_size_per_gpu", "per_device_train_batch_size", lambda a: a.per_device_train_batch_size),
    _Fill("gradient_accumulation_steps", "gradient_accumulation_steps", lambda a: a.gradient_accumulation_steps),
    _Fill("train_batch_size", "train_batch_size (calculated)", _train_batch_size),
    _Fill("gradient_clipping", "max_grad_norm", lambda a: a.max_grad_norm),
    _Fill("optimizer.params.lr", "learning_rate", lambda a: a.learning_rate),
    _Fill("optimizer.params.betas", "adam_beta1+adam_beta2", lambda a: [a.adam_beta1, a.adam_beta2]),
    _Fill("optimizer.params.eps", "adam_epsilon", lambda a: a.adam_epsilon),
    _Fill("optimizer.params.weight_decay", "weight_decay", lambda a: a.weight_decay),
    _Fill("scheduler.params.warmup_min_lr", "", lambda a: 0, must_match=False),  # not a Trainer argument
    _Fill("scheduler.params.warmup_max_lr", "learning_rate", lambda a: a.learning_rate),
    _Fill("fp16.enabled", "fp16|fp16_full_eval", lambda a: a.fp16 or a.fp16_full_eval),
    _Fill("bf16.enabled", "bf16|bf16_full_eval", lambda a: a.bf16 or a.bf16_full_eval),
)
_BATCH_SIZES = ("train_micro_batch_size_per_gpu", "train_batch_size")
# trainer_config_finalize: the scheduler's step counts, once the run's length is known (the argument each matches).
_STEP_COUNTS = {"total_num_steps": "num_training_steps (calculated)", "warmup_num_steps": "warmup_steps"}
_HIDDEN_SIZE_KEYS = (
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
)


def _node(config: dict[str, Any], dotted: str) -> tuple[dict[str, Any] | None, str]:
    *parents, key = dotted.split(".")
    for parent in parents:
        config = config.get(parent)
        if not isinstance(config, dict):
            return None, key
    return config, key


def _fill(config: dict, dotted: str, value: Any, argument: str, must_match: bool, mismatches: list[str]) -> None:
    """transformers' ``fill_match``: "auto" takes the value; a number given must equal it."""
    node, key = _node(config, dotted)
    if node is None:
        return
    if node.get(key) == AUTO:
        node[key] = value
    elif must_match and node.get(key) is not None and node[key] != value:
        mismatches.append(f"- ds {dotted}={node[key]} vs hf {argument}={value}")


def _hidden_size(model: Any) -> int | None:
    """The model's hidden size, where transformers looks for it."""
    for config in (getattr(model, "config", None), getattr(getattr(model, "config", None), "text_config", None)):
        if hasattr(config, "hidden_size"):
            return config.hidden_size
        if hasattr(config, "hidden_sizes"):
            return max(config.hidden_sizes)
    return None


def _fill_hidden_size_keys(config: dict[str, Any], model: Any, where: str) -> None:
    autos = [key for key in _HIDDEN_SIZE_KEYS if _node(config, key)[0] is not None and _value(config, key) == AUTO]
    if not autos:
        return
    hidden = _hidden_size(model)
    if hidden is None:
        raise ValueError(
            f"{where} sets {', '.join(autos)} to 'auto', which transformers fills from the model's config "
            f"hidden_size, and this model's config has no hidden_size or hidden_sizes: give those keys numbers in "
            f"{where}."
        )
    unused: list[str] = []
    _fill(config, "zero_optimization.reduce_bucket_size", hidden * hidden, "", False, unused)
    if _value(config, "zero_optimization.stage") == 3:
        _fill(config, "zero_optimization.stage3_prefetch_bucket_size", int(0.9 * hidden * hidden), "", False, unused)
        _fill(config, "zero_optimization.stage3_param_persistence_threshold", 10 * hidden, "", False, unused)


def _value(config: dict[str, Any], dotted: str) -> Any:
    node, key = _node(config, dotted)
    return None if node is None else node.get(key)


def config_name(source: Any) -> str:
    """How a refusal names the config: the path the user gave, or what a dict was given to."""
    if isinstance(source, (str, os.PathLike)):
        return str(source)
    return "the DeepSpeed config (a dict)" if isinstance(source, Mapping) else "the DeepSpeed config"


def refuse_mismatches(mismatches: list[str], where: str = "the DeepSpeed config") -> None:
    """transformers' refusal (its lines, ``- ds KEY=value vs hf ARGUMENT=value``), naming the file."""
    if mismatches:
        raise ValueError(
            f"Please correct the following DeepSpeed config values in {where} that mismatch TrainingArguments "
            "values:\n"
            + "\n".join(mismatches)
            + f"\nThe easiest method is to set these DeepSpeed config values to 'auto' in {where} (each then takes "
            "the TrainingArguments value), or to change the arguments to the config's values."
        )


def _refuse_autos_left(config: dict[str, Any], where: str) -> None:
    """An optimizer or scheduler param still "auto" once the arguments filled theirs (only the scheduler's step
    counts wait for the run's length): nothing fills it, so it is refused now, naming it, rather than when the
    optimizer is built at the start of training (under DeepSpeed it fails there too)."""
    waiting = {"optimizer": (), "scheduler": tuple(_STEP_COUNTS)}
    left = [
        f"{section}.params.{name}"
        for section, later in waiting.items()
        for name, value in ((config.get(section) or {}).get("params") or {}).items()
        if value == AUTO and name not in later
    ]
    if left:
        filled = [fill.key for fill in _FROM_ARGUMENTS if fill.key.split(".")[0] in waiting]
        raise ValueError(
            f"{where} sets {', '.join(left)} to 'auto', which transformers fills only for "
            f"{', '.join(filled + [f'scheduler.params.{name}' for name in _STEP_COUNTS])}: write the value in "
            f"{where}."
        )


def resolve_for_trainer(
    source: dict[str, Any] | str, args: TrainingArguments, model: Any, where: str | None = None
) -> dict[str, Any]:
    """The config with every "auto" the arguments and the model decide filled in (the scheduler's step counts
    wait for ``scheduler_step_counts``), or the mismatches refused: before any work, as transformers refuses
    them when training starts. ``where`` names the config in the refusals (by default its path)."""
    where = where or config_name(source)
    config = copy.deepcopy(read_deepspeed_config(source))
    mismatches: list[str] = []
    for fill in _FROM_ARGUMENTS:
        must_match = fill.must_match and not (args.auto_find_batch_size and fill.key in _BATCH_SIZES)
        _fill(config, fill.key, fill.value(args), fill.argument, must_match, mismatches)
    _fill_hidden_size_keys(config, model, where)
    refuse_mismatches(mismatches, where)
    _refuse_autos_left(config, where)
    return config


def scheduler_step_counts(args: TrainingArguments, num_training_steps: int) -> dict[str, int]:
    """The scheduler's "auto" step counts once the run's length is known (``trainer_config_finalize``); the
    warmup is at least 1 step, as transformers keeps it for DeepSpeed >= 0.19.6."""
    warmup = max(1, args.get_warmup_steps(num_training_steps))
    return {"total_num_steps": num_training_steps, "warmup_num_steps": warmup}


def check_scheduler_step_counts(
    section: dict[str, Any] | None, counts: dict[str, int], where: str = "the DeepSpeed config"
) -> None:
    """A number the config gives for a step count must equal the run's, as transformers checks."""
    if section is None:
        return
    params = section.get("params") or {}
    refuse_mismatches(
        [
            f"- ds scheduler.params.{key}={params[key]} vs hf {_STEP_COUNTS[key]}={value}"
            for key, value in counts.items()
            if params.get(key) not in (None, AUTO) and params[key] != value
        ],
        where,
    )


def refuse_partitioned_model(model: Any) -> None:
    """A model DeepSpeed partitioned already (``from_pretrained`` after plain ``TrainingArguments(deepspeed=<a
    stage-3 config>)``, which makes transformers load through ``deepspeed.zero.Init``) holds empty parameters."""
    if model is not None and any(hasattr(p, "ds_id") for p in model.parameters()):
        raise ValueError(
            "The model's parameters were partitioned by DeepSpeed: transformers loads a model through "
            "deepspeed.zero.Init once TrainingArguments(deepspeed=<a stage-3 config>) exists. Build the arguments "
            "with accelerate_zero.ZeroTrainingArguments (the same arguments), or load the model before them."
        )


def auto_values(args: TrainingArguments, counts: dict[str, int] | None = None) -> dict[str, Any]:
    """What "auto" means in the optimizer and scheduler sections (``build_optimizer`` / ``build_scheduler``)."""
    return {
        "lr": args.learning_rate,
        "betas": [args.adam_beta1, args.adam_beta2],
        "eps": args.adam_epsilon,
        "weight_decay": args.weight_decay,
        "warmup_min_lr": 0,
        "warmup_max_lr": args.learning_rate,
        **(counts or {}),
    }
