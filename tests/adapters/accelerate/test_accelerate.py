"""The Accelerate adapter end to end: `accelerate-zero launch` with 2 CPU
processes against plain `accelerate launch` (DDP), save_state/load_state
across process counts, and the consolidation paths."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from accelerate_zero import ZeroPlugin
from tests.paths import ROOT, TESTS
from tests.rank_pool import free_port
from tests.workers import relative_difference

SCRIPT = str(TESTS / "scripts" / "accelerate_train.py")
# The commands through this interpreter: console-script shims may not be on PATH (pyenv without a rehash).
ACCELERATE = [sys.executable, "-m", "accelerate.commands.accelerate_cli"]
ACCELERATE_ZERO = [sys.executable, "-m", "accelerate_zero.launch"]
PARITY = ["--accumulate", "2", "--clip", "0.5"]
RESUMABLE = ["--batchnorm", "0", "--steps", "6", "--save-at", "3", "--scheduler", "0"]
BF16 = ["--batchnorm", "0", "--steps", "12"]
# Each rank's loss at each step of BF16 within this of Accelerate's own bf16 DDP (docs/guides/accelerate.md).
BF16_BOUND = 0.02
THEN = "--then"  # the script's next case, in the same launch


def _launch(
    out: Path,
    name: str,
    *script_args: str,
    zero: dict | None = None,
    deepspeed: dict | None = None,
    processes: int = 2,
    mixed_precision: str = "no",
) -> subprocess.CompletedProcess:
    """Why a process of its own: the launchers are the subject (`accelerate launch`, and `accelerate-zero launch`
    reading a ZeRO or DeepSpeed config into each process's settings)."""
    env = {**os.environ, "ACCELERATE_USE_CPU": "1"}
    for key in [k for k in env if k.startswith("ACCELERATE_ZERO") or k == "ACCELERATE_USE_ZERO"]:
        del env[key]
    launcher = [*ACCELERATE, "launch"]
    if zero is not None:
        config = out / f"{name}.yaml"
        config.write_text("".join(f"{k}: {v}\n" for k, v in zero.items()))
        launcher = [*ACCELERATE_ZERO, "launch", "--zero_config_file", str(config)]
    if deepspeed is not None:  # a DeepSpeed user's own JSON config
        config = out / f"{name}.json"
        config.write_text(json.dumps(deepspeed))
        launcher = [*ACCELERATE_ZERO, "launch", "--zero_config_file", str(config)]
    distribution = ["--multi_gpu", "--num_processes", str(processes)] if processes > 1 else ["--num_processes", "1"]
    # A free port per launch: back-to-back launches can find Accelerate's default 29500 still held.
    distribution += ["--mixed_precision", mixed_precision, "--main_process_port", str(free_port())]
    return subprocess.run(
        [*launcher, *distribution, SCRIPT, str(out), name, *script_args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _checked(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict]]:
    out = tmp_path_factory.mktemp("accelerate")
    # Cases share launches, in sequence in the same processes: a launch costs far more than a case. Both DDP
    # references in one, the bf16 one's precision given by the script (only ours must come from the launcher).
    # The third: Accelerate's bf16 DDP on the model whose forward rounds every parameter to bf16, as our copies.
    bf16_references = [THEN, "ddp-muon", "--optimizer", "muon", THEN, "ddp-bf16", *BF16, "--mixed-precision", "bf16"]
    bf16_references += [THEN, "ddp-bf16-rounded", *BF16, "--mixed-precision", "bf16", "--round-params", "1"]
    # Stages 1 and 3: the plugin hands the stage to the core untouched, and stage 2 sits
    # between them (its parity with DDP is checked in the core and Lightning tests). Stage 3 from the
    # launcher's file, stage 1 by the script's ZeroPlugin(stage=1) (from a file: "resumed-1" below).
    zero3 = {"stage": 3, "wrap_classes": "[Block]"}
    muon_case = [THEN, "zero3-muon", "--optimizer", "muon"]  # torch's Muon over the matrices, against "ddp-muon"
    # bf16 at stages 3 and 2; then bf16 as Accelerate's DDP computes it: fp32 copies under the script's autocast.
    fp32_copies = ["--mixed-precision", "no", "--autocast", "1"]
    bf16_cases = ["zero3-bf16", *BF16, THEN, "zero2-bf16", *BF16, "--stage", "2", THEN, "zero3-autocast", *BF16]

    def saved_and_resumed() -> None:
        _checked(
            _launch(
                out,
                "zero3",
                *PARITY,
                THEN,
                "zero1",
                *PARITY,
                "--stage",
                "1",
                THEN,
                "saved",
                *RESUMABLE,
                *muon_case,
                THEN,
                "budget",  # ZeroPlugin(memory_budget=...): the settings chosen at prepare
                *PARITY,
                "--memory-budget",
                "64GiB",
                zero=zero3,
            )
        )
        _checked(_launch(out, "resumed-2", *RESUMABLE, "--resume", str(out / "saved-state"), zero={"stage": 3}))
        resumed_1 = [*RESUMABLE, "--batch-size", "8", "--resume", str(out / "saved-state")]
        _checked(_launch(out, "resumed-1", *resumed_1, zero={"stage": 1}, processes=1))

    def references_json_and_bf16() -> None:
        _checked(_launch(out, "ddp", *PARITY, *bf16_references))
        _checked(_launch(out, "zero2-deepspeed-json", *PARITY, deepspeed=DEEPSPEED_ZERO2))
        _checked(_launch(out, *bf16_cases, *fp32_copies, zero=zero3, mixed_precision="bf16"))

    # Two lanes of launches side by side (a launch keeps about one of two cores busy); each writes its own files.
    with ThreadPoolExecutor(max_workers=2) as lanes:
        for lane in [lanes.submit(saved_and_resumed), lanes.submit(references_json_and_bf16)]:
            lane.result()
    names = [
        "ddp",
        "zero1",
        "zero3",
        "zero2-deepspeed-json",
        "saved",
        "resumed-2",
        "resumed-1",
        "ddp-bf16",
        "ddp-bf16-rounded",
        "zero3-bf16",
        "zero2-bf16",
        "zero3-autocast",
        "ddp-muon",
        "zero3-muon",
        "budget",
    ]
    return out, {name: torch.load(out / f"{name}.pt", weights_only=False) for name in names}


# A DeepSpeed user's config, as DeepSpeed's docs give it ("auto": the framework's own values).
# Clipping at PARITY's 0.5: under Accelerate DeepSpeed's engine clips at the config's norm in the step (1.0
# without the key) and the script's clip_grad_norm_ only measures, so this is the DDP run's clipping.
DEEPSPEED_ZERO2 = {
    "gradient_clipping": 0.5,
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True, "reduce_scatter": True},
}


def test_a_deepspeed_config_file_trains_like_plain_accelerate(runs: tuple) -> None:
    _, results = runs
    reference, ours = results["ddp"], results["zero2-deepspeed-json"]
    assert ours["accelerator"] == "ZeroAccelerator"
    assert [line for line in ours["logged"] if "ZeRO stage 2: " in line]  # the file's stage, not the default 3
    assert ours["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert relative_difference(ours["weights"], reference["weights"]) <= 1e-5
    # Clipped AdamW is blind to a gradient scaled by a constant (a loss not divided by the accumulation
    # steps); the norm clip_grad_norm_ returns is not.
    assert len(ours["clip_norms"]) == 6 and ours["clip_norms"] == pytest.approx(reference["clip_norms"], rel=1e-5)


@pytest.mark.parametrize("stage", [1, 3])
def test_each_stage_matches_plain_accelerate(runs: tuple, stage: int) -> None:
    _, results = runs
    reference, ours = results["ddp"], results[f"zero{stage}"]
    assert ours["accelerator"] == "ZeroAccelerator" and reference["accelerator"] == "Accelerator"
    # One line at setup says what ZeRO does, through Accelerate's logger (main process).
    setup_lines = [line for line in ours["logged"] if "ZeRO stage" in line]  # Accelerate prefixes "[RANK 0] "
    assert len(setup_lines) == 1 and f"ZeRO stage {stage}: " in setup_lines[0], ours["logged"]
    assert "sharded over 2 of 2 ranks" in setup_lines[0] and "(DDP: " in setup_lines[0]
    assert len(ours["losses"]) == 12  # 6 steps of 2 micro-batches
    assert ours["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert relative_difference(ours["weights"], reference["weights"]) <= 1e-5
    # Clipped AdamW is blind to a gradient scaled by a constant (a loss not divided by the accumulation
    # steps); the norm clip_grad_norm_ returns is not.
    assert len(ours["clip_norms"]) == 6 and ours["clip_norms"] == pytest.approx(reference["clip_norms"], rel=1e-5)


def test_a_memory_budget_chooses_at_prepare_logs_the_choice_and_matches_plain_accelerate(runs: tuple) -> None:
    """ZeroPlugin(memory_budget="64GiB") beside the launcher's stage-3 file: the settings chosen from the model's
    example_input_array (the cheapest for a tiny model: stage 1), said in the setup line, DDP's numbers."""
    _, results = runs
    reference, ours = results["ddp"], results["budget"]
    setup_lines = [line for line in ours["logged"] if "ZeRO stage" in line]
    assert len(setup_lines) == 1 and "ZeRO stage 1: " in setup_lines[0], ours["logged"]
    assert ours["stage"] == 1 and ours["fit"].startswith("zero fit for device 64.00 GiB per rank")
    assert "memory_budget: " + ours["fit"] in setup_lines[0]
    assert ours["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert relative_difference(ours["weights"], reference["weights"]) <= 1e-5


def test_muon_through_prepare_matches_plain_accelerate_with_muon(runs: tuple) -> None:
    """torch.optim.Muon given to ``accelerator.prepare`` at stage 3: each matrix stepped whole at its owner by
    torch's own step, so plain Accelerate's (DDP's) numbers, bit for bit."""
    _, results = runs
    reference, ours = results["ddp-muon"], results["zero3-muon"]
    assert ours["accelerator"] == "ZeroAccelerator" and len(set(ours["losses"])) > 1
    assert ours["losses"] == reference["losses"]
    assert relative_difference(ours["weights"], reference["weights"]) == 0.0


def _rank_losses(result: dict) -> torch.Tensor:
    losses = torch.tensor(result["rank_losses"], dtype=torch.float64)
    assert losses.shape == (12, 2)  # [step][rank]: the 12 steps of BF16 on 2 processes
    return losses


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_is_accelerates_own_on_bf16_copies_of_every_parameter(runs: tuple, stage: int) -> None:
    """As under Accelerate's bf16 DDP: outputs in fp32 (the loss computed in fp32), accelerator.autocast()
    active. But the forward sees a bf16 copy of every parameter, where Accelerate's autocast rounds only the
    inputs of the ops it lists (the linear layers here): the embedding and norms read fp32 parameters there.
    That is the whole difference: each rank's loss at each step is that of Accelerate's bf16 DDP on the model
    whose forward rounds every parameter to bf16, and within BF16_BOUND (the Accelerate guide) of Accelerate's bf16 DDP.

    Measured per rank and step, stages 2 and 3 alike, on an AVX2 CPU (torch 2.13) and an AVX-512 Xeon (torch
    2.11): 0.58% at most (rank 1, step 2), 0.18% on average. Rounding every parameter but the norms' gives
    0.32%; every parameter but the norms' and the embedding's, Accelerate's bf16 DDP exactly, as do fp32
    copies (below); reducing in bf16 instead of fp32 moves nothing (0.58%)."""
    _, results = runs
    reference, ours = results["ddp-bf16"], results[f"zero{stage}-bf16"]
    assert ours["mixed_precision"] == reference["mixed_precision"] == "bf16"
    assert ours["output_dtypes"] == reference["output_dtypes"] == {"torch.float32"}
    assert ours["autocast_enabled"] and reference["autocast_enabled"]
    rounded = _rank_losses(results["ddp-bf16-rounded"])
    reference, ours = _rank_losses(reference), _rank_losses(ours)
    assert not torch.equal(rounded, reference)  # the rounding is a difference on this model
    torch.testing.assert_close(ours, rounded, rtol=1e-5, atol=0)
    worst = ((ours - reference).abs() / reference).max().item()
    assert worst <= BF16_BOUND, f"{worst:.2%} from Accelerate's bf16 DDP: {ours.tolist()} vs {reference.tolist()}"


def test_fp32_copies_under_autocast_compute_what_accelerates_bf16_ddp_computes(runs: tuple) -> None:
    """ZeroAccelerator(mixed_precision="no"), the forward under torch.autocast(bf16): the guide's route to the
    numbers of Accelerate's bf16 DDP themselves, each rank's loss at each step."""
    _, results = runs
    ours = results["zero3-autocast"]
    assert ours["accelerator"] == "ZeroAccelerator" and ours["mixed_precision"] == "no"
    torch.testing.assert_close(_rank_losses(ours), _rank_losses(results["ddp-bf16"]), rtol=1e-5, atol=0)


def test_load_state_continues_exactly_with_same_and_other_process_count(runs: tuple) -> None:
    _, results = runs
    saved = results["saved"]
    same = results["resumed-2"]
    assert same["losses"] == saved["losses"][3:]
    assert relative_difference(same["weights"], saved["weights"]) == 0.0
    fewer = results["resumed-1"]
    assert [line for line in fewer["logged"] if "ZeRO stage 1: " in line]  # the launcher's file's stage
    assert fewer["losses"] == pytest.approx(saved["losses"][3:], rel=1e-5)
    assert relative_difference(fewer["weights"], saved["weights"]) <= 1e-5


def test_merge_weights_and_save_model_equal_get_state_dict(runs: tuple, tmp_path: Path) -> None:
    """Why a process of its own: Accelerate's own `accelerate merge-weights` command is the subject."""
    out, results = runs
    expected = results["resumed-2"]["loaded"]  # get_state_dict right after load_state
    subprocess.run(
        [*ACCELERATE, "merge-weights", str(out / "saved-state" / "pytorch_model_zero_0"), str(tmp_path / "merged")],
        check=True,
        capture_output=True,
    )
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    assert set(merged) == set(expected)
    assert relative_difference(merged, expected) == 0.0
    saved_model = load_file(out / "resumed-2-model" / "model.safetensors")  # tied head.weight is stored once
    assert relative_difference(saved_model, {k: results["resumed-2"]["weights"][k] for k in saved_model}) == 0.0


@pytest.mark.parametrize(
    "config, message",
    [
        ("stages: 3\n", "unknown key(s) ['stages']"),
        ("stage: 4\n", "ZeroConfig.stage=4 is invalid"),
        ("prefetch: -2\n", "use an integer >= 0 (0 turns prefetch off)"),
        ("- 3\n", "expected a mapping of ZeRO settings"),
    ],
)
def test_bad_zero_config_fails_before_launch(
    tmp_path: Path, config: str, message: str, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What `python -m accelerate_zero.launch` runs (``sys.exit(main())``), in this process: a new interpreter
    would spend seconds importing Accelerate to print one line. Were a bad config launched, the launch would
    start processes here, which tests/conftest.py fails in a test not marked distributed."""
    from accelerate_zero.launch import main

    for name in [k for k in os.environ if k.startswith("ACCELERATE_ZERO") or k == "ACCELERATE_USE_ZERO"]:
        monkeypatch.delenv(name)  # the launcher clears them; they come back after the test
    file = tmp_path / "zero.yaml"
    file.write_text(config)
    started = time.monotonic()
    returncode = main(["launch", "--zero_config_file", str(file), "--num_processes", "2", SCRIPT, str(tmp_path), "x"])
    assert returncode == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x.pt").exists() and time.monotonic() - started < 30


def test_plugin_reads_the_environment_and_explicit_arguments_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELERATE_ZERO_STAGE", "2")
    monkeypatch.setenv("ACCELERATE_ZERO_WRAP_CLASSES", "Block,GPTBlock")
    assert ZeroPlugin().stage == 2 and ZeroPlugin().wrap_classes == ("Block", "GPTBlock")
    assert ZeroPlugin(stage=1).stage == 1
    monkeypatch.setenv("ACCELERATE_ZERO_PREFETCH", "lots")
    with pytest.raises(ValueError, match="ACCELERATE_ZERO_PREFETCH='lots'"):
        ZeroPlugin()


def test_accelerate_adapter_does_not_import_lightning() -> None:
    """Why a process of its own: what an import brings in is seen only in an interpreter that imported nothing else."""
    code = "import sys, accelerate_zero; print(any(m.startswith('lightning') for m in sys.modules))"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        == "False"
    )


def test_launcher_settings_ignore_stale_variables_and_the_scripts_own_arguments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from accelerate_zero.launch import plugin_from_arguments

    monkeypatch.setenv("ACCELERATE_ZERO_PREFETCH", "7")  # left over from an earlier launch
    config = tmp_path / "zero.yaml"
    config.write_text("stage: 2\n")
    plugin, launch_args = plugin_from_arguments(
        [
            "--zero_config_file",
            str(config),
            "--zero_broadcast_buffers",
            "false",
            "--num_processes",
            "2",
            "train.py",
            "--zero_prefetch",
            "3",
        ]
    )
    assert (plugin.stage, plugin.prefetch, plugin.broadcast_buffers) == (2, 1, False)
    assert launch_args.training_script == "train.py"
    assert launch_args.training_script_args == ["--zero_prefetch", "3"]  # the script's, not ours


def _one_process_report(script: str, work: Path, *arguments: str) -> dict:
    """Run ``tests/scripts/<script> <work>`` in one CPU process; its last line of output is a JSON report.
    Why a process of its own: the script builds Accelerate's process-wide state from `ACCELERATE_USE_CPU` as a
    user's script does, and saves and loads under it."""
    result = subprocess.run(
        [sys.executable, str(TESTS / "scripts" / script), str(work), *arguments],
        env={**os.environ, "ACCELERATE_USE_CPU": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    _checked(result)
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_failed_save_state_keeps_the_previous_checkpoint_and_a_mixed_pair_is_refused(tmp_path: Path) -> None:
    """One process: a save that fails (disk full) under automatic naming with total_limit=1 leaves
    the previous checkpoint as the latest (Accelerate alone would have pruned it first); a reused
    folder whose model save failed after its optimizer save is refused by load_state, changing nothing."""
    report = _one_process_report("accelerate_failures.py", tmp_path)
    assert report["failed save"].startswith("No space left on device"), report
    assert report["folders after a failed save"] == ["checkpoint_0"]
    assert report["latest loads the first save"]
    assert report["accelerate's files fail"].startswith(
        "save_state failed: OSError: [Errno 28] No space left on device"
    )
    assert report["folders after accelerate's files failed"] == ["checkpoint_0"]
    assert report["folders after a good save"] == ["checkpoint_1"]
    assert "come from different saves" in report["mixed pair"], report
    assert report["mixed pair left the model alone"]


def test_an_asynchronous_save_state_returns_at_once_prunes_once_written_and_a_failed_write_is_undone(
    tmp_path: Path,
) -> None:
    """One process, asynchronous_checkpoints=True, total_limit=1: save_state returns while the model and the
    optimizer are written; the older checkpoint is pruned only once the newer is written; what was saved loads
    though the weights changed meanwhile; a write that fails (disk full) is raised at the next step, naming the
    checkpoint, its folder is removed, and load_state() finds the previous one, as it does past a folder whose
    save was killed mid-write."""
    report = _one_process_report("accelerate_failures.py", tmp_path, "--asynchronous")
    assert report["returned while written"]
    assert report["folders while the second is written"] == ["checkpoint_0", "checkpoint_1"]
    assert report["folders after two saves"] == ["checkpoint_1"]
    assert report["failing save returned"]
    assert report["failed write"].startswith("The asynchronous save to "), report
    assert "pytorch_model_zero_0 failed: " in report["failed write"]
    assert "No space left on device" in report["failed write"]
    assert report["folders after a failed write"] == ["checkpoint_1"]
    assert report["latest loads the second save"]
    # A newer folder whose save was killed mid-write: removed by load_state(), which says so and loads the one
    # before.
    (warned,) = report["after a killed save: warned"]
    assert "removed checkpoint_3 under " in warned and "loading checkpoint_1" in warned, warned
    assert report["after a killed save: folders"] == ["checkpoint_1"]
    assert report["after a killed save: loads the second save"]


def test_what_zero_accelerator_assumes_of_accelerates_save_and_load_state_holds(tmp_path: Path) -> None:
    """ZeroAccelerator's save_state/load_state lean on Accelerate beyond its documented hooks (the
    private _models/_optimizers lists, pruning before saving): a plain Accelerator still behaves so."""
    import accelerate

    report = _one_process_report("accelerate_assumptions.py", tmp_path)
    assert len(report) == 10, report
    broken = [check for check, holds in report.items() if not holds]
    assert not broken, (
        f"Accelerate {accelerate.__version__} no longer behaves as ZeroAccelerator assumes: {broken}. "
        "Review ZeroAccelerator.prepare_model, get_state_dict, save_state and load_state "
        "(accelerate_zero/accelerator.py) against Accelerate's save_state/load_state."
    )


def test_a_read_on_the_main_process_only_fails_at_once_with_the_fix(tmp_path: Path) -> None:
    """`if is_main_process: torch.save(unwrap_model(model).state_dict(), f)` then `wait_for_everyone()`
    at stage 3 waited out the process group's timeout (30 minutes) before a bare gloo error. Now both
    processes fail within seconds with one message naming get_state_dict, which then works; a process
    that leaves while the main one reads is named at once too, and both exit normally.
    Why a process of its own: the subject is how the launched processes end (both exit normally) after a read only
    one of them makes."""
    result = subprocess.run(
        [*ACCELERATE, "launch", "--multi_gpu", "--num_processes", "2", str(Path(SCRIPT).parent / "rank0_reads.py")]
        + [str(tmp_path)],
        env={**os.environ, "ACCELERATE_USE_CPU": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    _checked(result)
    main, other = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1))
    assert main["main only"] == other["main only"]
    assert "rank 0: state_dict() of" in main["main only"] and "rank 1: wait_for_everyone()" in main["main only"]
    assert "accelerator.get_state_dict(model)" in main["main only"]
    assert main["main only seconds"] < 10 and other["main only seconds"] < 10
    assert main["fixed"] and other["fixed"]
    assert "rank 1: exited" in main["after exit"] and main["after exit seconds"] < 10


def test_a_plain_accelerator_or_trainer_under_the_zero_launcher_fails_before_any_step(tmp_path: Path) -> None:
    """A plain Accelerator or Trainer ignores the ZeRO settings and would train with DDP: every process fails
    at its first optimizer step, before any update, with what to change; ZeroAccelerator passes, and so do an
    evaluation forward and a training-mode forward and backward on the model before prepare. Without the check
    the plain cases train (a step file per process).
    Why a process of its own: `accelerate-zero launch` is the subject: its settings reach a script that does not use
    them."""
    env = {**os.environ, "ACCELERATE_USE_CPU": "1"}
    script = str(Path(SCRIPT).parent / "plain_training.py")

    def launch(case: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*ACCELERATE_ZERO, "launch", "--zero_stage", "3", "--multi_gpu", "--num_processes", "2"]
            + ["--main_process_port", str(free_port()), script, str(tmp_path), case],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    cases = ("accelerator", "trainer", "zero")
    with ThreadPoolExecutor(max_workers=3) as launches:  # side by side: each writes its own step files
        outcomes = dict(zip(cases, launches.map(launch, cases)))
    _checked(outcomes["zero"])
    assert sorted(p.name for p in tmp_path.glob("*.rank*")) == ["zero.rank0", "zero.rank1"]
    for case in ("accelerator", "trainer"):
        result = outcomes[case]
        assert result.returncode != 0
        for rank in (0, 1):
            assert f"[rank{rank}]: RuntimeError: accelerate-zero launch: this process started training" in result.stderr
        assert "accelerate_zero.ZeroTrainer instead of Trainer" in result.stderr


def test_the_launcher_runs_scripts_and_modules_through_the_check() -> None:
    from accelerate_zero.launch import plugin_from_arguments, run_through_the_check

    _, script = plugin_from_arguments(["--num_processes", "2", "train.py", "--lr", "1"])
    _, module = plugin_from_arguments(["--num_processes", "2", "-m", "pkg.train", "--lr", "1"])
    _, command = plugin_from_arguments(["--num_processes", "2", "--no_python", "train.sh"])
    for launch_args in (script, module, command):
        run_through_the_check(launch_args)
    assert (script.module, script.training_script, script.training_script_args) == (
        True, "accelerate_zero.launched", ["train.py", "--lr", "1"],
    )  # fmt: skip
    assert module.training_script_args == ["--module", "pkg.train", "--lr", "1"]
    assert (command.training_script, command.training_script_args) == ("train.sh", [])


FP16_SKIPS = """
import json, torch
from accelerate_zero import ZeroAccelerator, ZeroPlugin
from tests.models import TinyTransformer, batch, lm_loss
accelerator = ZeroAccelerator(zero_plugin=ZeroPlugin(stage=3), cpu=True, mixed_precision="fp16")
torch.manual_seed(0)
model = TinyTransformer(batchnorm=False)
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
seen = []
for step in range(5):
    ids = batch(step, 0)
    loss = lm_loss(model(ids), ids)
    accelerator.backward(loss * float("inf") if step == 0 else loss)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    seen.append((accelerator.optimizer_step_was_skipped, optimizer.param_groups[0]["lr"]))
print(json.dumps({"seen": seen, "steps taken": accelerator.engine.steps_taken}))
"""


@pytest.mark.distributed  # a process of its own for Accelerate's once-per-process state
def test_an_fp16_step_skipped_on_overflow_leaves_the_scheduler_as_accelerates_own_fp16_does() -> None:
    """Accelerate's GradScaler path reports a skipped step (``optimizer_step_was_skipped``) and its scheduler
    wrapper (and Hugging Face's Trainer) then do not step the schedule; the engine's loss scaler skips the
    steps here, so the accelerator reports the engine's decision (before, the schedule ran ahead).
    Why a process of its own: Accelerate's fp16 path builds process-wide state (its GradScaler, AcceleratorState)
    that a clean interpreter shows as a user gets it."""
    result = subprocess.run([sys.executable, "-c", FP16_SKIPS], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    seen = report["seen"]
    assert seen[0] == [True, 1e-2]  # an inf loss: skipped, the learning rate unchanged
    applied = 0
    for skipped, lr in seen:
        applied += not skipped
        assert lr == pytest.approx(1e-2 * 0.5**applied)
    assert applied == report["steps taken"] >= 1


SYNC_EACH_BATCH = """
from accelerate.utils import GradientAccumulationPlugin
from accelerate_zero import ZeroAccelerator, ZeroPlugin
early = ZeroPlugin(stage=2, offload_optimizer="cpu", offload_step_in_backward=True)
for sync_each_batch in (False, True):
    accumulation = GradientAccumulationPlugin(num_steps=2, sync_each_batch=sync_each_batch)
    try:
        ZeroAccelerator(zero_plugin=early, cpu=True, gradient_accumulation_plugin=accumulation)
        print("built")
    except ValueError as error:
        print(error)
"""


@pytest.mark.distributed  # a process of its own for Accelerate's once-per-process state
def test_settings_accelerate_cannot_honour_yet_are_refused_before_any_work() -> None:
    """The step during backward with sync_each_batch: every micro-batch's backward would synchronise, and the
    second would be refused mid-step.
    Why a process of its own: Accelerate's process-wide state, built from the script's own arguments, as a user's
    script builds it."""
    result = subprocess.run(
        [sys.executable, "-c", SYNC_EACH_BATCH],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    without, with_it = result.stdout.strip().splitlines()[-2:]
    assert without == "built"
    assert "GradientAccumulationPlugin(sync_each_batch=True) synchronises every micro-batch's: drop" in with_it
