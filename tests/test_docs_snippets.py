"""Every Python block in the docs and the README runs as the page says, or the page says why not.

The blocks run each in a fresh directory, as the command its first line names (see
``tests/docs_snippets.py``); a block passes when its command exits 0, so a block that
shows a result asserts it.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

from tests.docs_snippets import NOT_RUN, Snippet, all_snippets, environment

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


@pytest.mark.distributed
@pytest.mark.parametrize("snippet", RUNNABLE, ids=lambda snippet: snippet.id)
def test_block_runs(snippet: Snippet, tmp_path: Path) -> None:
    script = tmp_path / "snippet.py"
    script.write_text(snippet.code)
    command, env = snippet.command(script)
    result = subprocess.run(
        command,
        cwd=tmp_path,
        env=environment(env),
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, f"{snippet.id} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
