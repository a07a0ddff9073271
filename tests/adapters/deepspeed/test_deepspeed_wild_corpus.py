"""The training configs of the wild corpus (tests/deepspeed_configs/wild/, each with its source in SOURCES.md: TRL's,
open-instruct's, LLaMA-Factory's, ms-swift's, xtuner's, Accelerate's guide's, Megatron-DeepSpeed's, DeepSpeedExamples')
train with no edit through the entry point each was written for, equal bit for bit (losses and final weights) to
the same settings written natively. One launch per entry point runs all of its files, the three side by side."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.paths import TESTS
from tests.rank_pool import free_port
from zero_core.deepspeed import from_deepspeed

WILD = TESTS / "deepspeed_configs" / "wild"
SCRIPTS = TESTS / "scripts"

# Each entry point's files (their stems), with what each means: (stage, [offload_optimizer, offload_params],
# mixed precision). The first of each launch is the one its launcher reads.
LIGHTNING = {  # ZeroStrategy(config=file) under Lightning's Trainer (wild_corpus_lightning.py)
    "megatron_deepspeed_tests_ds_config": dict(accumulate=8, clip=1.0),  # 16 = 1 micro-batch x 8 x 2 ranks
    "deepspeed_examples_bf16_master_weight_baseline": dict(accumulate=1, clip=None),
}
ACCELERATE = {  # accelerate-zero launch over a plain Accelerate loop (wild_corpus_accelerate.py)
    "accelerate_docs_zero2_plugin": (2, ["none", "none"], "fp16"),
    "accelerate_docs_zero3_cpu_offload_plugin": (3, ["cpu", "cpu"], "fp16"),
    "open_instruct_deepspeed_zero2": (2, ["none", "none"], "bf16"),
    "open_instruct_stage3_offloading_accelerate": (3, ["cpu", "cpu"], "bf16"),
}
ACCELERATE_LAUNCH = ["--config_file", str(WILD / "accelerate_docs_zero2_plugin.yaml")]
TRAINER = {  # ZeroTrainer, by the launcher and (DeepSpeed configs) by ZeroTrainingArguments (wild_corpus_trainer.py)
    "trl_deepspeed_zero3": (3, ["none", "none"], "bf16"),
    "trl_deepspeed_zero1": (1, ["none", "none"], "bf16"),
    "trl_tests_zero2": (2, ["none", "none"], "no"),
    "llamafactory_ds_z2_config": (2, ["none", "none"], "fp16"),
    "llamafactory_ds_z3_offload_config": (3, ["cpu", "cpu"], "no"),
    "llamafactory_ds_z3_fp8_config": (3, ["cpu", "none"], "bf16"),
    "ms_swift_zero1": (1, ["none", "none"], "no"),
    "ms_swift_zero3": (3, ["none", "none"], "bf16"),
    "xtuner_deepspeed_zero2_offload": (2, ["cpu", "none"], "no"),
    "open_instruct_stage3_no_offloading": (3, ["none", "none"], "no"),  # its AdamW and WarmupDecayLR sections
}
TRAINER_LAUNCH = ["--config_file", str(WILD / "trl_deepspeed_zero3.yaml")]
STAGE_ZERO = "llamafactory_ds_z0_config"  # refused by design: stage 0 is no ZeRO


def _files() -> list[Path]:
    return sorted(p for p in WILD.iterdir() if p.name != "SOURCES.md")


@pytest.fixture
def restored_environment() -> Iterator[None]:
    """The launcher's reading sets and clears variables in this process: put them back."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.usefixtures("restored_environment")
def test_every_wild_file_has_its_source_an_entry_point_and_is_read() -> None:
    """Each file: a SOURCES.md row, one entry point here; each DeepSpeed config read by ``from_deepspeed`` and each
    Accelerate YAML by ``accelerate-zero launch --config_file`` without a refusal (the stage-0 one aside)."""
    from accelerate_zero.launch import plugin_from_arguments

    files = _files()
    assert len(files) >= 12
    sources = (WILD / "SOURCES.md").read_text()
    groups = [*LIGHTNING, *ACCELERATE, *TRAINER, STAGE_ZERO]
    assert sorted(groups) == sorted(p.stem for p in files)  # each file in exactly one group
    refused = []
    for file in files:
        assert f"| `{file.name}` |" in sources, f"{file.name}: note its source in SOURCES.md"
        if file.stem == STAGE_ZERO:
            continue
        try:
            if file.suffix == ".yaml":
                plugin_from_arguments(["--config_file", str(file), "--num_processes", "2", "train.py"])
            else:
                from_deepspeed(file)
        except ValueError as error:
            refused.append(f"{file.name}: {error}")
    assert not refused, "\n".join(refused)  # every refusal at once


