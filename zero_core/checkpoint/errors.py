"""The one error every checkpoint problem becomes."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint could not be saved or loaded; the message says why, root cause first.

    Raised alike on every rank, so ``except CheckpointError`` on one rank
    never leaves the others waiting. The model, optimizer, loss scaler and
    step counter are as they were before the failed call.
    """


def mismatch_error(what: str, missing: list[str], unexpected: list[str], misshaped: list[str]) -> CheckpointError:
    """One message naming every difference (the first ten of each kind)."""
    problems = [
        f"{label}: {names[:10]}{' ...' if len(names) > 10 else ''}"
        for label, names in (("missing keys", missing), ("unexpected keys", unexpected), ("mis-shaped", misshaped))
        if names
    ]
    return CheckpointError(f"{what}; " + "; ".join(problems))
