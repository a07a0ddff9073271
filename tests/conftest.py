"""Markers from the directory, and the two tiers they make.

A test's first folder under ``tests/`` is its marker (``unit``, ``distributed``, ``adapters``, ``docs``);
``distributed/`` and ``adapters/`` are marked ``distributed`` too: they start processes or use kept ranks
(``tests/rank_pool.py``), and a test elsewhere that does is marked so in its file.
``python -m pytest -m "not distributed"`` is the fast tier. So that the marker
stays true, a test without it that starts a process (a process group,
torchrun, a launcher, a script) fails, naming what it started. The process is
still started: a refusal here could look like the very refusal a test
expects (the unpickling tests check that no payload starts one).
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import subprocess
from collections.abc import Generator, Iterator
from typing import Any

import pytest

from tests.paths import TESTS
from tests.rank_pool import RankWorld

# The folders under tests/ whose tests all start processes (or use kept ranks).
_DISTRIBUTED_TIERS = ("distributed", "adapters")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = item.path.resolve().relative_to(TESTS).parts[0]
        if tier in ("unit", "docs", *_DISTRIBUTED_TIERS):
            item.add_marker(tier)
        if tier in _DISTRIBUTED_TIERS:
            item.add_marker("distributed")


@contextlib.contextmanager
def _starts_recorded() -> Iterator[list[str]]:
    """What the code inside starts: subprocesses and multiprocessing processes."""
    started: list[str] = []
    execute_child = subprocess.Popen._execute_child
    start = multiprocessing.process.BaseProcess.start
    run_body = RankWorld.run

    def recording_execute_child(popen: subprocess.Popen, args: Any, *rest: Any, **kwargs: Any) -> Any:
        started.append(f"the subprocess {str(args)[:120]}")
        return execute_child(popen, args, *rest, **kwargs)

    def recording_start(process: multiprocessing.process.BaseProcess) -> None:
        started.append(f"the process {process.name}")
        start(process)

    def recording_run_body(world: RankWorld, fn: Any, *rest: Any, **kwargs: Any) -> Any:
        # A kept world's ranks were started by an earlier test; this one uses them all the same.
        started.append(f"{fn.__name__} on a world of {world.world_size} ranks")
        return run_body(world, fn, *rest, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "_execute_child", recording_execute_child)
        patch.setattr(multiprocessing.process.BaseProcess, "start", recording_start)
        patch.setattr(RankWorld, "run", recording_run_body)
        yield started


def _unmarked_starts(item: pytest.Item) -> Generator[None, Any, Any]:
    if item.get_closest_marker("distributed") is not None:
        return (yield)
    with _starts_recorded() as started:
        result = yield
    if started:
        pytest.fail(
            f"{item.nodeid} started {started[0]} but is not marked distributed: add @pytest.mark.distributed "
            "(or `pytestmark = pytest.mark.distributed` for a file whose tests all start processes).",
            pytrace=False,
        )
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, Any, Any]:
    return (yield from _unmarked_starts(item))  # module-scoped fixtures start their process groups here


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    return (yield from _unmarked_starts(item))


@pytest.fixture(autouse=True)
def _environment_restored() -> Iterator[None]:
    """The launcher's code, tested in this process (``plugin_from_arguments``), exports its variables into this
    process's environment, as it does for the processes it starts: each test's are undone after it, so that none
    reaches a later test, or a process a later test starts (a launched accumulation a Trainer then refuses)."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)