@pytest.mark.usefixtures("restored_environment")
def test_the_stage_0_file_is_refused_naming_the_file_the_key_and_the_fix() -> None:
    from accelerate_zero.launch import plugin_from_arguments

    file = WILD / f"{STAGE_ZERO}.json"
    for read in (
        lambda: from_deepspeed(file),
        lambda: plugin_from_arguments(["--zero_config_file", str(file), "--multi_gpu", "train.py"]),
    ):
        with pytest.raises(ValueError) as refused:
            read()
        message = str(refused.value)
        assert str(file) in message and "zero_optimization.stage=0" in message and "plain DDP" in message


def _accelerate_command(script: str, launch: list[str], out: Path, cases: list[str]) -> list[str]:
    command = [sys.executable, "-m", "accelerate_zero.launch", "launch", *launch]
    command += ["--multi_gpu", "--num_processes", "2", "--main_process_port", str(free_port())]
    return [*command, str(SCRIPTS / script), str(out), *cases]


def _commands(out: Path) -> dict[str, tuple[list[str], dict[str, str]]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_ZERO", "ACCELERATE_USE_ZERO"))}
    configs = [str(WILD / f"{name}.json") for name in LIGHTNING]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    lightning = [*torchrun, "--master_port", str(free_port()), str(SCRIPTS / "wild_corpus_lightning.py")]
    return {
        "lightning": ([*lightning, str(out / "lightning"), *configs], {**env, "DS_ACCELERATOR": "cpu"}),
        "accelerate": (
            _accelerate_command("wild_corpus_accelerate.py", ACCELERATE_LAUNCH, out / "accelerate", [*ACCELERATE]),
            {**env, "ACCELERATE_USE_CPU": "1"},
        ),
        "trainer": (
            _accelerate_command("wild_corpus_trainer.py", TRAINER_LAUNCH, out / "trainer", [*TRAINER]),
            {**env, "ACCELERATE_USE_CPU": "1"},
        ),
    }


_TESTS = {
    "test_lightning_files_train_as_their_settings_and_as_deepspeed": "lightning",
    "test_accelerate_loop_files_train_as_the_native_flags": "accelerate",
    "test_trainer_files_train_as_the_native_flags_by_every_route": "trainer",
}


@pytest.fixture(scope="module")
def launches(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, tuple[Path, Future[subprocess.CompletedProcess]]]]:
    """The launches of the selected tests below, started together (each keeps about one core busy)."""
    selected = {getattr(item, "originalname", None) for item in request.session.items if item.module is request.module}
    wanted = [entry for test, entry in _TESTS.items() if test in selected]
    out = tmp_path_factory.mktemp("wild")
    commands = _commands(out)
    with ThreadPoolExecutor(max_workers=3) as pool:
        started = {}
        for entry in wanted:
            (out / entry).mkdir()
            command, env = commands[entry]
            run = pool.submit(subprocess.run, command, env=env, capture_output=True, text=True, timeout=600)
            started[entry] = (out / entry, run)
        yield started


def _finished(launches: dict, entry: str) -> Path:
    out, run = launches[entry]
    result = run.result()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return out


def _equal_weights(ours: dict, reference: dict, name: str) -> None:
    assert ours.keys() == reference.keys(), name
    for parameter, values in reference.items():
        assert torch.equal(torch.tensor(ours[parameter]), torch.tensor(values)), (name, parameter)


# Settings a route may hold apart from its native run without a number changing here: bf16.check_grad_overflow
# (DeepSpeed's default on) may read as skipping non-finite steps, and no step of these runs meets one (their
# losses agree); the fp16 loss-scaling knobs act only when the run is fp16 (then they must agree).
_MAY_DIFFER = {"skip_nonfinite_steps"}
_LOSS_SCALING = {"loss_scale", "initial_loss_scale", "loss_scale_window", "loss_scale_hysteresis"}
_LOSS_SCALING |= {"consecutive_hysteresis", "min_loss_scale"}


def _same_settings(run: dict, native: dict, name: str) -> None:
    ignored = _MAY_DIFFER | (set() if native["mixed_precision"] == "fp16" else _LOSS_SCALING)
    differ = {k: (v, native["settings"][k]) for k, v in run["settings"].items() if v != native["settings"][k]}
    assert not differ.keys() - ignored, (name, differ)  # the native flags mean what the file means


def _ran(name: str, run: dict) -> dict:
    assert "error" not in run, f"{name}: {run.get('error')}\n{run.get('traceback', '')}"
    return run


def test_lightning_files_train_as_their_settings_and_as_deepspeed(launches: dict) -> None:
    """Plain DeepSpeed JSONs under ``ZeroStrategy(config=file)``: Megatron-DeepSpeed's test config accumulates the
    8 micro-batches its ``train_batch_size`` 16 means on 2 ranks of micro-batch 1, as DeepSpeed's engine does
    (DeepSpeed itself the second reference, bit for bit), clipping at its 1.0; DeepSpeedExamples' bf16 ZeRO-3
    baseline builds its AdamW section. Each equals ZeroStrategy(stage=...) with the Trainer's own accumulation,
    clipping and optimizer. fp16 is not honoured on this CPU: the Megatron file runs with its fp16 section
    switched off and precision "32-true" (wild_corpus_lightning.py), that key alone overridden."""
    pytest.importorskip("deepspeed")
    out = _finished(launches, "lightning")
    for name, expected in LIGHTNING.items():
        report = json.loads((out / f"{name}.json").read_text())
        file, hand = report["file"], report["hand"]
        assert (file["accumulate"], file["clip"]) == (expected["accumulate"], expected["clip"]), name
        assert len(file["losses"]) == 3 * expected["accumulate"], name  # 3 steps, every micro-batch
        assert file["losses"] == hand["losses"], name
        _equal_weights(file["weights"], hand["weights"], name)
        assert file["optimizer"] == "AdamW"
        if "deepspeed" in report:
            assert report["deepspeed"]["accumulate"] == expected["accumulate"]
            assert report["deepspeed"]["losses"] == file["losses"], name
            _equal_weights(report["deepspeed"]["weights"], file["weights"], name)


