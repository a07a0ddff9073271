"""The README stays a short front page: its set-up-and-go commands, links that resolve, under 150 lines."""

from __future__ import annotations

import re

from tests.paths import ROOT

README = (ROOT / "README.md").read_text()
CI = (ROOT / ".ci" / "run").read_text()

MAIN_JOB = (
    'pip install torch==2.13.0 && pip install -e ".[test]" && '
    "python -m torch.distributed.run --nproc_per_node 2 examples/train_zero3.py"
)
TESTS = 'pip install torch==2.13.0 && pip install -e ".[test]" && python -m pytest -q'


def test_the_readme_is_a_front_page() -> None:
    assert len(README.splitlines()) <= 150, "the README is the front page: move detail into docs/"


def test_the_quick_start_has_the_two_commands_and_ci_runs_the_same_tests() -> None:
    commands = [line for line in README.splitlines() if line.startswith("pip install torch==2.13.0 && ")]
    assert commands == [MAIN_JOB, TESTS]
    assert "python -m pip install -q torch==2.13.0" in CI and "\npython -m pytest -q\n" in CI


def test_every_relative_link_and_image_resolves() -> None:
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    local = [target for target in targets if "://" not in target]
    assert len(local) >= 15
    missing = [target for target in local if not (ROOT / target).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"


def test_the_readme_and_docs_stand_on_their_own() -> None:
    """No page links outside the repository: what a reader needs is in it (and stays true with it)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    outside = [
        f"{page.relative_to(ROOT)}: {link}"
        for page in pages
        for link in re.findall(r"\]\((https?://[^)]+|\.\./\.\./[^)]*)\)", page.read_text())
    ]
    assert not outside, outside
