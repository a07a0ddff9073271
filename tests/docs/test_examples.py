"""The quick start's main job (docs/quick-start.md) and the Lightning example run as documented."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.paths import ROOT

pytestmark = pytest.mark.distributed

EXAMPLES = ROOT / "examples"
LAUNCHES = 2


def _quick_start(steps: int) -> subprocess.CompletedProcess:
    """The quick start's main job: torchrun, 2 processes."""
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


def _lightning_example() -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(EXAMPLES / "lightning_gpt.py"), "--max-steps", "10"],  # under 20: validates too
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def examples() -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    """The quick start's job and the Lightning example side by side (each keeps about one of two cores busy;
    torchrun takes its default port, Lightning a free one)."""
    with ThreadPoolExecutor(max_workers=2) as runs:
        quick_start, lightning = runs.submit(_quick_start, 6), runs.submit(_lightning_example)
        return quick_start.result(), lightning.result()


@pytest.fixture(scope="module")
def trained(examples: tuple) -> subprocess.CompletedProcess:
    return examples[0]


def test_quick_start_job_trains_and_reports_memory(trained: subprocess.CompletedProcess) -> None:
    result = trained
    assert result.returncode == 0, result.stderr[-4000:]
    losses = [float(line.split("loss")[1]) for line in result.stdout.splitlines() if line.startswith("step")]
    assert len(losses) >= 2 and losses[-1] < losses[0]
    reports = [line for line in result.stdout.splitlines() if line.startswith("rank ")]
    assert len(reports) == 2 and all("stage 3" in line and "DDP would hold" in line for line in reports)


def test_lightning_example_trains_with_zero3(examples: tuple) -> None:
    result = examples[1]
    assert result.returncode == 0, result.stderr[-4000:]
    assert "final train_loss" in result.stdout and "val_perplexity" in result.stdout
    assert sum(line.startswith("rank ") for line in result.stdout.splitlines()) == 2
    # One line at setup (rank 0, as Lightning logs its own strategies) says what ZeRO does.
    setup_lines = [line for line in (result.stdout + result.stderr).splitlines() if "ZeRO stage 3: " in line]
    assert len(setup_lines) == 1 and "sharded over 2 of 2 ranks" in setup_lines[0], result.stderr[-3000:]


@contextlib.contextmanager
def busy_machine() -> Iterator[None]:
    """A busy loop per core beside what runs inside: teardown races show under load."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def test_runs_exit_cleanly_every_time_under_load(trained: subprocess.CompletedProcess) -> None:
    """A finished job must not abort at exit (torchrun would report it failed): the training launch
    above, then, beside a busy loop per core, shorter launches of the quick start and a Lightning run at
    stage 2 that validates between steps (where an abort was seen). Each exits 0 with nothing from
    std::terminate. (A world started for one body has its exit codes checked too, in
    tests/rank_pool.py.)"""
    lightning = [sys.executable, str(EXAMPLES / "lightning_gpt.py"), "--strategy", "zero2", "--max-steps", "10"]
    with busy_machine():
        results = [trained] + [_quick_start(steps=1) for _ in range(LAUNCHES - 1)]
        results.append(subprocess.run(lightning, capture_output=True, text=True, timeout=600))
    failures = [(r.returncode, r.stderr[-2000:]) for r in results if r.returncode or "terminate called" in r.stderr]
    assert not failures, f"{len(failures)} of {len(results)} launches did not exit cleanly; first: {failures[0]}"


# A process group that the script leaves alive (Lightning destroys gloo's at exit for nobody).
_LEFT_ALIVE = """
import atexit, os, sys
# Registered before torch is imported: atexit runs it after the clean-up (last in, first out).
atexit.register(lambda: print("group alive after zero_core's clean-up:",
                              sys.modules["torch.distributed"].is_initialized(), flush=True))
import torch, torch.distributed as dist
sys.path.insert(0, {root!r})
from tests.models import TinyTransformer, make_optimizer
from zero_core import ZeroConfig, ZeroEngine
# Registered after the import, before the engine arms the clean-up: the group is still there for it.
atexit.register(lambda: print("group alive for the script's own handler:", dist.is_initialized(), flush=True))
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT={port!r}, RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
model = TinyTransformer()
ZeroEngine(model, make_optimizer("adamw", model), ZeroConfig(stage=3))
"""

# Importing the packages registers no exit handler and arms nothing (the engine arms the clean-up).
_IMPORT_ONLY = """
import atexit, torch
registered = []
register = atexit.register
atexit.register = lambda fn, *args, **kwargs: registered.append(fn) or register(fn, *args, **kwargs)
import zero_core, lightning_zero, accelerate_zero
from zero_core.collectives import context
ours = [fn for fn in registered if fn.__module__.split(".")[0] in ("zero_core", "lightning_zero", "accelerate_zero")]
assert not ours and context._armed is None, ours
print("nothing registered;", len(registered), "handlers from torch's own imports")
"""


def test_importing_the_packages_registers_nothing_at_exit() -> None:
    result = subprocess.run([sys.executable, "-c", _IMPORT_ONLY], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "nothing registered" in result.stdout, result.stderr[-3000:]


def test_a_group_left_alive_is_destroyed_at_exit_before_the_interpreter_goes() -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    script = _LEFT_ALIVE.format(root=str(EXAMPLES.parent), port=port)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    # atexit is last in, first out: the first probe runs after the clean-up, the second before it.
    assert "group alive after zero_core's clean-up: False" in result.stdout, result.stdout + result.stderr
    assert "group alive for the script's own handler: True" in result.stdout, result.stdout + result.stderr
