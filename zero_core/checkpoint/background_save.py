"""Asynchronous saves: the training state copied to host memory on the caller's thread, then written by a
thread of its own while training goes on, with the synchronous save's guarantees (``saving.py``).

Why the copy: the next optimizer step changes the shards in place, and the NVMe tier rewrites its files;
nothing of the staged state aliases either. On a GPU the copy goes to pinned host memory, and the caller's
stream is synchronised once before the thread starts, so the thread reads finished copies.

Why a process group of its own: the write's collectives (every agreed step of ``saving.py``, DCP's own
gathers) run while the training thread runs its collectives; two threads issuing collectives on one group
would pair them differently on different ranks. Every rank makes the group at its first asynchronous save,
a collective call made in the same order on every rank, as the save is.

The host copies are kept from one save to the next and refilled (the next save starts only once the last
write is done): a fresh buffer's first touch faults in every page, which costs more than the copy.

When the write is waited for: by the next save and by any load (``wait``), and by ``engine.wait_for_checkpoint()``
(the adapters' end of training); and at each optimizer step, where every rank says in the step's own
all-reduce whether its write has finished: once every rank's has, each collects it (``collect``). The write's
steps are agreed, so it ends alike on every rank, and its error is raised on every rank alike.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..collectives import CommContext
from ..collectives.context import world_timeout
from ..host_memory import release_freed_memory
from ..pass_listeners import BackgroundWork
from .checkpoint_error import CheckpointError
from .chunks import ShardedChunks

WRITER_DEVICE = torch.device("cpu")  # the staged state's, and the writer group's (gloo)


def staged(state: Any, reuse: list[torch.Tensor] | None = None) -> tuple[Any, list[torch.Tensor]]:
    """``state`` (a state dict of tensors, ``ShardedChunks`` views and plain values, nested in dicts, lists and
    tuples) with every tensor copied to host memory and every other value copied: nothing aliases the
    training state. Returns it with its host copies in order; ``reuse``: an earlier save's, refilled where
    the shape and dtype match (a fresh buffer's first touch faults in every page, which costs more than the
    copy), allocated where not."""
    buffers: list[torch.Tensor] = []
    on_gpu: list[bool] = []

    def host_copy(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        index = len(buffers)
        kept = reuse[index] if reuse is not None and index < len(reuse) else None
        if kept is None or kept.shape != tensor.shape or kept.dtype != tensor.dtype:
            kept = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.device.type == "cuda")
        if tensor.device.type == "cuda":
            on_gpu.append(True)
        buffers.append(kept.copy_(tensor, non_blocking=tensor.device.type == "cuda"))
        return kept

    def walk(value: Any) -> Any:
        if isinstance(value, ShardedChunks):
            return value.staged(host_copy)
        if isinstance(value, torch.Tensor):
            return host_copy(value)
        if isinstance(value, dict):
            return {key: walk(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(walk(item) for item in value)
        return copy.deepcopy(value)

    result = walk(state)
    if on_gpu:
        torch.cuda.synchronize()  # the copies are done before the writer reads them
    return result, buffers


def staging_bytes_needed(state: Any, reuse: list[torch.Tensor]) -> tuple[int, int]:
    """(the bytes ``staged(state, reuse)`` copies, of those the bytes it allocates anew), without reading or
    copying anything: the tensors in ``staged``'s order, each matched with ``reuse`` at its index."""
    sizes: list[tuple[int, torch.dtype]] = []

    def walk(value: Any) -> None:
        if isinstance(value, ShardedChunks):
            if not value.frozen:  # a frozen view is staged without a copy
                sizes.append((value.local_numel, value.dtype))
        elif isinstance(value, torch.Tensor):
            sizes.append((value.numel(), value.dtype))
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)

    walk(state)
    total = fresh = 0
    for index, (numel, dtype) in enumerate(sizes):
        size = numel * dtype.itemsize
        total += size
        kept = reuse[index] if index < len(reuse) else None
        if kept is None or kept.numel() != numel or kept.dtype != dtype:
            fresh += size
    return total, fresh


