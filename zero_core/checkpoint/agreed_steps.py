"""One outcome on every rank for each filesystem step of a save or load.

Each step runs on every rank; its outcome (success, or the root cause of a
failure as text) is all-gathered before anyone goes on. A failure anywhere
becomes the same :class:`CheckpointError` on every rank, so no rank returns
normally from a save that failed elsewhere, and none is left waiting in a
collective the others never enter. A rank that never answers (stopped,
crashed) ends the wait after the process group's timeout, with a message
naming the step; a process group whose connections are gone (an earlier
collective failed, a peer exited) fails at once, and the message says so.
A save that fills its filesystem says so, with the numbers (disk_space.py).
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

from torch.distributed.checkpoint.api import CheckpointException

from ..collectives import CollectiveFailed, CommContext, all_gather_objects
from ..collectives.context import connections_closed, world_timeout
from .checkpoint_error import CheckpointError
from .disk_space import SaveSpace, SpaceReport, disk_full_message
from .unpickling import refusal_reason

T = TypeVar("T")


def root_cause(error: BaseException) -> str:
    """The most telling description of ``error``: an OS error's reason and path first."""
    if isinstance(error, CheckpointException):  # DCP's: the failures of every rank, wrapped
        causes = dict.fromkeys(root_cause(failure) for failure, _ in error.failures.values())
        return "; ".join(causes) or "DCP reported a failure without a cause"
    if isinstance(error, CheckpointError):
        return str(error)
    if isinstance(error, pickle.UnpicklingError):  # an object in a data file that weights_only refused
        return f"refusing to load an object from the checkpoint ({refusal_reason(error)})"
    seen: BaseException | None = error
    while seen is not None:  # the OSError under a wrapper says the most (disk full, permissions)
        if isinstance(seen, OSError) and seen.strerror:
            return f"{seen.strerror}: {seen.filename}" if seen.filename else seen.strerror
        seen = seen.__cause__ or seen.__context__
    return f"{type(error).__name__}: {error}"


def _is_peer_timeout(error: BaseException) -> bool:
    """A collective inside the step gave up on a peer (DCP's own gathers, for instance)."""
    failures = error.failures.values() if isinstance(error, CheckpointException) else [(error, None)]
    for failure, _ in failures:
        seen: BaseException | None = failure
        while seen is not None:
            text = str(seen).lower()
            if isinstance(seen, RuntimeError) and "timed out" in text:  # gloo's and NCCL's wording
                return True
            seen = seen.__cause__ or seen.__context__
    return False


def _is_broken_group(error: BaseException, waited: float, timeout: float | None) -> bool:
    """A collective that failed because the process group is broken, not because a peer never answered:
    the backend says its connections are closed, or it failed long before the group's timeout."""
    closed = connections_closed(error)
    if closed is not None:
        return closed
    return timeout is not None and waited < timeout / 2


class _Outcome(NamedTuple):
    error: str | None
    shared: Any  # what the step lets every rank see (small); None otherwise
    failed_ranks: tuple[int, ...] = ()  # where the error arose, when it came from another rank (DCP's)
    space: SpaceReport | None = None  # a save's: what this rank writes, the room there was, whether it ran out


class RankAgreement:
    """Runs the steps of one save or load (``operation``, e.g. "saving checkpoint /x").

    ``comm`` None: no process group (the consolidation tool); steps run alone.
    """

    def __init__(self, comm: CommContext | None, operation: str):
        self.comm = comm
        self.operation = operation
        self.space: SaveSpace | None = None  # a save's, once its directory is there

    @property
    def rank(self) -> int:
        return self.comm.rank if self.comm is not None else 0

    @property
    def world_size(self) -> int:
        return self.comm.world_size if self.comm is not None else 1

    def run(self, step: str, action: Callable[[], T], *, share: bool = False) -> tuple[T, list[Any]]:
        """``action()``'s result here once every rank's succeeded; with ``share``, also every rank's result."""
        result: Any = None
        local_error: BaseException | None = None
        try:
            result = action()
            outcome = _Outcome(None, result if share else None, space=self._space(None))
        except (Exception, CheckpointException) as error:  # DCP's is a BaseException
            failed = tuple(sorted(error.failures)) if isinstance(error, CheckpointException) else (self.rank,)
            outcome = _Outcome(root_cause(error), None, failed, self._space(error))
            local_error = error
        outcomes = self._gather(step, outcome, local_error)
        failures = {rank: o.error for rank, o in enumerate(outcomes) if o.error is not None}
        if failures:
            failures = self._told_as_disk_full(failures, outcomes)
            origins = sorted({rank for o in outcomes for rank in o.failed_ranks})
            raise CheckpointError(self._describe(step, failures, origins)) from local_error
        return result, [o.shared for o in outcomes]

    def _space(self, error: BaseException | None) -> SpaceReport | None:
        return self.space.report(error) if self.space is not None else None

    def _told_as_disk_full(self, failures: dict[int, str], outcomes: list[_Outcome]) -> dict[int, str]:
        """The ranks whose save filled the filesystem give one cause, made from every rank's report."""
        reports = [o.space for o in outcomes if o.space is not None]
        if self.space is None or len(reports) != len(outcomes) or not any(r.full for r in reports):
            return failures
        full = disk_full_message(self.space.path, reports)
        return {rank: full if reports[rank].full else cause for rank, cause in failures.items()}

    def _gather(self, step: str, outcome: _Outcome, local_error: BaseException | None) -> list[_Outcome]:
        if self.world_size == 1:
            return [outcome]
        assert self.comm is not None
        if local_error is not None and _is_peer_timeout(local_error):
            # The peer that stopped would not answer this gather either.
            raise CheckpointError(self._gave_up(step, outcome.error)) from local_error
        started = time.monotonic()
        try:
            return all_gather_objects(self.comm, outcome, f"{self.operation} ({step})")
        except CollectiveFailed as error:
            timeout = world_timeout(self.comm.device)
            waited = time.monotonic() - started
            # The backend's words only: the label of ours above it names the checkpoint's path.
            backend_error = error.__cause__ or error
            if _is_broken_group(backend_error, waited, timeout.total_seconds() if timeout is not None else None):
                raise CheckpointError(self._broken(step)) from error
            raise CheckpointError(self._gave_up(step, str(backend_error))) from error

    def _broken(self, step: str) -> str:
        # The same words on every rank: each rank's backend error (in the chain) differs.
        then = "load the last checkpoint that saved" if self.operation.startswith("saving") else "load it"
        return (
            f"{self.operation} failed while {step}: the process group is broken: its connections between the "
            "ranks are closed (an earlier collective failed or timed out on some rank, or a process exited), so "
            "collectives fail at once instead of waiting, and none can complete in these processes again. Restart "
            f"every process, then {then}."
        )

    def _gave_up(self, step: str, detail: str | None) -> str:
        return (
            f"{self.operation}: rank {self.rank} gave up waiting for the other ranks while {step}: one of them "
            "did not answer within the process group's timeout (stopped, crashed, or not saving/loading this "
            f"checkpoint at the same time). ({detail})"
        )

    def _describe(self, step: str, failures: dict[int, str], origins: list[int]) -> str:
        by_cause: dict[str, list[int]] = {}
        for rank, cause in failures.items():
            by_cause.setdefault(cause, []).append(rank)
        if len(by_cause) == 1:
            causes = next(iter(by_cause))
        else:
            causes = "; ".join(f"{cause} ({_ranks(ranks)})" for cause, ranks in by_cause.items())
        return f"{causes} ({self.operation} failed while {step}, on {_ranks(origins)})."


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
