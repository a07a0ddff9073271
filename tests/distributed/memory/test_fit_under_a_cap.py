"""The promise fit() makes, kept under real caps: each rank of a 2-rank job in a memory cgroup of its own,
limited to the budget fit() was given. For three budgets, the smallest of which the in-memory run does not
fit, the chosen settings train inside the cap with a measured peak within 10% of the prediction, and the
same settings one notch cheaper (without checkpointing), predicted not to fit, are killed by the same cap.

The peak is the cgroup's own count (what the cap holds to) and what each rank holds besides training is
measured first, the same way (``overhead_bytes``). glibc keeps freed tensors below its mmap threshold
resident, and that threshold grows to 32 MiB as large tensors are freed; the ranks fix it at 1 MiB
(``MALLOC_MMAP_THRESHOLD_``), as docs/memory-budget.md tells CPU users to, so that resident memory follows
what is in use. Three steps a run: the peak is reached in the second step (the optimizer state exists from
the first) and repeats in every later one, so the third shows it held; 5-step runs (until 2026-12-07) and
20-step runs of the same three choices stayed inside their caps too (the closing note of issue 53), the
20-step ones at 55-85 s each, too long for the suite.

Why processes of their own: each rank must run in a memory cgroup of its own, which a kept rank cannot join.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.memory_cgroups import entering, memory_cgroups_writable, new_memory_cgroup, oom_kills, peak_bytes
from tests.paths import TESTS
from tests.rank_pool import free_port
from zero_core import fit
from zero_core.memory.fit import FitCandidate, FitResult

SCRIPT = TESTS / "scripts" / "fit_cap.py"
MiB = 2**20
# Each takes other settings: checkpointing in memory; the optimizer state on disk; the parameters on disk too.
BUDGETS_MIB = (930, 610, 560)
STEPS = 3

spec = importlib.util.spec_from_file_location("fit_cap", SCRIPT)
fit_cap = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fit_cap)


pytestmark = pytest.mark.skipif(
    not memory_cgroups_writable(), reason="needs the cgroup-v1 memory controller, writable (root)"
)


def _job(name: str, spec: dict, cap: int | None, tmp_path: Path) -> list[dict]:
    """The two ranks of fit_cap.py, each in a memory cgroup of its own limited to ``cap`` bytes; when one
    rank ends in failure the other is stopped (it would wait for its peer). Returns per rank: its exit code,
    its report (empty if it wrote none), the most memory its cgroup held (what the cap holds to: what the
    rank faulted in, not the library pages another process had already read), how many processes the
    kernel killed in it for memory, and the end of its stderr."""
    spec_path, out = tmp_path / f"{name}.json", tmp_path / name
    spec_path.write_text(json.dumps(spec))
    port, groups, ranks, kills, peaks = free_port(), [], [], [], []
    try:
        for rank in range(2):
            group = new_memory_cgroup(f"fit-{name}-{rank}", cap)
            groups.append(group)
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(TESTS.parent), "RANK": str(rank)}
            env["MALLOC_MMAP_THRESHOLD_"] = str(MiB)  # resident memory follows what is in use (the docstring)
            env.update(WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            command = entering(group, [sys.executable, str(SCRIPT), str(spec_path), str(out)])
            ranks.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        _wait_for_both(ranks)
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
            process.wait()
        for group in groups:
            kills.append(oom_kills(group))
            peaks.append(peak_bytes(group))
            group.rmdir()
    results = []
    for rank, process in enumerate(ranks):
        report = Path(f"{out}.{rank}.json")
        stderr = process.stderr.read().decode(errors="replace")[-2000:]
        process.stderr.close()
        results.append(
            dict(
                code=process.returncode,
                report=json.loads(report.read_text()) if report.exists() else {},
                peak=peaks[rank],
                oom_kills=kills[rank],
                stderr=stderr,
            )
        )
    return results


def _wait_for_both(ranks: list[subprocess.Popen]) -> None:
    """Until both ranks end, or one fails: its peer would wait for it (the caller stops it)."""
    while any(process.poll() is None for process in ranks):
        if any(process.poll() not in (None, 0) for process in ranks):
            return
        try:
            next(process for process in ranks if process.poll() is None).wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass


def _spec(candidate: FitCandidate, offload_dir: Path, steps: int) -> dict:
    config = candidate.config
    settings = dict(stage=config.stage, prefetch=config.prefetch, offload_optimizer=config.offload_optimizer)
    settings.update(offload_params=config.offload_params, offload_fraction=config.offload_fraction)
    settings.update(offload_dir=str(offload_dir), persistence_threshold=0)
    return dict(
        settings=settings,
        micro_batch=candidate.micro_batch_size,
        accumulation=candidate.gradient_accumulation_steps,
        checkpointing=candidate.activation_checkpointing,
        steps=steps,
    )


def _without_checkpointing(result: FitResult) -> FitCandidate:
    """The choice one notch cheaper: the same settings and micro-batch, without checkpointing."""
    chosen = result.choice
    assert chosen.activation_checkpointing, chosen.describe()  # each budget below is one that checkpoints
    return next(
        c
        for c in result.candidates
        if c.config == chosen.config
        and c.micro_batch_size == chosen.micro_batch_size
        and not c.activation_checkpointing
    )


def test_the_chosen_settings_train_inside_the_cap_and_one_notch_cheaper_is_killed(tmp_path: Path) -> None:
    # What each rank's process holds besides training, on this machine: the same script, nothing trained.
    idle = _job("idle", {"settings": None}, None, tmp_path)
    assert [rank["code"] for rank in idle] == [0, 0], idle[0]["stderr"]
    overhead = max(rank["peak"] for rank in idle)
    sample = torch.zeros(4, fit_cap.SEQ, dtype=torch.long)
    in_memory_peaks, seen = [], []
    for budget_mib in BUDGETS_MIB:
        budget = budget_mib * MiB
        result = fit(
            fit_cap.CapModel,
            sample,
            world_size=2,
            budget=budget,
            wrap_policy=fit_cap.CAP_UNITS,
            loss_fn=fit_cap.cap_loss,
            device="cpu",
            offload_dir=str(tmp_path),
            overhead_bytes=overhead,
        )
        chosen, cheaper = result.choice, _without_checkpointing(result)
        seen.append(chosen.describe())
        ranks = _job(f"b{budget_mib}-chosen", _spec(chosen, tmp_path, STEPS), budget, tmp_path)
        for rank in ranks:
            assert rank["code"] == 0, f"{chosen.describe()} under {budget_mib} MiB: {rank}"
            assert len(rank["report"]["losses"]) == STEPS
            peak, predicted = rank["peak"], chosen.predicted.device
            phases = rank["report"]["phases"]
            assert abs(peak - predicted) <= 0.1 * predicted, (chosen.describe(), peak / MiB, predicted / MiB, phases)
        ranks = _job(f"b{budget_mib}-cheaper", _spec(cheaper, tmp_path, 2), budget, tmp_path)
        assert sum(rank["oom_kills"] for rank in ranks) >= 1, f"{cheaper.describe()} under {budget_mib} MiB: {ranks}"
        in_memory = [c for c in result.candidates if not c.placement]
        in_memory_peaks.append(min(c.predicted.device for c in in_memory))
    # The three budgets took three different settings, and the smallest fits no in-memory run.
    assert len(set(seen)) == 3, seen
    assert in_memory_peaks[-1] > BUDGETS_MIB[-1] * MiB * (1 - 0.1)