class _Write:
    """One save being written by its thread: its outcome once the thread ends."""

    def __init__(
        self,
        path: Path,
        write: Callable[[CommContext], Path],
        comm: CommContext,
        when_done: Callable[[Path, BaseException | None], None] | None,
    ):
        self.path = path
        self.when_done = when_done  # run on the training thread once collected, with the write's error if any
        self.error: BaseException | None = None
        self._write: Callable[[CommContext], Path] | None = write  # holds the staged state until written
        # Not a daemon: the interpreter waits for a write to finish before it exits.
        self.thread = threading.Thread(target=self._run, args=(comm,), name=f"zero checkpoint write {path}")
        self.thread.start()

    def _run(self, comm: CommContext) -> None:
        try:
            assert self._write is not None
            self._write(comm)
        except BaseException as error:  # noqa: BLE001 - kept for the training thread, which raises it
            self.error = error
        finally:
            self._write = None  # the staged state, freed as soon as it is written
            release_freed_memory()


class BackgroundSave(BackgroundWork):
    """An engine's asynchronous saves: one written at a time, the next waiting for it."""

    def __init__(self, comm: CommContext):
        self.comm = comm  # the checkpoint's, spanning every rank: the writer's group has the same ranks
        self._writer_comm: CommContext | None = None
        self._pending: _Write | None = None
        # The last save's host copies, refilled by the next (which starts only once that write is done).
        self._staging: list[torch.Tensor] = []

    def bytes_to_stage(self, state: Any) -> tuple[int, int]:
        """``staging_bytes_needed`` of ``state`` against the host copies kept from the last save."""
        return staging_bytes_needed(state, self._staging)

    def stage(self, state: Any) -> Any:
        """``staged(state)``, into the last save's host copies where they fit (call after ``wait``)."""
        assert self._pending is None, "the write reading the host copies must be done first"
        result, self._staging = staged(state, self._staging)
        return result

    @property
    def staging_bytes(self) -> int:
        """The host memory the host copies hold between saves (``memory_report().checkpoint_staging_bytes``)."""
        return sum(t.numel() * t.element_size() for t in self._staging)

    @property
    def pending_path(self) -> Path | None:
        return self._pending.path if self._pending is not None else None

    def start(
        self,
        path: Path,
        write: Callable[[CommContext], Path],
        when_done: Callable[[Path, BaseException | None], None] | None = None,
    ) -> None:
        """Run ``write(comm)`` in a thread of its own, on the writer's process group (every rank calls this,
        after ``wait``); ``when_done(path, error)`` runs on the caller's thread where the write is collected,
        before its error is raised (the adapters prune older checkpoints there once the new one is on disk, or
        remove the folder it was to complete)."""
        assert self._pending is None, "wait for the previous write first"
        self._pending = _Write(path, write, self._writer(), when_done)

    def finished_here(self) -> bool:
        return self._pending is None or not self._pending.thread.is_alive()

    def collect(self) -> None:
        self.wait()

    def wait(self) -> Path | None:
        """The pending write's path once it is on disk (None without one); its error raised (every rank calls
        this at the same point: the write ends alike everywhere), after its ``when_done``."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        pending.thread.join()
        error = pending.error
        if isinstance(error, CheckpointError):
            error = CheckpointError(
                f"The asynchronous save to {pending.path} failed: {error} The previous checkpoint there, "
                "if any, is as it was."
            )
            error.__cause__ = pending.error
        if pending.when_done is not None:
            pending.when_done(pending.path, error)
        if error is not None:
            raise error
        return pending.path

    def _writer(self) -> CommContext:
        if self._writer_comm is None:
            if self.comm.world_size == 1:  # no collective to keep apart
                self._writer_comm = self.comm
            else:
                if dist.get_world_size(self.comm.group) != dist.get_world_size():
                    raise ValueError(
                        "save_checkpoint(asynchronous=True) needs the engine to span every process of the default "
                        "process group (its writer's group is made with every one of them); save synchronously."
                    )
                timeout = world_timeout(self.comm.device)
                group = dist.new_group(backend="gloo", **({"timeout": timeout} if timeout is not None else {}))
                self._writer_comm = CommContext.create(group, WRITER_DEVICE)
        return self._writer_comm