def test_accelerate_loop_files_train_as_the_native_flags(launches: dict) -> None:
    """Accelerate YAMLs (Accelerate's guide's, with ``gradient_clipping: 1.0`` in the block and fp16; open-instruct's,
    with ``deepspeed_multinode_launcher: standard``) under ``accelerate-zero launch --config_file``, and
    open-instruct's "auto" DeepSpeed config under ``--deepspeed_config_file``, over a loop with its own AdamW: losses,
    skipped fp16 steps and weights those of ``--zero_stage N`` (offload and precision flags alike), clipping at
    1.0 in the loop where the file clips (its 1.0, or "auto": 1.0 under Accelerate). fp16 runs on this CPU."""
    out = _finished(launches, "accelerate")
    for index, (name, settings) in enumerate(ACCELERATE.items()):
        report = json.loads((out / f"{name}.json").read_text())
        if index == 0:
            assert report["reread_matches_launcher"]  # the script reads the others as the launcher did this one
        file, native = _ran(name, report["file"]), _ran(name, report["native"])
        assert (file["stage"], file["offload"], file["mixed_precision"]) == settings, name
        assert (native["stage"], native["offload"], native["mixed_precision"]) == settings, name
        assert file["accumulation"] == native["accumulation"] == 1, name
        _same_settings(file, native, name)
        assert file["skipped"] == native["skipped"] and file["losses"] == native["losses"], name
        _equal_weights(file["weights"], native["weights"], name)
        ran = [i for i, skipped in enumerate(native["skipped"]) if not skipped]
        assert len(ran) >= 4, name  # the comparison means something: steps taken, and clipped where it clips
        if native["norms"]:
            assert all(native["norms"][i] > 1.0 for i in ran), (name, native["norms"])


def test_trainer_files_train_as_the_native_flags_by_every_route(launches: dict) -> None:
    """``ZeroTrainer`` on each Trainer file: TRL's YAMLs (``deepspeed_multinode_launcher: standard``) through
    ``accelerate-zero launch --config_file``; the "auto" DeepSpeed configs (LLaMA-Factory's, with
    ``comms_config``/``monitor_config`` in one; ms-swift's; xtuner's; open-instruct's, with "auto" optimizer and
    scheduler sections) through ``ZeroTrainingArguments(deepspeed=FILE)`` and through the launcher's DeepSpeed
    config (``--zero_config_file``, or ``--deepspeed_config_file`` for the .conf). Every route's losses, rates and
    weights are those of the Trainer launched with ``--zero_stage N`` and the flags of what else the file means
    (offload, stage 3's hidden-size "auto"s as transformers fills them, fp16 loss scaling), given the sections'
    AdamW and WarmupDecayLR as ``optimizers=`` where the file has them; each route trains with the native run's
    settings. Precision: the files' fp16 and bf16 "auto" follow the TrainingArguments (fp16, bf16 or fp32: each
    runs on this CPU), TRL's YAMLs give bf16."""
    pytest.importorskip("transformers")
    out = _finished(launches, "trainer")
    for index, (name, settings) in enumerate(TRAINER.items()):
        report = json.loads((out / f"{name}.json").read_text())
        if index == 0:
            assert report["reread_matches_launcher"]
        routes = ["file"] if name.startswith("trl_") else ["file", "arguments"]
        assert sorted(k for k in report if k not in ("reread_matches_launcher",)) == sorted(["native", *routes])
        native = _ran(f"{name} native", report["native"])
        assert (native["stage"], native["offload"], native["mixed_precision"]) == settings, name
        for route in routes:
            run = _ran(f"{name} {route}", report[route])
            assert (run["stage"], run["offload"], run["mixed_precision"]) == settings, (name, route)
            assert (run["optimizer"], run["scheduler"]) == (native["optimizer"], native["scheduler"]), (name, route)
            _same_settings(run, native, f"{name} {route}")
            assert len(run["losses"]) == 4 and run["losses"] == native["losses"], (name, route)
            assert run["lrs"] == native["lrs"], (name, route)
            _equal_weights(run["weights"], native["weights"], f"{name} {route}")
        if name == "open_instruct_stage3_no_offloading":
            assert native["scheduler"] == "WarmupDecayLR" and max(native["lrs"]) > 0
