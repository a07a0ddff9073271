"""Commit subjects say what changed in at most 72 characters; the reasoning goes in the body (and the design
docs). Held for every commit after the one where the rule began; older subjects stay as history has them."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.paths import ROOT

REPOSITORY = ROOT
RULE_BEGAN_AFTER = "bb0ac36"  # the last commit with a long subject
MAX_SUBJECT = 72


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPOSITORY, capture_output=True, text=True, check=True).stdout


@pytest.mark.distributed  # starts git: the suite's tier for tests that start processes
def test_commit_subjects_are_short() -> None:
    if shutil.which("git") is None or not (REPOSITORY / ".git").exists():
        pytest.skip("not a git checkout (an installed copy has no history to check)")
    has_start = subprocess.run(["git", "cat-file", "-e", f"{RULE_BEGAN_AFTER}^{{commit}}"], cwd=REPOSITORY).returncode
    if has_start == 0:
        subjects = _git("log", "--format=%h %s", f"{RULE_BEGAN_AFTER}..HEAD").splitlines()
    else:  # a shallow clone cut after it: every commit it holds is newer, so all of them are checked
        assert _git("rev-parse", "--is-shallow-repository").strip() == "true", f"{RULE_BEGAN_AFTER} is not in history"
        subjects = _git("log", "--format=%h %s").splitlines()
    assert subjects, "no commits after the rule began: the range is wrong"
    long = [line for line in subjects if len(line.split(" ", 1)[1]) > MAX_SUBJECT]
    assert long == [], f"subjects over {MAX_SUBJECT} characters (reword them; the reasoning goes in the body)"
