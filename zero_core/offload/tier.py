"""What the file tiers share (on the model of DeepSpeed's swapper base in ``swap_tensor/``): the engine's one
I/O pool, the directory of its files, and the one failure agreement.

One pool per engine serves both file tiers, the parameter shards' (``shard_files.py``) and the optimizer
state's (``state_files.py``): its threads only move bytes between a tensor's memory and its file (two per
tier, as many as each had of its own). The pool holds the run's scratch directory (``scratch.py``) and ends
before it: at exit, or once the engine goes away, the reads and writes in flight are done, then the directory
is removed.
"""

from __future__ import annotations

import concurrent.futures
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..collectives import CommContext
from .failure_agreement import raise_if_any_rank_failed
from .scratch import ScratchDirectory

WORKERS_PER_TIER = 2


class IOPool:
    """The engine's one pool of I/O threads, over the run's scratch directory (None: a directory the caller keeps)."""

    def __init__(self, scratch: ScratchDirectory | None = None, tiers: int = 1):
        self.scratch = scratch
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=WORKERS_PER_TIER * tiers, thread_name_prefix="zero-offload"
        )
        # At exit, or when the engine goes away: the reads and writes in flight end, then the directory goes.
        self._finalizer = weakref.finalize(self, _close, self._executor, scratch)

    def submit(self, work: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        return self._executor.submit(work, *args)

    def close(self) -> None:
        self._finalizer()


def _close(executor: concurrent.futures.ThreadPoolExecutor, scratch: ScratchDirectory | None) -> None:
    executor.shutdown(wait=True)
    if scratch is not None:
        scratch.remove()


class FileTier:
    """The base of the file tiers: their directory, the pool their reads and writes run on, and the agreement of
    their failures across ranks. ``pool`` None: a pool of the tier's own (a tier made alone, in a test)."""

    def __init__(self, directory: Path, pool: IOPool | None = None):
        self.directory = directory
        self.pool = pool if pool is not None else IOPool()

    @property
    def offload_dir(self) -> Path:
        """The directory the user chose (``offload_dir``): the run's directory is two levels below it."""
        return self.directory.parent.parent

    def submit(self, work: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        return self.pool.submit(work, *args)

    def raise_if_any_rank_failed(
        self, comm: CommContext, failures: list[str], label: str, what: str, found: str = ""
    ) -> None:
        """The same OffloadError on every rank if ``failures`` is not empty on any (a collective)."""
        raise_if_any_rank_failed(comm, failures, label, what, found)
