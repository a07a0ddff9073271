"""Every Python block in the docs and the README runs as the page says, or the page says why not.

The blocks run each in a fresh directory, as the command its first line names (see
``tests/docs_snippets.py``); a block passes when its command exits 0 on every process, so a
block that shows a result asserts it. A ``torchrun`` block runs on the kept ranks of
``tests/rank_pool.py`` with torchrun's variables set (the script is the subject, not the
launcher), except ``LAUNCHED_BY_TORCHRUN`` and blocks that make a process group of their own
beside the default one. So does a plain script that trains with Lightning on ``devices=N``: under
torchrun's variables Lightning starts no processes of its own and runs in the process group it finds,
as under torchrun (Lightning's own launcher is the subject of ``tests/adapters/lightning``). The rest
start their command: the launched ones (``# run:``, whose launchers take a fixed default port) one
after another, beside the plain scripts.
"""

from __future__ import annotations

import ast
import queue
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.docs_snippets import NOT_RUN, RUN, Snippet, all_snippets, environment
from tests.rank_pool import ScriptRun, run_script

SNIPPETS = all_snippets()
RUNNABLE = [snippet for snippet in SNIPPETS if snippet.not_run_reason is None]
# The torchrun guide's first block shows what torchrun itself gives a script: it is launched for real.
LAUNCHED_BY_TORCHRUN = {"docs/guides/torchrun.md:8"}
_TORCHRUN = re.compile(r"# run: torchrun --nproc_per_node (\d+) \S+\.py\s*$")
_IMPORTS_LIGHTNING = re.compile(r"^(import lightning|from lightning)\b", re.MULTILINE)
_DEVICES = re.compile(r"\bdevices=(\d+)")


def _ranks_in_pool(snippet: Snippet) -> int | None:
    """The world size of a block that runs on kept ranks, or None for one whose command is started."""
    if snippet.id in LAUNCHED_BY_TORCHRUN or snippet.code.count("init_process_group(") > 1:
        return None
    match = _TORCHRUN.fullmatch(snippet.first_line)
    if match is not None:
        return int(match[1])
    # A plain script training with Lightning on one device count: it would start that many processes itself.
    devices = set(_DEVICES.findall(snippet.code))
    if not snippet.first_line.startswith(RUN) and _IMPORTS_LIGHTNING.search(snippet.code) and len(devices) == 1:
        return int(devices.pop())
    return None


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


Outcome = subprocess.CompletedProcess | ScriptRun | BaseException


def _run(snippet: Snippet, directory: Path) -> Outcome:
    """The block saved in ``directory`` and run: on kept ranks (the first rank that failed, or rank 0) or as
    its command; what went wrong running it is the outcome too, raised by its own test."""
    script = directory / "snippet.py"
    script.write_text(snippet.code)
    command, env = snippet.command(script)
    try:
        world_size = _ranks_in_pool(snippet)
        if world_size is not None:
            ranks = run_script(script, world_size=world_size, env=env, cwd=directory)
            return next((rank for rank in ranks if rank.returncode != 0), ranks[0])
        return subprocess.run(
            command,
            cwd=directory,
            env=environment(env),
            capture_output=True,
            text=True,
            timeout=300,
            stdin=subprocess.DEVNULL,
        )
    except Exception as error:  # noqa: BLE001 - a timeout or a failed world, raised by the block's test
        return error


def _run_lane(
    own: list[Snippet], shared: queue.SimpleQueue, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Outcome]:
    """``own`` one after another, then blocks taken from ``shared`` until none is left (so the lane that ends its
    own first takes more of the rest, and neither waits idle while the other has a queue)."""
    outcomes = {snippet.id: _run(snippet, tmp_path_factory.mktemp("snippet")) for snippet in own}
    while True:
        try:
            snippet = shared.get_nowait()
        except queue.Empty:
            return outcomes
        outcomes[snippet.id] = _run(snippet, tmp_path_factory.mktemp("snippet"))


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    """The selected blocks' runs (each in a fresh directory), in two lanes side by side: one runs the launched
    blocks (torchrun's and Accelerate's default port is fixed: never two at once) and those on kept ranks (one
    world at a time); the plain scripts are shared, each taken by whichever lane is free."""
    selected = {
        item.callspec.params["snippet"].id
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_block_runs" and item.module is request.module
    }
    chosen = [snippet for snippet in RUNNABLE if snippet.id in selected]
    one_at_a_time = [s for s in chosen if s.first_line.startswith(RUN) or _ranks_in_pool(s) is not None]
    shared: queue.SimpleQueue = queue.SimpleQueue()
    for snippet in chosen:
        if snippet not in one_at_a_time:
            shared.put(snippet)
    with ThreadPoolExecutor(max_workers=2) as lanes:
        done = [lanes.submit(_run_lane, own, shared, tmp_path_factory) for own in (one_at_a_time, [])]
        return {name: result for lane in done for name, result in lane.result().items()}


@pytest.mark.distributed
@pytest.mark.parametrize("snippet", RUNNABLE, ids=lambda snippet: snippet.id)
def test_block_runs(snippet: Snippet, runs: dict[str, Outcome]) -> None:
    result = runs[snippet.id]
    if isinstance(result, BaseException):
        raise result
    assert result.returncode == 0, f"{snippet.id} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
