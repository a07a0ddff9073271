"""The wild corpus' files written for Hugging Face's Trainer (TRL's and LLaMA-Factory's trainers, ms-swift's,
xtuner's "auto" files, open-instruct's Trainer config), each trained unedited by ``ZeroTrainer`` on a tiny GPT-2
through every route its source gives it: an Accelerate YAML through ``accelerate-zero launch --config_file``; a
DeepSpeed JSON through ``ZeroTrainingArguments(deepspeed=FILE)`` (the arguments route) and through
``accelerate-zero launch --zero_config_file FILE`` (``--deepspeed_config_file`` for one not named .json) with plain
``TrainingArguments`` (the launcher route). Beside
them, the same Trainer launched with the native flags (``--zero_stage N``, ``--offload_*_device``,
``--mixed_precision``) and, where the file has optimizer and scheduler sections, the same optimizer and schedule
passed as ``optimizers=``. Rank 0 writes OUT/<case>.json with every route's losses, learning rates and final
weights.

    ACCELERATE_USE_CPU=1 accelerate-zero launch <the first CASE's flags> --multi_gpu --num_processes 2 \\
        tests/scripts/wild_corpus_trainer.py OUT CASE [CASE ...]

The launcher reads the first CASE's flags; the others are read here as the launcher reads them
(``wild_corpus_launcher.py``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
from transformers import TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from accelerate_zero import ZeroTrainer, ZeroTrainingArguments  # noqa: E402
from tests.scripts.trainer_run import Tokens, model  # noqa: E402  (the Trainer tests' data and GPT-2)
from tests.scripts.wild_corpus_launcher import (  # noqa: E402
    WILD,
    attempt,
    fresh_state,
    launcher_variables,
    read_as_the_launcher,
)
from zero_core.deepspeed.schedulers import WarmupDecayLR  # noqa: E402

STEPS, LR, WARMUP, WEIGHT_DECAY = 4, 1e-2, 2, 0.1
OFFLOAD_BOTH = ["--offload_optimizer_device", "cpu", "--offload_param_device", "cpu"]
# Stage 3's hidden-size "auto"s as transformers fills them for this GPT-2 (width 32): stage3_param_persistence_threshold
# 10 x 32 elements, stage3_prefetch_bucket_size int(0.9 x 32 x 32) = 921 elements (fp32 bytes, in MiB here).
HIDDEN_SIZE_AUTOS = ["--zero_persistence_threshold", "320", "--zero_prefetch", "auto"]
HIDDEN_SIZE_AUTOS += ["--zero_prefetch_cap_mb", repr(921 * 4 / 2**20)]
# DeepSpeed's fp16 loss scaling as the files' fp16 sections give it (window 1000, hysteresis 2, minimum 1).
DEEPSPEED_LOSS_SCALING = ["--zero_loss_scale_window", "1000", "--zero_loss_scale_hysteresis", "2"]
DEEPSPEED_LOSS_SCALING += ["--zero_min_loss_scale", "1"]
# Per case: its file (an Accelerate YAML is launched with --config_file; a DeepSpeed config goes both to the
# arguments' deepspeed= and to the launcher), the native flags meaning the same, the TrainingArguments'
# precision (the files' fp16/bf16 "auto" follow it) and accumulation.
CASES = {
    # TRL's Accelerate YAMLs (deepspeed_multinode_launcher: standard), launched over TRL's trainers.
    "trl_deepspeed_zero1": dict(
        file="trl_deepspeed_zero1.yaml",
        # The file's gradient_accumulation_steps 1, and the Trainer's: under DeepSpeed, transformers refuses
        # TrainingArguments whose gradient_accumulation_steps differs from the plugin's number.
        native=["--zero_stage", "1", "--gradient_accumulation_steps", "1", "--mixed_precision", "bf16"],
        accumulate=1,
    ),
    "trl_deepspeed_zero3": dict(
        file="trl_deepspeed_zero3.yaml", native=["--zero_stage", "3", "--mixed_precision", "bf16"]
    ),
    "trl_tests_zero2": dict(file="trl_tests_zero2.yaml", native=["--zero_stage", "2"]),
    # DeepSpeed JSONs full of "auto", for TrainingArguments(deepspeed=...).
    "llamafactory_ds_z2_config": dict(  # fp16 "auto" on: fp16 runs on this CPU, with the section's loss scaling
        file="llamafactory_ds_z2_config.json", native=["--zero_stage", "2", *DEEPSPEED_LOSS_SCALING], fp16=True
    ),
    "llamafactory_ds_z3_offload_config": dict(
        file="llamafactory_ds_z3_offload_config.json", native=["--zero_stage", "3", *OFFLOAD_BOTH, *HIDDEN_SIZE_AUTOS]
    ),
    "llamafactory_ds_z3_fp8_config": dict(  # comms_config, monitor_config; fp16 false, bf16 "auto"
        file="llamafactory_ds_z3_fp8_config.json",
        native=["--zero_stage", "3", "--offload_optimizer_device", "cpu", "--zero_persistence_threshold", "35840"]
        + ["--zero_prefetch", "auto", "--zero_prefetch_cap_mb", repr(11560550 * 4 / 2**20)],  # its numbers
        bf16=True,
    ),
    "ms_swift_zero1": dict(file="ms_swift_zero1.json", native=["--zero_stage", "1"]),
    "ms_swift_zero3": dict(file="ms_swift_zero3.json", native=["--zero_stage", "3", *HIDDEN_SIZE_AUTOS], bf16=True),
    "xtuner_deepspeed_zero2_offload": dict(
        file="xtuner_deepspeed_zero2_offload.json", native=["--zero_stage", "2", "--offload_optimizer_device", "cpu"]
    ),
    # An AdamW section and a WarmupDecayLR section, every value "auto".
    "open_instruct_stage3_no_offloading": dict(
        file="open_instruct_stage3_no_offloading.conf", native=["--zero_stage", "3", *HIDDEN_SIZE_AUTOS], sections=True
    ),
}


def arguments(kind: type, output_dir: Path, case: dict, **deepspeed: object) -> TrainingArguments:
    return kind(
        output_dir=str(output_dir),
        use_cpu=True,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=case.get("accumulate", 2),
        max_steps=STEPS,
        learning_rate=LR,
        warmup_steps=WARMUP,
        max_grad_norm=0.5,
        weight_decay=WEIGHT_DECAY,
        bf16=case.get("bf16", False),
        fp16=case.get("fp16", False),
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        **deepspeed,
    )


def train(route: str, case: dict, out: Path) -> dict:
    """One ZeroTrainer run on the launcher's variables (set already) by ``route``: "file" (the YAML's launch, or
    the JSON through the launcher), "arguments" (ZeroTrainingArguments(deepspeed=FILE)), "native"."""
    fresh_state()
    data = {"model": model(), "train_dataset": Tokens(32, 1)}
    if route == "arguments":
        args = arguments(ZeroTrainingArguments, out / route, case, deepspeed=str(WILD / case["file"]))
    else:
        args = arguments(TrainingArguments, out / route, case)
    if route == "native" and case.get("sections"):  # the sections' AdamW and WarmupDecayLR, built by hand
        parameters = data["model"].parameters()  # one group: transformers hands DeepSpeed every parameter so
        optimizer = torch.optim.AdamW(parameters, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WEIGHT_DECAY)
        scheduler = WarmupDecayLR(optimizer, STEPS, warmup_min_lr=0, warmup_max_lr=LR, warmup_num_steps=WARMUP)
        data["optimizers"] = (optimizer, scheduler)
    run = ZeroTrainer(args=args, **data)
    run.train()
    history = run.state.log_history
    state = run.accelerator.get_state_dict(run.model)  # every process: gathers under stage 3
    plugin = run.accelerator.zero_plugin  # the settings it trained with
    return {
        "losses": [e["loss"] for e in history if "loss" in e],
        "lrs": [e["learning_rate"] for e in history if "learning_rate" in e],
        "weights": {name: tensor.float().flatten().tolist() for name, tensor in state.items()},
        "stage": run.zero_engine.stage,
        "offload": [plugin.offload_optimizer, plugin.offload_params],
        "settings": {f.name: getattr(plugin, f.name) for f in dataclasses.fields(plugin)},
        "mixed_precision": run.accelerator.mixed_precision,
        "optimizer": type(run.optimizer.optimizer if hasattr(run.optimizer, "optimizer") else run.optimizer).__name__,
        "scheduler": type(run.lr_scheduler).__name__,
    }


def main() -> None:
    out, cases = Path(sys.argv[1]), sys.argv[2:]
    torch.set_num_threads(1)
    launched = launcher_variables()
    for index, name in enumerate(cases):
        case, report = CASES[name], {}
        flag = {".yaml": "--config_file", ".json": "--zero_config_file"}.get(Path(case["file"]).suffix)
        flag = flag or "--deepspeed_config_file"  # Accelerate's flag for a DeepSpeed config of any name (.conf)
        routes = {"file": [flag, case["file"]], "native": case["native"]}
        if flag != "--config_file":
            routes["arguments"] = []  # a plain `accelerate-zero launch`: the arguments name the file

        def run(route: str, flags: list[str]) -> dict:
            variables = read_as_the_launcher(flags)
            if index == 0 and route == "file":
                report["reread_matches_launcher"] = variables == launched
            return train(route, case, out)

        for route, flags in routes.items():
            report[route] = attempt(lambda route=route, flags=flags: run(route, flags))
        if os.environ.get("RANK", "0") == "0":
            (out / f"{name}.json").write_text(json.dumps(report, default=str))


if __name__ == "__main__":
    main()
