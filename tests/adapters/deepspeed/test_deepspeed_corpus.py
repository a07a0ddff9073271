"""The DeepSpeed configs users already have (tests/deepspeed_configs/, each with its source in SOURCES.md) train
with no edit, through the entry point each was written for, equal to DeepSpeed itself where it runs on this CPU and
otherwise to the same settings written our way."""

from __future__ import annotations

import json
import os
import shutil
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

CORPUS = TESTS / "deepspeed_configs"
SCRIPTS = TESTS / "scripts"
# Written for a script that builds its own optimizer (Lightning's presets, DeepSpeed's tutorials).
LIGHTNING = (
    "deepspeed_tutorial_zero1",  # DeepSpeed itself is the reference for these three
    "deepspeed_tutorial_zero2",
    "lightning_deepspeed_stage_2",
    "deepspeed_tutorial_zero_infinity_cpu",  # offload: the same settings as keywords
    "lightning_deepspeed_stage_3_offload",
    "lightning_deepspeed_stage_3_offload_nvme",  # ZeRO-Infinity on Lightning's default path, /local_nvme
)
NVME_PATH = Path("/local_nvme")


def test_every_config_of_the_corpus_is_read_and_has_its_source() -> None:
    files = sorted(CORPUS.glob("*.json"))
    assert len(files) >= 12
    sources = (CORPUS / "SOURCES.md").read_text()
    for file in files:
        assert f"| `{file.name}` |" in sources, f"{file.name}: note its source in SOURCES.md"
        from_deepspeed(file)  # each is read without a refusal


def _run_lightning_group(out: Path) -> subprocess.CompletedProcess:
    """Why a process of its own: DeepSpeed itself is the reference, and it runs only under a launcher (torchrun)
    with its own process-wide state."""
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
        + [str(SCRIPTS / "deepspeed_corpus_lightning.py"), str(out)]
        + [str(CORPUS / f"{name}.json") for name in LIGHTNING],
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
        capture_output=True,
        text=True,
        timeout=600,
    )


# Accelerate's templates, written for a script that passes DummyOptim/DummyScheduler (fp16, AdamW, WarmupDecayLR).
ACCELERATE = (
    "accelerate_zero_stage1_config",
    "accelerate_zero_stage2_config",
    "accelerate_zero_stage2_offload_config",
    "accelerate_zero_stage3_config",
    "accelerate_zero_stage3_offload_config",
)


@pytest.fixture(scope="module")
def templates_launch(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Path, Future[subprocess.CompletedProcess]] | None]:
    """The launch of ``test_accelerates_templates_train_as_their_settings_written_our_way`` (where that test is
    selected), started in the background by the Lightning test before it, which runs beside it: each keeps about
    one of two cores busy."""
    selected = {getattr(item, "originalname", None) for item in request.session.items if item.module is request.module}
    if "test_accelerates_templates_train_as_their_settings_written_our_way" not in selected:
        yield None
        return
    out = tmp_path_factory.mktemp("accelerate-templates")
    configs = [CORPUS / f"{name}.json" for name in ACCELERATE]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_ZERO", "ACCELERATE_USE_ZERO"))}
    command = [sys.executable, "-m", "accelerate_zero.launch", "launch", "--zero_config_file", str(configs[0])]
    command += ["--multi_gpu", "--num_processes", "2", "--main_process_port", str(free_port())]
    command += [str(SCRIPTS / "deepspeed_corpus_accelerate.py"), str(out), *map(str, configs)]
    env = {**env, "ACCELERATE_USE_CPU": "1"}
    with ThreadPoolExecutor(max_workers=1) as background:
        run = background.submit(subprocess.run, command, env=env, capture_output=True, text=True, timeout=600)
        yield out, run


@pytest.mark.usefixtures("templates_launch")  # starts the next test's launch, to run beside this one
def test_configs_for_a_scripts_own_optimizer_train_as_deepspeed_or_their_settings(tmp_path: Path) -> None:
    """Under Lightning's Trainer with ``ZeroStrategy(config=file)``: DeepSpeed's ZeRO-1/ZeRO-2 tutorial configs and
    Lightning's stage-2 preset give DeepSpeed's own losses and weights bit for bit (fp32, one micro-batch a step,
    DeepSpeed handed the file as Lightning's DeepSpeed strategy hands it); the offloading ones (DeepSpeed's CPU
    offload needs its compiled CPU Adam) equal the same settings given as keywords."""
    pytest.importorskip("deepspeed")
    made_nvme_path = not NVME_PATH.exists()
    try:
        NVME_PATH.mkdir(exist_ok=True)  # the preset's nvme_path, as a user of it has it
    except OSError:
        pytest.skip(f"{NVME_PATH} cannot be made here (the nvme preset needs it, as under DeepSpeed)")
    try:
        result = _run_lightning_group(tmp_path)
    finally:
        if made_nvme_path:
            shutil.rmtree(NVME_PATH, ignore_errors=True)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]
    for name in LIGHTNING:
        report = json.loads((tmp_path / f"{name}.json").read_text())
        reference, ours = torch.tensor(report["reference"]), torch.tensor(report["ours"])
        assert len(ours) == len(reference) == 8, name  # 8 steps of one micro-batch
        assert torch.equal(ours, reference), (name, ours, reference)
        for parameter, (theirs, mine) in report["weights"].items():
            assert torch.equal(torch.tensor(theirs), torch.tensor(mine)), (name, parameter)


def test_accelerates_templates_train_as_their_settings_written_our_way(templates_launch: tuple | None) -> None:
    """Accelerate's DeepSpeed templates, each unedited under ``accelerate-zero launch --zero_config_file FILE`` with
    a script written for Accelerate's DeepSpeed integration (DummyOptim, DummyScheduler): losses, rates, skipped
    fp16 steps and final weights bit for bit those of the same run written our way (ZeroPlugin with the stage,
    offload and fp16 loss scaling the file means, torch's AdamW, WarmupDecayLR built by hand, clipping at 1.0 in
    the loop). DeepSpeed itself cannot be the reference: its fp16 and its CPU offload (compiled CPU Adam) do not
    run on this CPU. One launch: the launcher reads the first file, the script reads the others as it does."""
    assert templates_launch is not None
    tmp_path, launch = templates_launch
    result = launch.result()
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]
    first = json.loads((tmp_path / f"{ACCELERATE[0]}.json").read_text())
    assert first["reread_matches_launcher"]  # the script reads the others into what the launcher would set
    for name in ACCELERATE:
        report = json.loads((tmp_path / f"{name}.json").read_text())
        built, hand = report["config"], report["hand"]
        assert built["optimizer"] == hand["optimizer"] == "AdamW", name
        assert built["mixed_precision"] == "fp16" and built["stage"] == hand["stage"] == int(name.split("stage")[1][0])
        assert built["skipped"] == hand["skipped"], name  # fp16 overflows: the same steps skipped
        assert built["lrs"] == hand["lrs"] and built["losses"] == hand["losses"], name
        assert built["weights"] == hand["weights"], name
        # The comparison means something: steps ran at a rate above 0, clipped (their norm above 1.0).
        ran = [i for i, skipped in enumerate(hand["skipped"]) if not skipped and hand["lrs"][i] > 0]
        assert len(ran) >= 3 and all(hand["norms"][i] > 1.0 for i in ran), (name, hand)
