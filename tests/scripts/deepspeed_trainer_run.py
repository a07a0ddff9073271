"""``TrainingArguments(deepspeed=<transformers' stock ds_config_zero3.json>)`` with ``ZeroTrainer``, against the
native ZeroTrainer run of the same settings; rank 0 writes OUT/CASE.json (the losses and the final weights).

    ACCELERATE_USE_CPU=1 accelerate-zero launch --multi_gpu --num_processes 2 \\
        tests/scripts/deepspeed_trainer_run.py OUT [--without-deepspeed] CASE [CASE ...]

``--without-deepspeed`` makes ``import deepspeed`` fail in this process before transformers is imported, as
on a machine without DeepSpeed. Cases: ``native`` (ZeroPlugin and the optimizer and scheduler written out),
``config`` (``ZeroTrainingArguments(deepspeed=FILE)``), ``plain`` (``TrainingArguments(deepspeed=FILE)``, which
needs DeepSpeed importable), ``plugin`` (``zero_plugin=ZeroPlugin.from_deepspeed(FILE)``, the arguments without
deepspeed=), ``launched`` (the arguments without deepspeed=, no plugin: the DeepSpeed config the launcher was
given); each of FILE ds_config_zero3.json, or another of transformers' stock files as ``CASE:STEM``
(``config:transformers_ds_config_zero2``, written to OUT/CASE-STEM.json). ``from_pretrained:STEM=DIR``: loads
the model saved in DIR after plain ``TrainingArguments(deepspeed=STEM)`` and records what happened, per rank.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

if "--without-deepspeed" in sys.argv:
    sys.argv.remove("--without-deepspeed")
    sys.modules["deepspeed"] = None  # `import deepspeed` raises ImportError, as where it is not installed

import torch  # noqa: E402
from accelerate import PartialState  # noqa: E402
from transformers import TrainingArguments  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from accelerate_zero import ZeroPlugin, ZeroTrainer, ZeroTrainingArguments  # noqa: E402
from tests.scripts.trainer_run import Tokens, model  # noqa: E402  (the Trainer tests' data and GPT-2)
from zero_core.deepspeed import optimizer_sections  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "deepspeed_configs"
CONFIG = CONFIGS / "transformers_ds_config_zero3.json"
STEPS, ACCUMULATE, LR = 5, 2, 1e-2
# Each stock file's zero_optimization section, written our way (their fp16/bf16 "auto": off, as these arguments).
NATIVE = {
    "transformers_ds_config_zero3": dict(stage=3, offload_optimizer="cpu", offload_params="cpu"),
    "transformers_ds_config_zero3_bf16": dict(stage=3, offload_optimizer="cpu", offload_params="cpu"),
    "transformers_ds_config_zero2": dict(stage=2, offload_optimizer="cpu"),
}


def arguments(kind: type, output_dir: Path, **deepspeed: object) -> TrainingArguments:
    return kind(
        output_dir=str(output_dir),
        use_cpu=True,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=ACCUMULATE,
        max_steps=STEPS,
        learning_rate=LR,
        max_grad_norm=0.5,
        weight_decay=0.1,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        **deepspeed,
    )


def warmup_lr(step: int) -> float:
    """DeepSpeed's WarmupLR as transformers fills it (min 0, max the learning rate, warmup_num_steps 1, which
    WarmupLR raises to 2), as a factor of the learning rate for LambdaLR. WarmupLR is built at iteration -1 (the
    first step runs at its minimum) and counts its iterations from there, by a log curve."""
    iteration, warmup = step - 1, 2
    if iteration < 0:
        return 0.0
    return math.log(iteration + 1) / math.log(warmup) if iteration < warmup else 1.0


def stock_config(file: Path = CONFIG) -> str | dict:
    """The stock file; without its optimizer and scheduler sections while zero_core cannot build them yet (then
    both runs use Trainer's own AdamW and linear schedule)."""
    if hasattr(optimizer_sections, "build_optimizer"):
        return str(file)
    config = json.loads(file.read_text())
    del config["optimizer"], config["scheduler"]
    return config


def trainer(case: str, out: Path, file: Path = CONFIG) -> ZeroTrainer:
    data = {"model": model(), "train_dataset": Tokens(32, 1)}
    if case == "native":  # the stock config's settings, written our way
        plugin = ZeroPlugin(**NATIVE[file.stem])
        args = arguments(TrainingArguments, out / case)
        if isinstance(stock_config(), dict):
            return ZeroTrainer(args=args, zero_plugin=plugin, **data)
        parameters = data["model"].parameters()  # one group: transformers hands DeepSpeed every parameter so
        optimizer = torch.optim.AdamW(parameters, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_lr)
        return ZeroTrainer(args=args, zero_plugin=plugin, optimizers=(optimizer, scheduler), **data)
    if case == "plugin":  # the file through the plugin, the arguments without deepspeed=
        plugin = ZeroPlugin.from_deepspeed(str(file))
        return ZeroTrainer(args=arguments(TrainingArguments, out / case), zero_plugin=plugin, **data)
    if case == "launched":  # the launcher's file (--zero_config_file, --deepspeed_config_file or a YAML's)
        return ZeroTrainer(args=arguments(TrainingArguments, out / case), **data)
    kind = ZeroTrainingArguments if case == "config" else TrainingArguments
    return ZeroTrainer(args=arguments(kind, out / case, deepspeed=stock_config(file)), **data)


def from_pretrained_after_plain_arguments(out: Path, file: Path, saved_model: str) -> None:
    """``from_pretrained`` after plain ``TrainingArguments(deepspeed=FILE)``, as Hugging Face scripts order them;
    every rank writes OUT/from_pretrained-RANK.json: what it raised (None: the model loaded, and was not
    partitioned by DeepSpeed). Run first in its process: anything that imported DeepSpeed before hides it."""
    from transformers import GPT2LMHeadModel
    from transformers.integrations import unset_hf_deepspeed_config

    args = arguments(TrainingArguments, out / "from_pretrained", deepspeed=str(file))
    try:
        loaded = GPT2LMHeadModel.from_pretrained(saved_model)
        outcome = {"error": None, "partitioned": any(hasattr(p, "ds_id") for p in loaded.parameters())}
    except Exception as error:  # noqa: BLE001 - whatever it is, the test reads it
        outcome = {"error": type(error).__name__, "message": str(error)}
    del args
    unset_hf_deepspeed_config()  # the later cases in this process start without transformers' DeepSpeed state
    rank = PartialState().process_index
    (out / f"from_pretrained-{rank}.json").write_text(json.dumps(outcome))


def main() -> None:
    out, cases = Path(sys.argv[1]), sys.argv[2:]
    torch.set_num_threads(1)
    for written in cases:
        case, _, stem = written.partition(":")
        file = CONFIGS / f"{stem}.json" if stem else CONFIG
        if case == "from_pretrained":  # from_pretrained:STEM=SAVED_MODEL_DIR
            stem, _, saved_model = stem.partition("=")
            from_pretrained_after_plain_arguments(out, CONFIGS / f"{stem}.json", saved_model)
            continue
        run = trainer(case, out, file)
        run.train()
        losses = [e["loss"] for e in run.state.log_history if "loss" in e]
        state = run.accelerator.get_state_dict(run.model)  # every process: gathers under stage 3
        weights = {name: tensor.float().flatten().tolist() for name, tensor in state.items()}
        report = {"losses": losses, "weights": weights, "arguments": type(run.args).__name__}
        report["settings"] = {"stage": run.zero_engine.stage, "offload": run.zero_plugin.offload_params}
        if PartialState().is_main_process:
            (out / f"{written.replace(':', '-')}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
