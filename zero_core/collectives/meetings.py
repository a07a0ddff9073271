"""Operations every rank must enter together, checked on the store before their collectives.

A read of a stage-3 model on one rank only (``if is_main_process: torch.save(model.state_dict(), f)``)
all-gathers, and the other ranks never join it: they wait in their next barrier, and both sides wait
out the process group's timeout (30 minutes by default) before a bare backend error. So the
operations that gather on demand (``state_dict()``, ``full_state_dict``, ``gathered_parameters``,
checkpoints), the adapters' barriers and ``end_training`` are *meetings*: each rank writes to the
process group's store which operation it enters as its n-th meeting, and where it was called from;
once every rank has entered its n-th meeting they compare, and unless all entered the same
operation every one of them raises the same :class:`RanksDivergedError`, naming where each rank is,
within milliseconds. A rank that is merely slow has not entered its n-th meeting yet: the others
wait for it, up to the process group's timeout. A process that exits (normally or by an exception)
enters "process exit" as its next meeting without waiting, so its peers are not left waiting.

Nothing is checked for the training passes themselves (a forward on one rank only still waits out
the timeout, then ``CollectiveFailed`` names it): a store round trip per pass would cost every step.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import inspect
import os
import sys
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .context import world_timeout

PREFIX = "lightning-zero/meetings"
# Frames in these packages are not "where the user called it" (nor the standard library's, below).
_FRAMEWORKS = (
    "torch",
    "lightning",
    "lightning_fabric",
    "pytorch_lightning",
    "accelerate",
    "transformers",
    "zero_core",
    "lightning_zero",
    "accelerate_zero",
)

GATHER_ON_EVERY_RANK = (
    "Operations that gather a sharded model run on every rank together: gather on every rank, then write "
    "on one, e.g. `state = accelerator.get_state_dict(model)` (Accelerate), `state = engine.full_state_dict"
    "(rank0_only=True)` (the core) or `trainer.save_checkpoint(path)` (Lightning), then "
    "`if is_main_process: torch.save(state, f)`."
)


class RanksDivergedError(RuntimeError):
    """The ranks entered different operations that all ranks must enter together.

    What it means: the operations that gather a sharded model on demand (``state_dict()`` of a
    stage-3 model, ``engine.full_state_dict()``, ``engine.gathered_parameters()``, ``unshard``,
    checkpoint saves and loads) and the adapters' barriers (Lightning's and Fabric's ``barrier``,
    Accelerate's ``wait_for_everyone`` and ``end_training``) are meetings: every rank must enter the
    same one. Here the ranks entered different ones (typically a ``state_dict()`` under
    ``if is_main_process:`` while the other ranks went on to a barrier), or a rank exited, or did not
    arrive within the process group's timeout. The message, the same on every rank that reached the
    meeting, names where each rank is; the operation has not started anywhere, so nothing changed.

    What to do: gather on every rank, then write on one: ``state = accelerator.get_state_dict(model)``
    (Accelerate), ``state = engine.full_state_dict(rank0_only=True)`` (the core) or
    ``trainer.save_checkpoint(path)`` (Lightning) on every rank, then
    ``if is_main_process: torch.save(state, f)``.
    """


@dataclass
class _Board:
    store: dist.Store
    rank: int
    world_size: int
    timeout: datetime.timedelta
    generation: int  # which world of this process: a world initialised again starts a new board
    entered: int = 0  # meetings this rank has entered
    depth: int = 0  # inside a meeting, the operations it runs are part of it
    waited: list[float] = field(default_factory=list)  # seconds each meeting waited (for tests)

    def key(self, number: int, name: str) -> str:
        return f"{self.generation}/{number}/{name}"

    def post(self, operation: str, description: str) -> int:
        self.entered += 1
        number = self.entered
        self.store.set(self.key(number, f"rank{self.rank}"), description)
        self.store.add(self.key(number, f"op:{operation}"), 1)
        self.store.add(self.key(number, "entered"), 1)
        return number

    def meet(self, operation: str, where: str) -> None:
        number = self.post(operation, f"{operation} (called at {where})")
        start = time.monotonic()
        delay = 0.0005
        while self.store.add(self.key(number, "entered"), 0) < self.world_size:
            if time.monotonic() - start > self.timeout.total_seconds():
                raise RanksDivergedError(self._timeout_message(number, operation))
            time.sleep(delay)
            delay = min(2 * delay, 0.05)
        self.waited.append(time.monotonic() - start)
        if self.store.add(self.key(number, f"op:{operation}"), 0) != self.world_size:
            raise RanksDivergedError(self._divergence_message(number))

    def _divergence_message(self, number: int) -> str:
        where = [self.store.get(self.key(number, f"rank{r}")).decode() for r in range(self.world_size)]
        shown = "; ".join(f"rank {r}: {w}" for r, w in enumerate(where[:8]))
        more = f"; and {len(where) - 8} more ranks" if len(where) > 8 else ""
        return f"ZeRO: the ranks are not in the same operation ({shown}{more}). {GATHER_ON_EVERY_RANK}"

    def _timeout_message(self, number: int, operation: str) -> str:
        keys = [self.key(number, f"rank{r}") for r in range(self.world_size)]
        missing = [r for r, key in enumerate(keys) if not self.store.check([key])]
        return (
            f"ZeRO: ranks {missing} did not enter {operation} within the process group's timeout "
            f"({self.timeout}) while rank {self.rank} waited in it. {GATHER_ON_EVERY_RANK}"
        )


_boards: dict[object, _Board] = {}  # by the world's process group object


def _default_store() -> dist.Store | None:
    """torch has no public getter for the store ``init_process_group`` made; without it, no checks."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def _timeout() -> datetime.timedelta:
    """The world's timeout (gloo's backend answers for the CPU, NCCL's for CUDA)."""
    for device in ("cpu", "cuda"):
        timeout = world_timeout(torch.device(device))
        if timeout is not None:
            return timeout
    return dist.default_pg_timeout


