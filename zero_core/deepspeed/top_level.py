"""The keys at the top of a DeepSpeed config (other than the sections with modules of their own): the loop
settings the framework owns, reporting DeepSpeed does itself, and DeepSpeed's features that change what is
trained, refused unless they are off.

Every top-level key DeepSpeed 0.19's ``DeepSpeedConfig`` reads has a row here or in a section's module
(``tests/adapters/deepspeed/test_deepspeed_keys.py`` holds the list to the installed DeepSpeed).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..settings import is_count
from .common import AUTO, DeepSpeedSettings, Treatment, _number, _refusal, apply_row, disabled, equals, rows_of

RESOLVED, MAPPED = Treatment.RESOLVED, Treatment.MAPPED
WITHOUT_EFFECT, REFUSED = Treatment.WITHOUT_EFFECT, Treatment.REFUSED
_REPORTING = "reporting: the framework's logger, profiler and progress bar report here"
_MONITOR = (
    "DeepSpeed's monitor: not written here; log with the framework's logger (Trainer(logger=...), "
    "Accelerator(log_with=...), TrainingArguments(report_to=...))"
)
_OFF = (disabled, 'accepted when off ("enabled": false)')
_NO_AUTO_TP = (lambda v: isinstance(v, Mapping) and v.get("autotp_size", 1) in (0, 1), "accepted without autotp_size")


# The loop keys: the framework owns the loop, so its value decides. A number in the config becomes the
# framework's (or must agree with it, the adapter says which); "auto" takes the framework's.
_LOOP = (
    ("train_micro_batch_size_per_gpu", RESOLVED, "the DataLoader's batch size (a number is only reported)"),
    (
        "gradient_accumulation_steps",
        RESOLVED,
        "the framework's accumulation (Trainer accumulate_grad_batches, Accelerator gradient_accumulation_steps, "
        "TrainingArguments gradient_accumulation_steps): a number becomes it or must agree with it",
    ),
    (
        "gradient_clipping",
        RESOLVED,
        "the framework's clipping by norm (Trainer gradient_clip_val, TrainingArguments max_grad_norm): a number "
        "becomes it or must agree with it; absent, the framework's, as Lightning's DeepSpeed strategy fills it in "
        '(DeepSpeed 0.19\'s engine alone clips at 1.0); with a "Muon" optimizer a number is refused, and so is '
        "the clipping a framework would fill in: DeepSpeed clips Muon's orthogonalised update, the frameworks clip "
        "the gradient",
    ),
    (
        "train_batch_size",
        RESOLVED,
        "micro-batch x accumulation x data-parallel ranks, as DeepSpeed derives it: a config without "
        "gradient_accumulation_steps sets the framework's accumulation to train_batch_size / (micro-batch x ranks) "
        "where the framework lets it (Trainer, Accelerate); numbers that disagree, with each other or with the "
        "DataLoader's batch size, are refused naming them",
    ),
)
LOOP_ROWS = rows_of("", _LOOP)
_LOOP_KEYS = ("gradient_clipping", "gradient_accumulation_steps", "train_micro_batch_size_per_gpu", "train_batch_size")

# activation_checkpointing's own keys have rows below; its reader maps two of them.
_SECTIONS = rows_of("", (("activation_checkpointing", MAPPED, "its keys below"),))
_ACTIVATION = rows_of(
    "activation_checkpointing.",
    (
        ("partition_activations", MAPPED, "partition_activations (tensor parallelism)"),
        ("cpu_checkpointing", MAPPED, "offload_activations"),
        ("contiguous_memory_optimization", WITHOUT_EFFECT, "checkpoints are torch's"),
        ("number_checkpoints", WITHOUT_EFFECT, "checkpoints are torch's"),
        ("synchronize_checkpoint_boundary", WITHOUT_EFFECT, "checkpoints are torch's"),
        ("profile", WITHOUT_EFFECT, _REPORTING),
    ),
)


def _grad_accum_fp32(value: Any) -> bool:
    """``data_types`` that asks for what we do: gradients accumulated in fp32."""
    if not isinstance(value, Mapping) or not set(value) <= {"grad_accum_dtype"}:
        return False
    return value.get("grad_accum_dtype") in (None, "fp32")


_OTHERS = (
    ("steps_per_print", WITHOUT_EFFECT, _REPORTING),
    ("wall_clock_breakdown", WITHOUT_EFFECT, _REPORTING),
    ("memory_breakdown", WITHOUT_EFFECT, _REPORTING),
    ("timers", WITHOUT_EFFECT, _REPORTING),
    ("comms_logger", WITHOUT_EFFECT, _REPORTING),
    ("flops_profiler", WITHOUT_EFFECT, _REPORTING),
    ("tensorboard", WITHOUT_EFFECT, _MONITOR),
    ("wandb", WITHOUT_EFFECT, _MONITOR),
    ("csv_monitor", WITHOUT_EFFECT, _MONITOR),
    ("comet", WITHOUT_EFFECT, _MONITOR),
    # Not keys DeepSpeed reads: the names of its config objects, written into configs (LLaMA-Factory's) by dumping
    # one. DeepSpeed ignores them; so does this, saying so.
    ("comms_config", WITHOUT_EFFECT, "DeepSpeed 0.19 reads no such key either (its comms logger is comms_logger)"),
    (
        "monitor_config",
        WITHOUT_EFFECT,
        "DeepSpeed 0.19 reads no such key either (its monitors are tensorboard, wandb, csv_monitor and comet); "
        + "nothing is written",
    ),
    ("dump_state", WITHOUT_EFFECT, _REPORTING),
    ("log_level", WITHOUT_EFFECT, _REPORTING),
    ("prescale_gradients", WITHOUT_EFFECT, "gradients are averaged in fp32; dividing first changes only rounding"),
    (
        "gradient_predivide_factor",
        WITHOUT_EFFECT,
        "gradients are averaged in fp32; dividing first changes only rounding",
    ),
    ("zero_allow_untested_optimizer", WITHOUT_EFFECT, "any torch optimizer whose state is per element works"),
    ("zero_force_ds_cpu_optimizer", WITHOUT_EFFECT, "an offloaded step runs the torch optimizer on the host"),
    ("disable_allgather", WITHOUT_EFFECT, "parameters are always all-gathered (a broadcast moves the same)"),
    ("disable_python_gc", WITHOUT_EFFECT, "Python's collector runs as usual"),
    ("dataloader_drop_last", WITHOUT_EFFECT, "the script's DataLoader decides (DeepSpeed applies it only to its own)"),
    ("vocabulary_size", WITHOUT_EFFECT, "no vocabulary padding here: the model's own sizes"),
    ("aio", WITHOUT_EFFECT, "NVMe reads and writes are staged unit by unit, offload_units_in_memory at a time"),
    ("checkpoint", WITHOUT_EFFECT, "checkpoints are always ours: sharded, loadable at any world size and stage"),
    ("nebula", WITHOUT_EFFECT, "checkpoints are always ours: sharded, loadable at any world size and stage"),
    ("datastates_ckpt", WITHOUT_EFFECT, "checkpoints are always ours: sharded, loadable at any world size and stage"),
    ("compile", WITHOUT_EFFECT, "compile the model with torch.compile (the engine's hooks stay outside the graph)"),
    ("graph_harvesting", WITHOUT_EFFECT, "CUDA graphs are not captured here"),
    ("autotuning", WITHOUT_EFFECT, "only DeepSpeed's launcher autotunes"),
    ("pipeline", WITHOUT_EFFECT, "no pipeline parallelism (PipelineModule) here; an ordinary module ignores it"),
    ("use_data_before_expert_parallelism", WITHOUT_EFFECT, "no expert parallelism here"),
    ("seq_parallel_communication_data_type", WITHOUT_EFFECT, "no sequence parallelism here"),
    ("communication_data_type", REFUSED, "gradients are reduced in fp32 here", (equals("fp32"), 'accepted as "fp32"')),
    ("gradient_allreduce_op", REFUSED, "gradients are averaged here", (equals("mean"), 'accepted as "mean"')),
    ("data_types", REFUSED, "gradients accumulate in fp32 here", (_grad_accum_fp32, "accepted as fp32")),
    ("amp", REFUSED, "use the framework's precision flag (16-mixed, bf16-mixed)", _OFF),
    ("torch_autocast", REFUSED, "use the framework's precision flag (bf16-mixed, 16-mixed)", _OFF),
    ("sparse_gradients", REFUSED, "gradients are dense here", (equals(False), "accepted as false")),
    ("elasticity", REFUSED, "elastic batch sizes are DeepSpeed's: set the batch in the DataLoader", _OFF),
    ("compression_training", REFUSED, "compression changes the model: not offered", _OFF),
    ("quantize_training", REFUSED, "quantization changes the numbers: not offered", _OFF),
    ("weight_quantization", REFUSED, "quantization changes the numbers: not offered", _OFF),
    ("sparse_attention", REFUSED, "use the model's own attention", _OFF),
    ("progressive_layer_drop", REFUSED, "layer dropping changes the training: not offered", _OFF),
    ("curriculum_learning", REFUSED, "curricula are the DataLoader's here", _OFF),
    ("data_efficiency", REFUSED, "data sampling is the DataLoader's here", _OFF),
    ("eigenvalue", REFUSED, "not offered", _OFF),
    ("hybrid_engine", REFUSED, "DeepSpeed-Chat's inference engine is not offered", _OFF),
    (
        "managed_gradient_accumulation",
        REFUSED,
        "the framework's accumulation decides",
        (equals(False), "accepted as false"),
    ),
    ("tensor_parallel", REFUSED, "set tensor_parallel_size; split the model with parallelize_module", _NO_AUTO_TP),
    ("expert_parallel", REFUSED, "no expert parallelism here", _OFF),
)
OTHER_ROWS = rows_of("", _OTHERS)
ROWS = (*LOOP_ROWS.values(), *_SECTIONS.values(), *_ACTIVATION.values(), *OTHER_ROWS.values())


def read_top_level(key: str, value: Any, result: DeepSpeedSettings, refused: list[str]) -> bool:
    """Treat one top-level key; False when this module has no row for it."""
    if key in LOOP_ROWS:
        if key in _LOOP_KEYS and value != AUTO:
            _loop_value(key, value, result, refused)
    elif key == "activation_checkpointing":
        _activation_checkpointing(value, result, refused)
    elif key in OTHER_ROWS:
        apply_row(OTHER_ROWS[key], key, value, result, refused)
    else:
        return False
    return True


def _loop_value(key: str, value: Any, result: DeepSpeedSettings, refused: list[str]) -> None:
    """The loop keys, checked here so every adapter gets a clean value: a count >= 1 or a clip >= 0."""
    if key == "gradient_clipping":
        _number(key, value, lambda n: result.loop.__setitem__(key, float(n)), refused)
    elif not is_count(value, 1):
        refused.append(f'{key}={value!r} (an integer >= 1, or "auto")')
    else:
        result.loop[key] = value


def _activation_checkpointing(section: Any, result: DeepSpeedSettings, refused: list[str]) -> None:
    if not isinstance(section, Mapping):
        refused.append(f"activation_checkpointing={section!r} (a JSON object)")
        return
    for key, value in section.items():
        name = f"activation_checkpointing.{key}"
        if key not in _ACTIVATION:
            refused.append(_refusal(name, value, _ACTIVATION))
        elif key in ("partition_activations", "cpu_checkpointing"):
            if not isinstance(value, bool):
                refused.append(f"{name}={value!r} (true or false)")
            elif value:
                result.settings[
                    "partition_activations" if key == "partition_activations" else "offload_activations"
                ] = True
        else:
            apply_row(_ACTIVATION[key], name, value, result, refused)
