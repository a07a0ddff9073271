"""Hugging Face Trainer runs on a tiny GPT-2 built from a config; rank 0 writes OUT/NAME.json per case.

Plain ``Trainer`` (DDP) unless ACCELERATE_USE_ZERO is set, as it is by ``accelerate-zero launch``: then
``ZeroTrainer``, with the launcher's settings except for a case named ``zeroN``: ``ZeroPlugin(stage=N)``.
A case named with bf16 or fp16 trains in that precision (``TrainingArguments``). Each case trains 6 steps
(a checkpoint at step 3), evaluates, predicts, saves the model (``save_model`` and ``model.save_pretrained``
on every process), then a second trainer resumes from the step-3 checkpoint (``zero_async``: the optimizer
saved in the background, at most one checkpoint kept; see ``async_case``; ``zero_async_fallback``: only trains,
its saves written synchronously for want of host memory, see ``fallback_case``). A case named with nan (say
``zero2_fp16_nan``) only trains, with rank 0's loss NaN in step NAN_STEP + 1 (``NaNOnRank0``), and records
per step whether the step was skipped and the loss scale after it. ``--resume DIR`` runs only a
resume from DIR; ``--refused DIR`` then tries to resume from plain Trainer's checkpoint DIR and records the
error.

    ACCELERATE_USE_CPU=1 accelerate[-zero] launch --multi_gpu --num_processes 2 \\
        tests/scripts/trainer_run.py OUT CASE [CASE ...] [--batch-size 2] [--resume DIR] [--refused DIR]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import warnings
from pathlib import Path

import torch
from accelerate import PartialState
from accelerate.utils import AutocastKwargs
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from accelerate_zero import ZeroPlugin, ZeroTrainer  # noqa: E402
from accelerate_zero.plugin import zero_requested  # noqa: E402
from accelerate_zero.trainer import OPTIMIZER_DIR, OPTIMIZER_UNFINISHED  # noqa: E402
from zero_core import CheckpointError  # noqa: E402
from zero_core.checkpoint import save_and_load  # noqa: E402

STEPS, SAVE_AT, ACCUMULATE = 6, 3, 2
NAN_STEP = 2  # the nan cases: rank 0's loss is NaN in the third optimizer step (global_step 2 while it runs)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, count: int, seed: int) -> None:
        self.ids = torch.randint(0, 64, (count, 16), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    return GPT2LMHeadModel(config)


class NaNOnRank0:
    """Mixed into Trainer and ZeroTrainer for the nan cases: rank 0's training loss is NaN in both micro-batches
    of step NAN_STEP + 1 (evaluation's is left alone), so the gradients reduced over the ranks are NaN."""

    def compute_loss(self, model: torch.nn.Module, inputs: dict, *args: object, **kwargs: object) -> torch.Tensor:
        result = super().compute_loss(model, inputs, *args, **kwargs)
        if model.training and self.state.global_step == NAN_STEP and self.accelerator.process_index == 0:
            result = result * float("nan")
        return result


class NaNTrainer(NaNOnRank0, Trainer):
    """Trainer under DDP with the fp16 loss scaling it has on a GPU: Accelerate makes no GradScaler on a CPU, so
    one is given (torch's, on the CPU, with its defaults: those of the engine's loss scaler), and ``native_amp``
    so that ``clip_grad_norm_`` unscales before clipping, as on a GPU; autocast stays off (fp32 compute)."""

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        self.accelerator.scaler = torch.amp.GradScaler("cpu")
        self.accelerator.native_amp = True
        self.accelerator.autocast_handler = AutocastKwargs(enabled=False)


class NaNZeroTrainer(NaNOnRank0, ZeroTrainer):
    """ZeroTrainer with rank 0's loss NaN in step NAN_STEP + 1: the engine's fp16 loss scaler skips it."""


class StepRecord(TrainerCallback):
    """Per optimizer step, after Trainer's ``model.zero_grad()``: whether the step was skipped (what Trainer
    reads to skip its scheduler's step) and the loss scale."""

    def __init__(self, run: Trainer) -> None:
        self.run, self.skipped, self.loss_scales = run, [], []

    def on_step_end(self, args: TrainingArguments, state: object, control: object, **kwargs: object) -> None:
        accelerator = self.run.accelerator
        engine = getattr(accelerator, "engine", None)
        self.skipped.append(accelerator.optimizer_step_was_skipped)
        self.loss_scales.append(engine.loss_scale if engine is not None else accelerator.scaler.get_scale())


def trainer(case: str, output_dir: Path, batch_size: int) -> Trainer:
    nan, zero = "nan" in case, zero_requested()
    # Trainer's default fused AdamW skips an overflowed step inside its kernel, and Accelerate then reports the
    # step as taken (huggingface/accelerate#4242): the DDP reference's AdamW is the unfused one.
    reference_optimizer = {"optim": "adamw_torch"} if nan and not zero else {}
    if "adafactor" in case:  # Trainer's optim= name: transformers' Adafactor, each tensor stepped whole under ZeRO
        reference_optimizer = {"optim": "adafactor"}
    arguments = TrainingArguments(
        output_dir=str(output_dir),
        use_cpu=True,
        per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=ACCUMULATE,
        max_steps=STEPS,
        learning_rate=1e-2,
        # Muon's and Adafactor's cases unclipped, so they compare bit for bit: a rounding of the norm, amplified
        # by Muon's bf16 Newton-Schulz, would move the update by ~1e-3 under DDP itself
        # (tests/distributed/parity/test_matrix_optimizers.py).
        max_grad_norm=0.0 if "muon" in case or "adafactor" in case else 0.5,
        logging_steps=1,
        save_strategy="no" if nan else "steps",
        save_steps=SAVE_AT,
        save_total_limit=1 if "async" in case else None,  # the rotation waits for the background write
        report_to="none",
        disable_tqdm=True,
        seed=0,
        bf16="bf16" in case,  # Trainer's own mixed-precision flag
        fp16="fp16" in case,
        **reference_optimizer,
    )
    kwargs = {"model": model(), "args": arguments, "train_dataset": Tokens(48, 1), "eval_dataset": Tokens(8, 2)}
    if "muon" in case:  # Trainer's optimizers=: torch's Muon over the matrices, Trainer's own schedule
        matrices = [p for p in kwargs["model"].parameters() if p.ndim == 2]
        kwargs["optimizers"] = (torch.optim.Muon(matrices, lr=1e-2), None)
    if not zero:
        return (NaNTrainer if nan else Trainer)(**kwargs)
    stage = re.fullmatch(r"zero(\d)(_\w+)?", case)
    plugin = ZeroPlugin(stage=int(stage[1])) if stage else None
    if case == "zero_budget":  # the settings chosen at prepare, measured on the train dataset's first batch
        plugin = ZeroPlugin(memory_budget="64GiB")
    if case == "zero_async":  # the launcher's stage 3; the optimizer's directory written in the background
        plugin = ZeroPlugin(asynchronous_checkpoints=True)
    if case == "zero_async_fallback":  # host memory too short to stage: written at once, rotated at once
        plugin = ZeroPlugin(asynchronous_checkpoints=True, asynchronous_checkpoints_fallback=True)
    return (NaNZeroTrainer if nan else ZeroTrainer)(zero_plugin=plugin, **kwargs)


def history(run: Trainer, after: int = 0) -> dict[str, list[float]]:
    """The steps' losses and gradient norms (a resumed run's history starts with its checkpoint's: left out)."""
    logged = [e for e in run.state.log_history if "loss" in e and "grad_norm" in e and e["step"] > after]
    return {"losses": [e["loss"] for e in logged], "grad_norms": [e["grad_norm"] for e in logged]}


def weights(run: Trainer) -> dict[str, list]:
    state = run.accelerator.get_state_dict(run.model)  # every process: gathers under stage 3
    return {name: tensor.float().flatten().tolist() for name, tensor in state.items()}


def describe(run: Trainer) -> dict:
    engine = getattr(run.accelerator, "engine", None)
    return {
        "trainer": type(run).__name__,
        "stage": engine.stage if engine is not None else None,
        "fit": engine.fit.summary() if engine is not None and engine.fit is not None else None,
        "num_processes": run.accelerator.num_processes,
        "optimizer": type(run.optimizer.optimizer if hasattr(run.optimizer, "optimizer") else run.optimizer).__name__
        if run.optimizer is not None
        else None,
    }


class SavedFolders(TrainerCallback):
    """What the run directory holds right after each save (the async case: the step-3 checkpoint is still there
    while step 6's optimizer is written, rotated out at the end), and a copy of the step-3 checkpoint made then
    (``kept-3``: what a resume from it reads; the rotation removes the original)."""

    def __init__(self, run_dir: Path, keep: bool = True) -> None:
        self.run_dir, self.keep, self.after_each_save = run_dir, keep, []

    def on_save(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.after_each_save.append(sorted(p.name for p in self.run_dir.iterdir()))
        if self.keep and state.global_step == STEPS and PartialState().is_main_process:
            shutil.copytree(self.run_dir / f"checkpoint-{SAVE_AT}", self.run_dir / f"kept-{SAVE_AT}")


def full_case(out: Path, case: str, batch_size: int) -> dict:
    run = trainer(case, out / f"{case}-run", batch_size)
    if "evalfirst" in case:  # evaluate() before train(): the model is prepared for evaluation first
        run.evaluate()
    if case == "zero_async_fallback":
        return fallback_case(out, case, run)
    if "async" in case:
        return async_case(out, case, batch_size, run)
    run.train()
    result = {**describe(run), **history(run), "weights": weights(run)}
    result["eval_loss"] = run.evaluate()["eval_loss"]
    result["predictions"] = run.predict(Tokens(8, 2)).predictions.flatten().tolist()
    run.save_model(str(out / f"{case}-model"))
    run.model.save_pretrained(str(out / f"{case}-pretrained"), is_main_process=run.args.should_save)
    resumed = trainer(case, out / f"{case}-resumed", batch_size)
    resumed.train(resume_from_checkpoint=str(out / f"{case}-run" / f"checkpoint-{SAVE_AT}"))
    result["resumed"] = {**describe(resumed), **history(resumed, SAVE_AT), "weights": weights(resumed)}
    result["checkpoint_files"] = sorted(p.name for p in (out / f"{case}-run" / f"checkpoint-{SAVE_AT}").iterdir())
    return result


def async_case(out: Path, case: str, batch_size: int, run: Trainer) -> dict:
    """Trains with the optimizer saved in the background, resumes from the step-3 checkpoint, then from a copy
    of it as a run stopped mid-write leaves it (its optimizer's directory not there, the marker still there)."""
    folders = SavedFolders(out / f"{case}-run")
    run.add_callback(folders)
    run.train()
    result = {**describe(run), **history(run), "weights": weights(run)}
    result["after each save"] = folders.after_each_save
    result["after training"] = sorted(p.name for p in (out / f"{case}-run").iterdir())
    kept = out / f"{case}-run" / f"kept-{SAVE_AT}"
    result["checkpoint_files"] = sorted(p.name for p in kept.iterdir())
    resumed = trainer(case, out / f"{case}-resumed", batch_size)
    resumed.train(resume_from_checkpoint=str(kept))
    result["resumed"] = {**describe(resumed), **history(resumed, SAVE_AT), "weights": weights(resumed)}
    unfinished = out / f"{case}-unfinished"
    if PartialState().is_main_process:
        shutil.copytree(kept, unfinished)
        shutil.rmtree(unfinished / OPTIMIZER_DIR)
        (unfinished / OPTIMIZER_UNFINISHED).write_text("")
    PartialState().wait_for_everyone()
    try:
        trainer(case, out / f"{case}-refused", batch_size).train(resume_from_checkpoint=str(unfinished))
        result["unfinished"] = None
    except CheckpointError as error:
        result["unfinished"] = str(error)
    return result


def fallback_case(out: Path, case: str, run: Trainer) -> dict:
    """asynchronous_checkpoints_fallback with host memory too short for the staged copy on rank 1: each save
    is written before it returns, and rotated at once, leaving no marker."""
    folders = SavedFolders(out / f"{case}-run", keep=False)
    run.add_callback(folders)
    original = save_and_load.available_host_memory_bytes
    if PartialState().process_index == 1:
        save_and_load.available_host_memory_bytes = lambda: 4096
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.train()
    save_and_load.available_host_memory_bytes = original
    result = {**describe(run), **history(run), "after each save": folders.after_each_save}
    result["warned"] = sum("synchronously: host " in str(w.message) for w in caught)
    result["after training"] = sorted(p.name for p in (out / f"{case}-run").iterdir())
    last = out / f"{case}-run" / f"checkpoint-{STEPS}"
    result["checkpoint_files"] = sorted(p.name for p in last.iterdir())
    return result


def nan_case(out: Path, case: str, batch_size: int) -> dict:
    run = trainer(case, out / f"{case}-run", batch_size)
    steps = StepRecord(run)
    run.add_callback(steps)
    run.train()
    records = {"nan_step": NAN_STEP, "skipped": steps.skipped, "loss_scales": steps.loss_scales}
    return {**describe(run), **history(run), "weights": weights(run), **records}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("cases", nargs="+")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--refused", default=None, help="a checkpoint of plain Trainer's, to resume from (refused)")
    args = parser.parse_args()
    out = Path(args.out)
    torch.set_num_threads(1)
    for case in args.cases:
        if args.resume:
            run = trainer(case, out / f"{case}-run", args.batch_size)
            run.train(resume_from_checkpoint=args.resume)
            result = {"resumed": {**describe(run), **history(run, SAVE_AT), "weights": weights(run)}}
        elif "nan" in case:
            result = nan_case(out, case, args.batch_size)
        else:
            result = full_case(out, case, args.batch_size)
        if PartialState().is_main_process:
            (out / f"{case}.json").write_text(json.dumps(result))
            print(f"{case}: losses {result.get('losses')} resumed {result.get('resumed', {}).get('losses')}")
    if args.refused:
        try:
            trainer("refused", out / "refused-run", args.batch_size).train(resume_from_checkpoint=args.refused)
            message = None
        except ValueError as error:
            message = str(error)
        if PartialState().is_main_process:
            (out / "refused.json").write_text(json.dumps({"message": message}))


if __name__ == "__main__":
    main()
