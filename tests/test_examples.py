"""The README's main job and the Lightning example run as documented."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
LAUNCHES = 3


def _quick_start(steps: int) -> subprocess.CompletedProcess:
    """The README's main job: torchrun, 2 processes."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        str(EXAMPLES / "train_zero3.py"),
        "--steps",
        str(steps),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def trained() -> subprocess.CompletedProcess:
    return _quick_start(steps=6)


def test_quick_start_job_trains_and_reports_memory(trained: subprocess.CompletedProcess) -> None:
    result = trained
    assert result.returncode == 0, result.stderr[-4000:]
    losses = [float(line.split("loss")[1]) for line in result.stdout.splitlines() if line.startswith("step")]
    assert len(losses) >= 2 and losses[-1] < losses[0]
    reports = [line for line in result.stdout.splitlines() if line.startswith("rank ")]
    assert len(reports) == 2 and all("stage 3" in line and "DDP would hold" in line for line in reports)


def test_lightning_example_trains_with_zero3() -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "lightning_gpt.py"), "--max-steps", "10"],  # under 20: validates too
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "final train_loss" in result.stdout and "val_perplexity" in result.stdout
    assert sum(line.startswith("rank ") for line in result.stdout.splitlines()) == 2


def test_quick_start_job_exits_cleanly_every_time(trained: subprocess.CompletedProcess) -> None:
    """A finished job must not abort at exit (torchrun would report it failed): 3 launches (the
    training one above and shorter ones), each exits 0 with nothing from std::terminate. (Every
    process the other tests spawn has its exit code checked too, in tests/distributed.py:
    hundreds of teardowns per run.)"""
    failures = []
    for result in [trained] + [_quick_start(steps=1) for _ in range(LAUNCHES - 1)]:
        if result.returncode != 0 or "terminate called" in result.stderr:
            failures.append((result.returncode, result.stderr[-2000:]))
    assert not failures, f"{len(failures)} of {LAUNCHES} launches did not exit cleanly; first: {failures[0]}"
