"""The one error every checkpoint problem becomes."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint could not be saved or loaded; the message says why, root cause first.

    What it means: a step of a save or load failed on at least one rank (a full disk, a missing,
    truncated or corrupt file, a file from another save, a checkpoint of another model or
    optimizer, a directory that is not a checkpoint, a process group broken by an earlier
    failure), and every rank raises the same error, naming the file and the ranks. Because it is
    raised alike on every rank, ``except CheckpointError`` on one rank never leaves the others
    waiting. The model, optimizer, loss scaler and step counter are as they were before the failed
    call; a failed save removes its partial directory and leaves the previous checkpoint as it was.

    What to do: fix the cause the message names first: free disk space or save elsewhere; point
    the load at the checkpoint's directory (the one holding ``meta.pt`` and ``.metadata``); build
    the same model, ``ZeroConfig`` and optimizer as the run that saved it (missing, unexpected and
    mis-shaped keys are listed); save again where a file is corrupt. Call saves and loads on every
    rank (``trainer.save_checkpoint``, ``accelerator.save_state``, ``engine.save_checkpoint``), never
    under ``if rank == 0``. When the message says the process group is broken, restart every
    process and resume from the last checkpoint.
    """


def mismatch_error(what: str, missing: list[str], unexpected: list[str], misshaped: list[str]) -> CheckpointError:
    """One message naming every difference (the first ten of each kind)."""
    problems = [
        f"{label}: {names[:10]}{' ...' if len(names) > 10 else ''}"
        for label, names in (("missing keys", missing), ("unexpected keys", unexpected), ("mis-shaped", misshaped))
        if names
    ]
    return CheckpointError(f"{what}; " + "; ".join(problems))
