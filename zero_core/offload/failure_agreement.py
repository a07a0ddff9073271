"""The file tiers' one failure agreement: failures collected per rank, agreed across ranks, the same
:class:`OffloadError` raised on every rank.

A read or write runs on the I/O pool; its outcome is collected where it is waited for (:func:`succeeded`),
and at the tier's agreed points every rank calls :func:`raise_if_any_rank_failed` (a collective): the first
failure of each rank is gathered, and every rank raises the same error, naming the cause and the ranks.
Used by the parameter shards' files, the optimizer state's files and the staged load alike.
"""

from __future__ import annotations

import concurrent.futures

from ..collectives import CommContext, all_gather_objects


class OffloadError(RuntimeError):
    """Reading or writing offloaded state failed (on some rank); raised alike on every rank.

    What it means: with ``offload_optimizer="nvme"`` or ``offload_params="nvme"`` the engine keeps
    optimizer state or parameters in files under ``offload_dir``; writing them (the disk is full, the
    directory is gone or not writable) or reading them back (a file is short or missing, no memory to
    read into) failed. The message names the cause, the file and the ranks it happened on. The last
    checkpoint is untouched.

    What to do: free disk space under ``offload_dir`` or choose another ``offload_dir`` (a local disk
    every rank can write, with room for what the setup line says goes to disk), or offload to
    ``"cpu"`` instead; then restart and resume from the last checkpoint.
    """


def succeeded(future: concurrent.futures.Future, failures: list[str]) -> bool:
    """Whether a read or write finished; if not, why goes to ``failures`` (to be agreed across ranks)."""
    try:
        future.result()
        return True
    except OSError as error:
        failures.append(f"{error.strerror or error}: {error.filename or ''}".rstrip(": "))
    except (RuntimeError, MemoryError) as error:  # no memory to read into: agreed alike too
        failures.append(f"{type(error).__name__}: {error}")
    return False


def agreed_failure(reported: list[str | None], what: str, found: str = "") -> OffloadError | None:
    """From every rank's first failure (None: none), in rank order: the error every rank raises alike."""
    ranks = [rank for rank, failure in enumerate(reported) if failure]
    if not ranks:
        return None
    return OffloadError(
        f"ZeRO: {what} could not be read or written ({reported[ranks[0]]}, on ranks {ranks}){found}. Free disk "
        "space or choose another offload_dir; the last checkpoint is untouched (resume from it)."
    )


def raise_if_any_rank_failed(comm: CommContext, failures: list[str], label: str, what: str, found: str = "") -> None:
    """The same OffloadError on every rank if ``failures`` (this rank's) is not empty on any (a collective:
    every rank calls it at the same point). ``label`` names the collective; ``what`` the state that failed,
    ``found`` where it was found."""
    reported = all_gather_objects(comm, failures[0] if failures else None, label)
    error = agreed_failure(reported, what, found)
    if error is not None:
        raise error
