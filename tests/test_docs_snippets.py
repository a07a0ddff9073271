"""Every Python block in the docs and the README runs as the page says, or the page says why not.

The blocks run each in a fresh directory, as the command its first line names (see
``tests/docs_snippets.py``); a block passes when its command exits 0, so a block that
shows a result asserts it. Two blocks run side by side (a run keeps about one core busy:
imports, then a launcher waiting on its processes): the launched ones (``# run:``, whose
launchers take a fixed default port) one after another, beside the plain scripts.
"""

from __future__ import annotations

import ast
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.docs_snippets import NOT_RUN, RUN, Snippet, all_snippets, environment

SNIPPETS = all_snippets()
RUNNABLE = [snippet for snippet in SNIPPETS if snippet.not_run_reason is None]


def test_the_docs_have_python_blocks() -> None:
    assert len(SNIPPETS) >= 20 and len(RUNNABLE) >= 10


@pytest.mark.parametrize("snippet", SNIPPETS, ids=lambda snippet: snippet.id)
def test_block_is_python_and_says_how_it_runs(snippet: Snippet) -> None:
    ast.parse(snippet.code, filename=snippet.id)
    reason = snippet.not_run_reason
    if reason is not None:
        assert len(reason.split()) >= 3, f"{snippet.id}: '{NOT_RUN}' needs a reason a reader understands"
    else:
        snippet.command(Path("snippet.py"))  # raises on a command it cannot start


def _run(snippet: Snippet, directory: Path) -> subprocess.CompletedProcess | subprocess.TimeoutExpired:
    script = directory / "snippet.py"
    script.write_text(snippet.code)
    command, env = snippet.command(script)
    try:
        return subprocess.run(
            command,
            cwd=directory,
            env=environment(env),
            capture_output=True,
            text=True,
            timeout=300,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as expired:
        return expired


def _run_in_sequence(snippets: list[Snippet], tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    return {snippet.id: _run(snippet, tmp_path_factory.mktemp("snippet")) for snippet in snippets}


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The selected blocks' runs (each in a fresh directory), in two lanes side by side: the launched blocks
    (torchrun's and Accelerate's default port is fixed: never two at once), and the plain scripts."""
    selected = {
        item.callspec.params["snippet"].id
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_block_runs" and item.module is request.module
    }
    chosen = [snippet for snippet in RUNNABLE if snippet.id in selected]
    launched = [snippet for snippet in chosen if snippet.first_line.startswith(RUN)]
    plain = [snippet for snippet in chosen if not snippet.first_line.startswith(RUN)]
    with ThreadPoolExecutor(max_workers=2) as lanes:
        done = [lanes.submit(_run_in_sequence, lane, tmp_path_factory) for lane in (launched, plain)]
        return {name: result for lane in done for name, result in lane.result().items()}


@pytest.mark.distributed
@pytest.mark.parametrize("snippet", RUNNABLE, ids=lambda snippet: snippet.id)
def test_block_runs(snippet: Snippet, runs: dict[str, object]) -> None:
    result = runs[snippet.id]
    if isinstance(result, subprocess.TimeoutExpired):
        raise result
    assert isinstance(result, subprocess.CompletedProcess)
    assert result.returncode == 0, f"{snippet.id} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
