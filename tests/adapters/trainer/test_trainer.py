"""Hugging Face's Trainer end to end: ``ZeroTrainer`` under ``accelerate-zero launch`` (2 CPU processes)
against plain ``Trainer`` under ``accelerate launch`` (DDP): training, evaluation, prediction, the saved
model, and resuming from a checkpoint at the same and at another process count and stage."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from tests.paths import TESTS
from tests.rank_pool import free_port  # noqa: E402
from tests.workers import relative_difference  # noqa: E402

SCRIPT = str(TESTS / "scripts" / "trainer_run.py")
ACCELERATE = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch"]
ACCELERATE_ZERO = [sys.executable, "-m", "accelerate_zero.launch", "launch"]
STAGES = (1, 2, 3)


def _launch(launcher: list[str], processes: int, *script_args: str) -> None:
    """Why a process of its own: the launchers are the subject (`accelerate launch` for the DDP reference,
    `accelerate-zero launch` for ours)."""
    env = {**os.environ, "ACCELERATE_USE_CPU": "1"}
    for key in [k for k in env if k.startswith("ACCELERATE_ZERO") or k == "ACCELERATE_USE_ZERO"]:
        del env[key]
    distribution = ["--multi_gpu", "--num_processes", str(processes)] if processes > 1 else ["--num_processes", "1"]
    # A port of its own per launch: back-to-back launches on Accelerate's default 29500 can find it still held.
    distribution += ["--main_process_port", str(free_port())]
    result = subprocess.run(
        [*launcher, *distribution, "--mixed_precision", "no", SCRIPT, *script_args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict]]:
    out = tmp_path_factory.mktemp("trainer")
    # Each launcher's cases in one launch (a launch costs more than a case). bf16 and fp16 through
    # TrainingArguments(bf16=True / fp16=True), last so that the fp32 cases run as in a process of their own;
    # Trainer's own bf16 under DDP beside ours (its own fp16 under DDP computes in fp32 on a CPU). The nan cases
    # (a step skipped on an fp16 overflow) only train: last, after the fp16 case.
    ddp = (ACCELERATE, 2, str(out), "ddp", "ddp_muon", "ddp_adafactor", "ddp_bf16", "ddp_fp16_nan")
    # As users launch: stage 3 from the launcher; stages 1 and 2 by ZeroPlugin(stage=N).
    zero = (
        [*ACCELERATE_ZERO, "--zero_stage", "3"],
        2,
        str(out),
        "zero",
        "zero1",
        "zero2",
        "zero_evalfirst",
        "zero1_muon",
        "zero1_adafactor",
    )
    zero += ("zero_budget", "zero_async", "zero_async_fallback", "zero_bf16", "zero_fp16")
    zero += ("zero1_fp16_nan", "zero2_fp16_nan", "zero_fp16_nan")
    # The two side by side (a launch keeps about one of two cores busy; each writes its own files).
    with ThreadPoolExecutor(max_workers=2) as launches:
        for launch in [launches.submit(_launch, *ddp), launches.submit(_launch, *zero)]:
            launch.result()
    # Stage 3's step-3 checkpoint resumed by 1 process at stage 1 (the same global batch).
    checkpoint = str(out / "zero-run" / "checkpoint-3")
    _launch(
        [*ACCELERATE_ZERO, "--zero_stage", "1"],
        1,
        *[str(out), "one", "--batch-size", "4", "--resume", checkpoint],
        *["--refused", str(out / "ddp-run" / "checkpoint-3")],
    )
    names = ["ddp", "zero", "zero1", "zero2", "zero_evalfirst", "one", "refused", "ddp_bf16", "zero_bf16", "zero_fp16"]
    names += ["ddp_fp16_nan", "zero1_fp16_nan", "zero2_fp16_nan", "zero_fp16_nan", "ddp_muon", "zero1_muon"]
    names += ["ddp_adafactor", "zero1_adafactor", "zero_budget", "zero_async", "zero_async_fallback"]
    return out, {name: json.loads((out / f"{name}.json").read_text()) for name in names}


def _tensors(weights: dict[str, list]) -> dict[str, torch.Tensor]:
    return {name: torch.tensor(values) for name, values in weights.items()}


def _flat(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().flatten() for name, tensor in state.items()}


def _weights_differ(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(the largest difference relative to each tensor's largest value, the largest absolute difference of
    the attention's key biases). Those (the middle third of ``c_attn.bias``) are compared apart: their
    gradient is zero in exact arithmetic (softmax ignores a shift shared by all keys), and AdamW normalises
    its rounding noise (~1e-10, which differs with the order of the sums) into steps of up to the learning
    rate, under DDP as under ZeRO; they stay near 1e-5 in size, the other weights near 3e-2."""
    relative = key_bias = 0.0
    for name, expected in reference.items():
        actual = ours[name]
        if name.endswith("attn.c_attn.bias"):
            third = len(expected) // 3
            key_bias = max(key_bias, float((actual[third : 2 * third] - expected[third : 2 * third]).abs().max()))
            actual = torch.cat([actual[:third], actual[2 * third :]])
            expected = torch.cat([expected[:third], expected[2 * third :]])
        relative = max(relative, relative_difference({name: actual}, {name: expected}))
    return relative, key_bias


