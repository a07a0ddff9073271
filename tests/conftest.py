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
from pathlib import Path
from typing import Any

import pytest

from tests.paths import TESTS
from tests.rank_pool import RankWorld

# The folders under tests/ whose tests all start processes (or use kept ranks).
_DISTRIBUTED_TIERS = ("distributed", "adapters")


# ``-m smoke``: one case per feature, on 2 ranks where the feature runs on 2, for a check of everything in
# minutes (tests/README.md). By node id, in one place; a whole run fails if one is no longer collected.
SMOKE = (
    "distributed/parity/test_parity.py::test_losses_and_parameters_match_ddp[world2-stage=3-optimizer_name=adamw]",
    "distributed/checkpoint/test_checkpoint_roundtrip.py::test_save_lists_every_file_whatever_dcp_returns",
    "distributed/offload/test_offload.py::test_host_offload_trains_like_memory_with_the_state_on_the_host",
    "distributed/zero_plus_plus/test_zero_plus_plus.py::test_each_parameter_gather_sends_int8_blocks_and_their_scales",
    "distributed/tensor_parallel/test_tensor_parallel.py::test_tensor_parallel_ranks_start_from_the_same_replicated_values",
    "distributed/hybrid/test_hybrid_sharding.py::test_hybrid_sharding_trains_like_ddp[stage=3-optimizer_name=adamw]",
    "distributed/runtime/test_meetings.py::test_a_read_on_one_rank_fails_at_once_on_every_rank_and_slow_ranks_are_waited_for",
    "distributed/memory/test_memory_and_traffic.py::test_model_state_bytes_match_formula[world2-stage3-torch.float32]",
    "distributed/agreement/test_divergence.py::test_extra_forward_on_one_rank_fails_on_every_rank_within_the_timeout",
    "distributed/rank_pool/test_rank_pool.py::test_a_raising_body_fails_its_call_only_and_the_next_gets_a_new_world",
    "adapters/lightning/test_lightning.py::test_each_stage_matches_ddp_with_clipping_and_accumulation[3]",
    "adapters/accelerate/test_accelerate.py::test_each_stage_matches_plain_accelerate[3]",
    "adapters/trainer/test_trainer.py::test_train_evaluate_predict_equal_trainer_under_ddp[3]",
    "adapters/deepspeed/test_deepspeed_config.py::test_the_trainer_strategy_takes_a_deepspeed_config_and_trains_as_the_native_settings",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    smoke_found = set()
    for item in items:
        relative = item.path.resolve().relative_to(TESTS)
        tier = relative.parts[0]
        if tier in ("unit", "docs", *_DISTRIBUTED_TIERS):
            item.add_marker(tier)
        if tier in _DISTRIBUTED_TIERS:
            item.add_marker("distributed")
        node = "/".join(relative.parts) + item.nodeid.partition(".py")[2]
        if node in SMOKE:
            item.add_marker("smoke")
            smoke_found.add(node)
    whole_suite = all(Path(arg).resolve() == TESTS for arg in config.args) or not config.args
    missing = sorted(set(SMOKE) - smoke_found)
    if whole_suite and missing:
        raise pytest.UsageError(f"tests/conftest.py's SMOKE names tests that are not collected: {missing}")


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
