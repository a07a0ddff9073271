"""offload_params="nvme" (ZeRO-Infinity's parameter tier): each sharded unit's parameter shard rests in a
file of its own, ``<run dir>/params<i>.bin``, between gathers.

In memory the shard (``ParamStorage.host_shard``) keeps its identity and shape, its storage resized to zero
bytes while the file holds it. A gather reads it back (issued ahead, for the unit after the prefetched ones,
by :meth:`ShardFile.read_ahead`), copies it into the device's staging buffer and frees it again
(:meth:`ShardFile.free_if_on_disk`): the file did not change. After a step (or a load) the new values are
written behind: the next units' refresh goes on while earlier ones are written, at most ``units_in_memory``
shards wait in memory for their writes, and a shard is freed once its write is on disk (a failed write keeps
it: it is the only copy).

Every method runs under the tier's lock, on the thread that runs forward, backward and the step, or on the
worker that steps units during backward (``offload_step_in_backward``, which with the NVMe optimizer tier
writes a unit's new shard right after its step); the engine's I/O pool (``tier.py``, shared with the
optimizer state's files) only moves bytes between a tensor's memory and its file. A shard handed out for
writing is not freed until it is stored.

A failed read fills the shard with zeros instead of raising: this rank still joins the gather, so no rank
waits alone. Failures (reads and writes) are then raised alike on every rank by :meth:`ShardFiles.agree`, at
the end of each forward and before each optimizer step, so no step applies what a failed read computed.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from ..collectives import CommContext
from ..host_memory import release_freed_memory
from .failure_agreement import succeeded
from .file_io import free, has_bytes, read_tensors, write_tensors
from .tier import FileTier, IOPool

Method = TypeVar("Method", bound=Callable[..., Any])


def _locked(method: Method) -> Method:
    """The method runs under its tier's lock (re-entrant: locked methods call each other)."""

    @functools.wraps(method)
    def locked(self: ShardFiles | ShardFile, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            return method(self, *args, **kwargs)

    return locked  # type: ignore[return-value]


class ShardFiles(FileTier):
    """The parameter shards' files of one rank: the writes in flight, the failures (``pool``: the engine's)."""

    def __init__(self, directory: Path, units_in_memory: int, pool: IOPool | None = None):
        super().__init__(directory, pool)
        self.units_in_memory = units_in_memory
        self.files: list[ShardFile] = []
        self.writes: dict[ShardFile, concurrent.futures.Future] = {}  # oldest first
        # This rank's, raised alike on every rank by the next agree(): reads (what they computed is wrong) and
        # writes (the shard stays in memory until written again).
        self.read_failures: list[str] = []
        self.write_failures: list[str] = []
        self.lock = threading.RLock()

    @_locked
    def file_for(self, shard: torch.Tensor) -> ShardFile:
        """``shard``'s values go to a file of its own now (written behind) and rest there from then on."""
        file = ShardFile(self, self.directory / f"params{len(self.files)}.bin", shard)
        self.files.append(file)
        file.store()
        return file

    @_locked
    def drain(self, keep: int, wait: bool = True) -> None:
        """Settle the oldest writes until at most ``keep`` are in flight (``wait=False``: only those done)."""
        while len(self.writes) > keep:
            file, future = next(iter(self.writes.items()))
            if not wait and not future.done():
                return
            del self.writes[file]
            file.written(succeeded(future, self.write_failures))

    @_locked
    def wait_for_write(self, file: ShardFile) -> None:
        """``file``'s write in flight is done (its shard stays in memory, for the caller)."""
        file.on_disk = succeeded(self.writes.pop(file), self.write_failures)

    @_locked
    def rewrite_all(self) -> None:
        """Every shard is about to be written anew (a load, a refresh from the master): the failed writes of
        their earlier values no longer matter. Failed reads still do (what they computed is not stepped)."""
        self.drain(keep=0)
        self.write_failures = []

    def agree(self, comm: CommContext, where: str) -> None:
        """The same OffloadError on every rank if a read or write failed on any (a collective: every rank
        calls it at the same points). The writes behind the last step are waited for first (by the end of the
        next forward they are done): every failure so far is in this agreement."""
        with self.lock:
            self.drain(keep=0)
            failures = self.read_failures + self.write_failures
            self.read_failures, self.write_failures = [], []
        what = f"the parameter shards offloaded to {self.offload_dir}"
        self.raise_if_any_rank_failed(comm, failures, f"the parameter shards' files, {where}", what, f"; found {where}")


class ShardFile:
    """One unit's parameter shard and its file. ``on_disk``: the file holds the shard's current values."""

    def __init__(self, tier: ShardFiles, path: Path, shard: torch.Tensor):
        self.tier, self.path, self.shard = tier, path, shard
        self.nbytes = shard.numel() * shard.element_size()
        self.on_disk = False
        self.in_use = False  # an asynchronous copy (to the device) still reads the shard's memory
        self._store_dropped = False  # the next store() writes nothing (see for_writing)
        self._read: concurrent.futures.Future | None = None

    @property
    def lock(self) -> threading.RLock:
        return self.tier.lock

    @property
    @_locked
    def bytes_on_disk(self) -> int:
        """The shard's bytes when the file holds its values and memory does not."""
        return self.nbytes if self.on_disk and not has_bytes(self.shard) else 0

    @_locked
    def read_ahead(self) -> None:
        """Start reading the shard back into memory, unless it is there or on its way."""
        self.tier.drain(keep=0, wait=False)  # the shards whose writes are done since are freed
        if self._read is None and not has_bytes(self.shard):
            self.shard.untyped_storage().resize_(self.nbytes)  # here: the pool's threads only move bytes
            self._read = self.tier.submit(read_tensors, self.path, [self.shard])

    @_locked
    def values(self) -> torch.Tensor:
        """The shard, its values in memory (read now if no read was issued ahead)."""
        self._fill()
        return self.shard

    def _fill(self) -> bool:
        """The shard's values in memory; False if its read failed (it then holds zeros: this rank still joins
        the gather, and agree() raises the failure on every rank)."""
        self.read_ahead()
        if self._read is None:
            return True
        read, self._read = self._read, None
        if succeeded(read, self.tier.read_failures):
            return True
        self.shard.zero_()
        return False

    @_locked
    def for_writing(self, keep_values: bool) -> torch.Tensor:
        """The shard in memory, to be changed and then :meth:`store`-d (``keep_values=False``: the caller
        overwrites all of it, nothing is read). A write of its earlier values is waited for first."""
        if self in self.tier.writes:
            self.tier.wait_for_write(self)  # its bytes must not change under the write
        if keep_values or self._read is not None:  # a read issued ahead lands before the shard is overwritten
            # A part written over a shard whose read failed is not stored: zeros would replace the file's values.
            self._store_dropped = not self._fill() and keep_values
        elif not has_bytes(self.shard):
            self.shard.untyped_storage().resize_(self.nbytes)
        if not self._store_dropped:
            self.on_disk = False  # about to hold newer values than the file: not freed before it is stored
        return self.shard

    @_locked
    def store(self) -> None:
        """The shard's values changed: written behind (freed once on disk), with at most ``units_in_memory``
        shards waiting in memory for their writes."""
        if self._store_dropped:  # over a failed read (raised by the next agree()): the file keeps its values
            self._store_dropped = False
            self.free_if_on_disk()
            return
        self.on_disk = False
        self.tier.writes[self] = self.tier.submit(write_tensors, self.path, [self.shard])
        self.tier.drain(keep=self.tier.units_in_memory)

    @_locked
    def written(self, succeeded: bool) -> None:
        self.on_disk = succeeded
        self.free_if_on_disk()

    @_locked
    def free_if_on_disk(self) -> None:
        """The shard's values are not needed in memory now: freed if the file holds them (a read issued ahead
        is waited for; a shard still being written, or copied, is freed when that is done)."""
        if self._read is not None:
            self.values()
        if self.on_disk and not self.in_use and self not in self.tier.writes and has_bytes(self.shard):
            free(self.shard)
            release_freed_memory()