def _equal_weights(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    relative, key_bias = _weights_differ(ours, reference)
    assert relative <= 1e-5 and key_bias <= 1e-4, (relative, key_bias)


def _case(stage: int) -> str:
    return "zero" if stage == 3 else f"zero{stage}"


@pytest.mark.parametrize("stage", STAGES)
def test_train_evaluate_predict_equal_trainer_under_ddp(runs: tuple, stage: int) -> None:
    _, results = runs
    reference, ours = results["ddp"], results[_case(stage)]
    assert (reference["trainer"], ours["trainer"]) == ("Trainer", "ZeroTrainer")
    assert (ours["stage"], ours["num_processes"]) == (stage, 2)
    assert len(ours["losses"]) == 6
    assert ours["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert ours["grad_norms"] == pytest.approx(reference["grad_norms"], rel=1e-4)
    _equal_weights(_tensors(ours["weights"]), _tensors(reference["weights"]))
    assert ours["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-5)
    assert ours["predictions"] == pytest.approx(reference["predictions"], rel=1e-4, abs=1e-5)


def test_a_memory_budget_measures_the_first_train_batch_and_trains_resumes_as_ddp(runs: tuple) -> None:
    """ZeroPlugin(memory_budget="64GiB") beside the launcher's stage 3: the settings chosen at prepare from the
    train dataset's first per-device batch (a tiny GPT-2: stage 1 is the cheapest that fits), DDP's numbers,
    and the resumed run (which chooses again) continues them."""
    _, results = runs
    reference, ours = results["ddp"], results["zero_budget"]
    assert ours["stage"] == 1 and ours["fit"].startswith("zero fit for device 64.00 GiB per rank (margin 10%): stage 1")
    assert "micro-batch 2 x 1 accumulation" in ours["fit"]  # per_device_train_batch_size
    assert ours["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    _equal_weights(_tensors(ours["weights"]), _tensors(reference["weights"]))
    assert ours["resumed"]["stage"] == 1
    assert ours["resumed"]["losses"] == pytest.approx(reference["resumed"]["losses"], rel=1e-5)


def test_asynchronous_checkpoints_rotate_once_written_resume_as_ddp_and_an_unfinished_one_is_refused(
    runs: tuple,
) -> None:
    """ZeroPlugin(asynchronous_checkpoints=True), save_total_limit=1: the optimizer's directory is written in the
    background; the step-3 checkpoint is rotated out only once step 6's is written (at the end of train()), no
    marker is left, the step-3 checkpoint resumes as DDP's does, and one whose run stopped mid-write is refused."""
    _, results = runs
    reference, ours = results["ddp"], results["zero_async"]
    assert ours["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert ours["after each save"] == [["checkpoint-3"], ["checkpoint-3", "checkpoint-6"]]
    assert ours["after training"] == ["checkpoint-6", "kept-3"]
    assert "optimizer_zero" in ours["checkpoint_files"] and "optimizer_zero.unfinished" not in ours["checkpoint_files"]
    resumed = ours["resumed"]
    assert resumed["losses"] == pytest.approx(reference["resumed"]["losses"], rel=1e-5)
    _equal_weights(_tensors(resumed["weights"]), _tensors(reference["resumed"]["weights"]))
    assert "is incomplete: its optimizer state (optimizer_zero/) was still being written" in ours["unfinished"]


def test_an_asynchronous_save_host_memory_cannot_stage_falls_back_to_a_synchronous_one_and_rotates(
    runs: tuple,
) -> None:
    """asynchronous_checkpoints_fallback=True, one process short of host memory: every save is written before it
    returns (warned on the main process), the older checkpoint rotated out at once, no marker left."""
    _, results = runs
    reference, ours = results["ddp"], results["zero_async_fallback"]
    assert ours["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert ours["warned"] == 2
    assert ours["after each save"] == [["checkpoint-3"], ["checkpoint-6"]]
    assert ours["after training"] == ["checkpoint-6"]
    assert "optimizer_zero" in ours["checkpoint_files"] and "optimizer_zero.unfinished" not in ours["checkpoint_files"]


@pytest.mark.parametrize("stage", STAGES)
def test_saved_model_loads_with_from_pretrained_and_equals_ddps(runs: tuple, stage: int) -> None:
    """``trainer.save_model()`` and ``model.save_pretrained()`` on every process; stage 3 gathers the weights."""
    from transformers import GPT2LMHeadModel

    out, results = runs
    for saved in ("model", "pretrained"):
        ours = _flat(GPT2LMHeadModel.from_pretrained(out / f"{_case(stage)}-{saved}").state_dict())
        reference = _flat(GPT2LMHeadModel.from_pretrained(out / f"ddp-{saved}").state_dict())
        _equal_weights(ours, reference)
        assert relative_difference(ours, _tensors(results[_case(stage)]["weights"])) == 0.0


@pytest.mark.parametrize("stage", STAGES)
def test_resume_from_checkpoint_equals_ddps_resume(runs: tuple, stage: int) -> None:
    _, results = runs
    reference, ours = results["ddp"], results[_case(stage)]
    assert "optimizer_zero" in ours["checkpoint_files"] and "optimizer.pt" not in ours["checkpoint_files"]
    assert {"trainer_state.json", "scheduler.pt", "rng_state_0.pth", "model.safetensors"} <= set(
        ours["checkpoint_files"]
    )
    resumed = ours["resumed"]
    assert reference["resumed"]["losses"] == reference["losses"][3:]  # DDP resumes exactly
    assert resumed["losses"] == pytest.approx(reference["resumed"]["losses"], rel=1e-5)
    weights = _tensors(resumed["weights"])
    _equal_weights(weights, _tensors(reference["resumed"]["weights"]))
    assert relative_difference(weights, _tensors(ours["weights"])) <= 1e-6  # as if never interrupted


def test_muon_given_as_optimizers_trains_saves_and_resumes_as_trainer_under_ddp(runs: tuple) -> None:
    """``ZeroTrainer(optimizers=(torch.optim.Muon(matrices), None))``: each matrix stepped whole at its owner by
    torch's own step, so Trainer's numbers under DDP, bit for bit, through its checkpoint and resume too."""
    _, results = runs
    reference, ours = results["ddp_muon"], results["zero1_muon"]
    assert (ours["trainer"], ours["stage"]) == ("ZeroTrainer", 1)
    assert len(ours["losses"]) == 6 and len(set(ours["losses"])) > 1
    assert ours["losses"] == reference["losses"]
    assert relative_difference(_tensors(ours["weights"]), _tensors(reference["weights"])) == 0.0
    resumed = ours["resumed"]
    assert resumed["losses"] == reference["resumed"]["losses"] == reference["losses"][3:]
    assert relative_difference(_tensors(resumed["weights"]), _tensors(ours["weights"])) == 0.0


def test_adafactor_by_its_optim_name_trains_saves_and_resumes_as_trainer_under_ddp(runs: tuple) -> None:
    """``TrainingArguments(optim="adafactor")``: transformers' Adafactor, each tensor stepped whole at its owner
    (its factored second moment kept whole by the tensor's holders, its Python step count with them), so
    Trainer's numbers under DDP bit for bit, through its checkpoint and resume. Stage 1: at stages 2 and 3 the
    shards sum the micro-batches' reduced gradients, a rounding from DDP's accumulated ``.grad``, which
    Adafactor's per-tensor normalisation turns into whole steps for tensors whose gradient is only rounding
    (the attention's key biases), under DDP as under ZeRO."""
    _, results = runs
    reference, ours = results["ddp_adafactor"], results["zero1_adafactor"]
    assert (ours["trainer"], ours["stage"], ours["optimizer"]) == ("ZeroTrainer", 1, "Adafactor")
    assert reference["optimizer"] == "Adafactor"
    assert len(ours["losses"]) == 6 and len(set(ours["losses"])) > 1
    assert ours["losses"] == reference["losses"]
    assert relative_difference(_tensors(ours["weights"]), _tensors(reference["weights"])) == 0.0
    resumed = ours["resumed"]
    assert resumed["losses"] == reference["resumed"]["losses"] == reference["losses"][3:]
    assert relative_difference(_tensors(resumed["weights"]), _tensors(ours["weights"])) == 0.0


def test_resume_with_another_process_count_and_stage(runs: tuple) -> None:
    _, results = runs
    resumed = results["one"]["resumed"]
    assert (resumed["trainer"], resumed["stage"], resumed["num_processes"]) == ("ZeroTrainer", 1, 1)
    reference = results["ddp"]["resumed"]
    assert resumed["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    _equal_weights(_tensors(resumed["weights"]), _tensors(reference["weights"]))


def test_a_checkpoint_of_plain_trainer_is_refused_with_what_to_do(runs: tuple) -> None:
    """ZeroTrainer reads its own sharded optimizer_zero/, not Trainer's optimizer.pt: refused before training."""
    _, results = runs
    message = results["refused"]["message"]
    assert message is not None and "holds Trainer's optimizer.pt" in message and "from_pretrained" in message


def test_importing_accelerate_zero_does_not_import_transformers() -> None:
    """Why a process of its own: what an import brings in is seen only in an interpreter that imported nothing else."""
    code = "import sys, accelerate_zero; print('transformers' in sys.modules, accelerate_zero.ZeroTrainer.__name__)"
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert output.split() == ["False", "ZeroTrainer"]


def test_fsdp_in_training_arguments_is_refused(tmp_path: Path) -> None:
    """In this process (no process starts): Trainer's own FSDP would shard the model a second time."""
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from accelerate_zero import ZeroTrainer

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16))
    arguments = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, fsdp=True, report_to="none")
    with pytest.raises(ValueError, match="leave out TrainingArguments' fsdp= and launch without DeepSpeed"):
        ZeroTrainer(model=model, args=arguments)


def test_bf16_training_args_train_like_trainers_own_bf16(runs: tuple) -> None:
    """TrainingArguments(bf16=True): ZeroTrainer computes in bf16 with an fp32 master, as Trainer's own bf16
    under DDP does (autocast over fp32 weights): losses within 1e-3 (2e-4 measured; bf16 moves them from
    fp32's by about as much)."""
    _, results = runs
    ours, reference = results["zero_bf16"], results["ddp_bf16"]
    assert ours["trainer"] == "ZeroTrainer" and ours["stage"] == 3
    assert len(ours["losses"]) == len(reference["losses"]) == 6
    assert ours["losses"] == pytest.approx(reference["losses"], rel=1e-3)
    assert ours["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-3)
    assert ours["resumed"]["losses"] == pytest.approx(reference["resumed"]["losses"], rel=1e-3)


def test_fp16_training_args_train_with_the_engines_loss_scaling_and_resume_exactly(runs: tuple) -> None:
    """TrainingArguments(fp16=True): ZeroTrainer computes in fp16 with the engine's loss scaling (Trainer's own
    fp16 under DDP computes in fp32 on a CPU, so the reference is fp32): losses and evaluation loss within
    1e-3 (6e-5 measured); the run resumed from its step-3 checkpoint continues it bit for bit (the loss
    scale is part of the checkpoint)."""
    _, results = runs
    ours, reference = results["zero_fp16"], results["ddp"]
    assert ours["trainer"] == "ZeroTrainer" and ours["stage"] == 3
    assert len(ours["losses"]) == 6
    assert ours["losses"] == pytest.approx(reference["losses"], rel=1e-3)
    assert ours["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-3)
    assert ours["resumed"]["losses"] == ours["losses"][3:]
    assert ours["resumed"]["grad_norms"] == ours["grad_norms"][3:]


def test_evaluate_before_train_then_trains_as_without_it(runs: tuple) -> None:
    """evaluate() before train() prepares the model for evaluation first; training then equals the run
    without it bit for bit (the same kernels in the same order), and Trainer under DDP's plain run as the
    other cases do (ZeRO-3's reduce-scatter sums in another order than DDP's all-reduce: equal on some CPUs,
    one rounding apart on others). Trainer's own DDP is not the reference after an evaluate() first: it
    leaves the model unwrapped and each process trains alone (transformers 5.24)."""
    _, results = runs
    ours, plain, reference = results["zero_evalfirst"], results["zero"], results["ddp"]
    assert ours["trainer"] == "ZeroTrainer" and ours["stage"] == 3
    assert ours["losses"] == plain["losses"]
    assert ours["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert ours["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-6)


@pytest.mark.parametrize("stage", STAGES)
def test_a_step_skipped_on_an_fp16_overflow_then_trains_as_trainer_under_ddp(runs: tuple, stage: int) -> None:
    """Issue 42: rank 0's loss is NaN in step 3 (both micro-batches), with TrainingArguments(fp16=True). Trainer
    skips the step on its scaler's word (``optimizer_step_was_skipped``: no scheduler step), then calls
    ``model.zero_grad()``: the NaN gradients must be gone from the next step. ZeroTrainer's engine skips it on its
    own fp16 loss scaler; the reference is Trainer under DDP with torch's GradScaler on the CPU (Accelerate makes
    none there; ``trainer_run.NaNTrainer``) and fp32 compute, with the unfused AdamW: Trainer's default fused one
    skips inside its kernel and Accelerate then reports the step as taken (huggingface/accelerate#4242). Both
    scalers start at 2**16 and halve on an overflow: the loss scale is compared exactly, step by step.

    This passed before ``zero_grad`` reached the engine too (3970bd6): the engine's skipped step drops the
    gradients itself, as a step taken does, so Trainer's ``model.zero_grad()`` finds none left. It pins that
    pair: with the drop on a skip taken out of the engine it still passes, through ``model.zero_grad()``, and
    fails without that route (every later step skipped on the kept NaN), at each stage.

    Ours computes in fp16, the reference in fp32, so what is compared is what that leaves comparable: per step
    the skip, the loss scale, the loss (within 1e-3; 5e-5 measured) and the gradient norm (NaN in the skipped
    step on both; otherwise within 1e-3, 3e-4 measured: NaN gradients kept, or the skipped step's leaking into
    the next, would differ by far more), and the final weights as a whole (within 2% of their norm: 0.6%
    measured, where a run that took step 3 differs by 7%). Weight by weight they are not comparable: AdamW
    turns a gradient near zero, whose sign fp16 rounding can flip, into a step of up to the learning rate
    either way (up to 2e-2 here, a third of a tensor's largest weight)."""
    _, results = runs
    reference, ours = results["ddp_fp16_nan"], results[f"{_case(stage)}_fp16_nan"]
    assert (reference["trainer"], ours["trainer"]) == ("NaNTrainer", "NaNZeroTrainer")
    assert (ours["stage"], ours["num_processes"]) == (stage, 2)
    nan_step = reference["nan_step"]
    skipped = [step == nan_step for step in range(6)]
    assert reference["skipped"] == ours["skipped"] == skipped
    scales = [2.0**16 if step < nan_step else 2.0**15 for step in range(6)]
    assert reference["loss_scales"] == ours["loss_scales"] == scales
    assert ours["losses"] == pytest.approx(reference["losses"], rel=1e-3)
    assert math.isnan(reference["grad_norms"][nan_step]) and math.isnan(ours["grad_norms"][nan_step])
    finite = [step for step in range(6) if step != nan_step]
    assert [ours["grad_norms"][s] for s in finite] == pytest.approx(
        [reference["grad_norms"][s] for s in finite], rel=1e-3
    )
    # The skip changed the training: the next step's norm is not that of the run without NaN.
    assert reference["grad_norms"][nan_step + 1] != pytest.approx(results["ddp"]["grad_norms"][nan_step + 1], rel=1e-2)
    mine, theirs = (torch.cat(list(_tensors(run["weights"]).values())) for run in (ours, reference))
    assert bool(torch.isfinite(mine).all()) and float((mine - theirs).norm() / theirs.norm()) <= 2e-2