def _board() -> _Board | None:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    world = dist.group.WORLD
    board = _boards.get(world)
    if board is None:
        store = _default_store()
        if store is None:
            return None
        generation = len(_boards)
        board = _Board(dist.PrefixStore(PREFIX, store), dist.get_rank(), dist.get_world_size(), _timeout(), generation)
        _boards[world] = board
        if generation == 0:
            atexit.register(_leave)
    return board


def _skipped_directories() -> tuple[str, ...]:
    directories = [sysconfig.get_paths()["stdlib"]]
    for name in _FRAMEWORKS:
        module = sys.modules.get(name)
        directories += list(getattr(module, "__path__", []))
    return tuple(os.path.join(d, "") for d in directories)


def call_site() -> str:
    """``file:line`` of the innermost frame outside torch, Lightning, Accelerate, this project and the
    standard library: the user's line that entered the operation."""
    skipped = _skipped_directories()
    frame = inspect.currentframe()
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(skipped) and not filename.startswith("<"):
            return f"{filename}:{frame.f_lineno}"
        frame = frame.f_back
    return "an unknown place"


@contextlib.contextmanager
def meeting(operation: str) -> Iterator[None]:
    """Enter ``operation`` together with every rank of the world, or raise :class:`RanksDivergedError`
    on every rank that did. Operations run inside one are part of it (no meeting of their own)."""
    board = _board()
    if board is None:
        yield
        return
    if board.depth == 0:
        board.meet(operation, call_site())
    board.depth += 1
    try:
        yield
    finally:
        board.depth -= 1


def meetings_waited() -> list[float]:
    """Seconds each meeting of this world has waited for the others, oldest first."""
    board = _board()
    return list(board.waited) if board is not None else []


def _leave() -> None:
    """At exit: "process exit" is this rank's next meeting, without waiting, so that peers waiting in a
    meeting learn that this rank is gone. Best effort: the store may be gone with rank 0's process."""
    if not _boards:
        return
    board = list(_boards.values())[-1]  # the latest world, also after destroy_process_group: its store lives on
    if board.depth > 0:
        return
    with contextlib.suppress(Exception):
        board.post("process exit", "exited")
