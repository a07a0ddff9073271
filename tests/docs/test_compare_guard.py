"""The step guard (benchmarks/compare.py, docs/benchmarks.md) end to end, on the small model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import ROOT

pytestmark = pytest.mark.distributed

COMPARE = [sys.executable, str(ROOT / "benchmarks" / "compare.py")]


def _worktrees() -> str:
    return subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def test_the_guard_steps_this_tree_against_a_revision_and_the_same_code_gives_the_same_losses(tmp_path: Path) -> None:
    """Why a process of its own: the guard is a command that starts two worlds of ranks and a git worktree."""
    before = _worktrees()
    result = subprocess.run(
        [*COMPARE, "--baseline", "HEAD", "--contestants", "zero3", "--size", "small", "--rounds", "2", "--pairs", "3"]
        + ["--wait", "0", "--quiet-cores", "1000", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    record = json.loads((tmp_path / "record.json").read_text())
    (row,) = record["comparisons"]
    assert row["name"] == "zero3" and row["wall"]["pairs"] == 6 and len(row["round_ratios"]) == 2
    # Both sides ran REV's and this tree's packages on the same batches: with the same code, the same losses.
    assert row["largest_loss_difference"] == 0
    assert row["sides"][0]["tree"] != row["sides"][1]["tree"]
    assert row["wall"]["low"] <= row["wall"]["ratio"] <= row["wall"]["high"]
    assert "| zero3 |" in result.stdout
    assert _worktrees() == before  # the baseline's worktree is gone


def test_a_revision_that_is_not_one_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """Why a process of its own: the guard's command line is the subject."""
    result = subprocess.run(
        [*COMPARE, "--baseline", "no-such-revision", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "'no-such-revision' is not a revision of this repository" in result.stderr


def test_a_side_whose_tree_was_not_imported_stops_with_its_ranks_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Why a process of its own: the guard's ranks are the subject. A tree without the packages (so the ranks
    import the installed ones instead) is named, and none of the ranks started for it is left running."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import compare

    started: list[subprocess.Popen] = []
    popen = subprocess.Popen

    def recording(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        started.append(popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(compare.subprocess, "Popen", recording)
    settings = compare.StepSettings("small", 2, "cpu", rounds=1, pairs=3, warmup=0, pin=True, logs=tmp_path)
    with pytest.raises(RuntimeError, match="shadows the tree under test"):
        compare.SteppingWorld(compare.Side("baseline", tmp_path, "none", "zero1"), settings)
    assert len(started) == 2 and all(process.poll() is not None for process in started)
