"""The per-run, per-rank scratch directory of the file tiers: checked at setup, removed at exit.

``<offload_dir>/lightning-zero-<run id>/rank<r>/`` with an ``owner`` file (host and process id). The
run id is rank 0's, shared with every rank, so one run's ranks share one parent. A directory whose
owner process is gone (a crashed run on this host) is removed when the next run starts; a live one is
left alone, and so is one still being made (by another rank, or a run starting beside this one: young, its
owner file not yet written). Nothing of another run is ever read: each run writes its own new directory.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import time
import uuid
import warnings
import weakref
from pathlib import Path

from ..collectives import CommContext, all_gather_objects
from ..sizes import human_bytes

PREFIX = "lightning-zero-"


# A directory younger than this without a readable owner file, or a run's parent younger than this without
# its rank directories, is being made (by another rank, or another run on this host starting at the same time).
BEING_MADE_SECONDS = 60.0


def _young(directory: Path) -> bool:
    return time.time() - directory.stat().st_mtime < BEING_MADE_SECONDS


def _left_by_a_dead_run(directory: Path) -> bool:
    """A rank directory whose owner process on this host is gone (or that never got its owner, long ago)."""
    try:
        host, pid = (directory / "owner").read_text().split()
    except (OSError, ValueError):
        return not _young(directory)  # no owner yet (or half written): being made, unless it is old
    if host != socket.gethostname():
        return False  # another machine's (a shared disk): not ours to judge
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, ValueError):
        return False
    return False


def remove_stale_runs(root: Path) -> list[Path]:
    """Remove rank directories of dead runs on this host (and their emptied parents); returns them."""
    removed = []
    for run in root.glob(PREFIX + "*"):
        # Every rank of this host cleans up at once: what another rank removed first is not an error.
        with contextlib.suppress(OSError):
            dead = [d for d in run.glob("rank*") if d.is_dir() and _left_by_a_dead_run(d)]
            for rank_dir in dead:
                shutil.rmtree(rank_dir, ignore_errors=True)
                removed.append(rank_dir)
            # Emptied here (a dead run's: no new rank joins a run id), or empty and not just made.
            if not any(run.iterdir()) and (dead or not _young(run)):
                run.rmdir()
    return removed


def _problem(root: Path, needed_bytes: int, load_bytes: int) -> str | None:
    """Why ``root`` cannot hold ``needed_bytes`` of this rank's scratch files, or None."""
    if not root.is_dir():
        return f"{root} is not a directory (create it on a fast local disk)"
    probe = root / f".{PREFIX}probe-{uuid.uuid4().hex}"
    try:
        probe.write_bytes(b"0")
        probe.unlink()
    except OSError as error:
        return f"{root} is not writable ({error.strerror})"
    free = shutil.disk_usage(root).free
    if free < needed_bytes:
        needed = f"this rank's offloaded state needs {human_bytes(needed_bytes)}"
        return f"{root} has {human_bytes(free)} free; {needed}{_and_a_load(load_bytes)}"
    return None


def _and_a_load(load_bytes: int) -> str:
    if not load_bytes:
        return ""
    return f" (and a checkpoint load stages up to {human_bytes(load_bytes)} more beside it)"


def _warn_if_a_load_would_not_fit(root: Path, rank: int, needed_bytes: int, load_bytes: int) -> None:
    """Setup goes on (a run may never load), but a load would be refused (``NvmeLoad.check_room``): better
    known now than at the resume, hours later."""
    short = needed_bytes + load_bytes - shutil.disk_usage(root).free
    if short > 0:
        warnings.warn(
            f"offload_dir {root} on rank {rank} has room for the offloaded state ({human_bytes(needed_bytes)}) but "
            f"not for loading a checkpoint, which stages up to {human_bytes(load_bytes)} more beside it until every "
            f"rank has read it: a load will be refused unless {human_bytes(short)} more is free by then.",
            stacklevel=3,
        )


class ScratchDirectory:
    """This rank's directory of the run, made once every rank found its ``offload_dir`` usable."""

    def __init__(self, root: str | os.PathLike | None, comm: CommContext, needed_bytes: int, load_bytes: int = 0):
        """``needed_bytes``: what this rank's scratch files take; ``load_bytes``: what a checkpoint load stages
        beside them (said at setup, checked when a load starts: ``NvmeLoad.check_room``)."""
        if root is None:
            raise ValueError(
                "offload_optimizer='nvme' and offload_params='nvme' need offload_dir: a directory on a fast local "
                "disk for the run's scratch files (ZeroConfig(offload_dir=...), or the adapters' offload_dir setting)."
            )
        self.root = Path(root)
        problems = all_gather_objects(comm, _problem(self.root, needed_bytes, load_bytes), "checking offload_dir")
        failing = {rank: problem for rank, problem in enumerate(problems) if problem}
        if failing:
            listed = "; ".join(f"rank {rank}: {problem}" for rank, problem in failing.items())
            raise ValueError(f"offload_dir={str(root)!r} cannot hold the offloaded state: {listed}.")
        _warn_if_a_load_would_not_fit(self.root, comm.rank, needed_bytes, load_bytes)
        run_id = all_gather_objects(comm, uuid.uuid4().hex, "naming the offload run")[0]  # rank 0's: one parent per run
        remove_stale_runs(self.root)
        # Every rank has cleaned up before any makes its directory (one that is still cleaning up leaves a new
        # directory alone only while it is young).
        all_gather_objects(comm, None, "cleaning up offload_dir")
        self.path = self.root / f"{PREFIX}{run_id}" / f"rank{comm.rank}"
        self.path.mkdir(parents=True)
        (self.path / "owner").write_text(f"{socket.gethostname()} {os.getpid()}")
        # At exit, or when the engine goes away first; a crash leaves it to the next run's clean-up.
        self._finalizer = weakref.finalize(self, _remove, self.path)

    def remove(self) -> None:
        self._finalizer()


def _remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    try:
        path.parent.rmdir()  # the run's parent, once its last rank is gone
    except OSError:
        pass
