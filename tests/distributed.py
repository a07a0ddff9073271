"""Run a function on several gloo processes on this machine and collect what each returns.

One spawn per grid of cases: workers run many cases and return their
results, the tests assert on them. A worker's exception is re-raised here
with its traceback; a hang is killed after ``timeout`` seconds.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(
    fn: Callable, rank: int, world_size: int, port: int, queue: Any, args: tuple, backend: str, pg_timeout: float | None
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        timeout = datetime.timedelta(seconds=pg_timeout) if pg_timeout else None
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
        # Plain pickle copies tensors by value; torch's queue pickling would
        # share them through file descriptors that die with this process.
        queue.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# Workers fork from one server process that imported torch and the core once per test session
# (forkserver), instead of each importing them anew (spawn: about 2.5 s per process on 2 cores).
# The server imports nothing else and runs nothing, so each worker starts as fresh as a spawned one.
# ZERO_TEST_START_METHOD=spawn goes back to spawning (to rule the server out when chasing a failure).
_PRELOAD = ["torch", "torch.distributed", "zero_core", "tests.models"]


def _context() -> Any:
    method = os.environ.get("ZERO_TEST_START_METHOD", "forkserver")
    context = mp.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload(_PRELOAD)
    return context


def run_distributed(
    fn: Callable,
    world_size: int,
    *args: Any,
    timeout: float = 300,
    backend: str = "gloo",
    pg_timeout: float | None = None,
) -> list[Any]:
    """``fn(rank, world_size, *args)`` on each rank; returns the results by rank.

    ``pg_timeout``: the process group's own timeout in seconds (how long a
    collective may wait), for tests of what happens when ranks diverge.
    """
    context = _context()
    queue = context.SimpleQueue()
    port = _free_port()
    processes = [
        context.Process(target=_entry, args=(fn, rank, world_size, port, queue, args, backend, pg_timeout), daemon=True)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    while len(results) + len(failures) < world_size:
        if time.monotonic() > deadline:
            break
        if queue.empty():
            if not any(p.is_alive() for p in processes) and queue.empty():
                break
            time.sleep(0.05)
            continue
        rank, ok, payload = queue.get()
        if ok:
            results[rank] = pickle.loads(payload)
        else:
            failures[rank] = payload
    # Teardown (destroy_process_group, interpreter exit) of several ranks on a loaded 2-core
    # machine can take seconds; a rank still alive after a minute is hung and killed.
    exit_deadline = time.monotonic() + 60
    for process in processes:
        process.join(timeout=max(0.1, exit_deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join(timeout=5)
    if failures:
        first = min(failures)
        others = "".join(
            f"\n--- rank {rank} failed too:\n{failures[rank]}" for rank in sorted(failures) if rank != first
        )
        raise RuntimeError(f"rank {first} of {world_size} failed:\n{failures[first]}{others}")
    if len(results) < world_size:
        missing = sorted(set(range(world_size)) - set(results))
        raise TimeoutError(f"ranks {missing} of {world_size} gave no result within {timeout}s (hang or crash)")
    # A rank that returned its result can still die afterwards (destroy_process_group,
    # interpreter teardown: e.g. "terminate called without an active exception"),
    # which torchrun would report as a failed job; do not let that pass silently.
    bad_exits = {rank: p.exitcode for rank, p in enumerate(processes) if p.exitcode != 0}
    if bad_exits:
        raise RuntimeError(
            f"ranks returned their results but exited abnormally (rank: exit code, negative = signal): {bad_exits}"
        )
    return [results[rank] for rank in range(world_size)]


def run_each(rank: int, world_size: int, workers: dict[str, Callable]) -> dict[str, Any]:
    """Several workers in one spawn (one process group for a file's cases): their results by name."""
    return {name: worker(rank, world_size) for name, worker in workers.items()}


def by_rank(grid: list[dict[str, Any]], name: str) -> list[Any]:
    """One worker's results from ``run_each``, rank by rank."""
    return [ranked[name] for ranked in grid]
