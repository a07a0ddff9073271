"""The NVMe tier's scratch directories: a clean-up running while another rank, or another run on this host,
makes its directory never takes the new one for a dead run's; a dead run's leftovers go."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

from zero_core.offload import scratch


def _make(path: Path) -> None:
    """As ScratchDirectory makes its directory."""
    path.mkdir(parents=True)
    (path / "owner").write_text(f"{socket.gethostname()} {os.getpid()}")


def test_a_new_directory_survives_clean_ups_running_beside_its_creation(tmp_path: Path) -> None:
    stop = threading.Event()

    def clean_up() -> None:
        while not stop.is_set():
            scratch.remove_stale_runs(tmp_path)

    cleaner = threading.Thread(target=clean_up)
    cleaner.start()
    try:
        made = [tmp_path / f"{scratch.PREFIX}run{i}" / "rank0" for i in range(300)]
        for path in made:
            _make(path)
    finally:
        stop.set()
        cleaner.join()
    assert all((path / "owner").is_file() for path in made)


def test_a_dead_runs_directories_are_removed_and_a_live_ones_kept(tmp_path: Path) -> None:
    dead, live = tmp_path / f"{scratch.PREFIX}dead" / "rank0", tmp_path / f"{scratch.PREFIX}live" / "rank0"
    for directory, pid in ((dead, 999999), (live, os.getpid())):
        directory.mkdir(parents=True)
        (directory / "owner").write_text(f"{socket.gethostname()} {pid}")
    ownerless = tmp_path / f"{scratch.PREFIX}crashed" / "rank0"  # died before writing its owner
    ownerless.mkdir(parents=True)
    assert scratch.remove_stale_runs(tmp_path) == [dead]  # the ownerless one may still be being made
    old = time.time() - 2 * scratch.BEING_MADE_SECONDS
    os.utime(ownerless, (old, old))
    assert scratch.remove_stale_runs(tmp_path) == [ownerless]
    assert live.is_dir() and not dead.parent.exists()
