"""The wait half of a collective, on the CPU (work objects) and on CUDA side streams (events)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from .context import (
    BROKEN_GROUP_ADVICE,
    DIVERGENCE_ADVICE,
    CollectiveFailed,
    CollectiveLabel,
    CommContext,
    connections_closed,
)
from .stats import CollectiveKind


class Handle:
    """The wait half of a collective. ``wait()`` is safe to call twice.

    On the CPU it waits for the collective's work objects (one collective may
    be several calls, as gloo's rooted all-gather and reduce-scatter are). On
    a CUDA side stream it makes the caller's current stream wait for the event
    recorded after the collective: no host synchronisation.

    A wait that fails (the process group's timeout expired, a peer closed
    the connection) raises :class:`CollectiveFailed` naming the collective.
    """

    # The packed buffers a quantized collective (ZeRO++) holds until it is waited for: memory_report() counts them.
    wire_buffers: tuple[torch.Tensor, ...] = ()

    def __init__(
        self,
        work: dist.Work | list[dist.Work] | None = None,
        label: CollectiveLabel | None = None,
        rank: int = 0,
        after_wait: Callable[[], None] | None = None,
        done: torch.cuda.Event | None = None,
        keep_alive: tuple[torch.Tensor, ...] = (),
        issuer: torch.cuda.Stream | None = None,
    ):
        self._works = work if isinstance(work, list) else [] if work is None else [work]
        self._label = label
        self._rank = rank
        self._after_wait = after_wait  # e.g. copy the reduced slice out, once it is complete
        self._done = done
        # The stream that was current when the collective was issued: its tensors were
        # allocated there, so it must be ordered after the collective before they are freed.
        self._issuer = issuer
        # The side stream's tensors, referenced until that ordering is in place: freed earlier,
        # the caching allocator could hand their memory to new tensors while the collective
        # still reads or writes it.
        self._keep_alive = keep_alive

    def wait(self) -> None:
        if self._works:
            works, self._works = self._works, []
            failure: Exception | None = None
            with record_function("zero::wait"):  # exposed communication, in profiler traces
                for work in works:
                    try:
                        work.wait()
                    except (RuntimeError, dist.DistError) as error:
                        # Wait for the other calls all the same (each ends within the
                        # timeout): none may still write into buffers the caller frees next.
                        failure = failure or error
            if failure is not None:
                self._after_wait = None  # the output is incomplete: leave it untouched
                what = self._label.describe(self._rank) if self._label else "a collective"
                # A peer gone (killed, crashed, or out of the loop early): these processes cannot go on.
                advice = (BROKEN_GROUP_ADVICE if connections_closed(failure) else "") + DIVERGENCE_ADVICE
                raise CollectiveFailed(f"ZeRO: {what} did not complete: {failure}\n{advice}") from failure
        if self._done is not None:
            # Later kernels on the caller's stream see the collective's output.
            torch.cuda.current_stream(self._issuer.device).wait_event(self._done)
            self._order_issuer_after_side_stream()
        if self._after_wait is not None:
            after_wait, self._after_wait = self._after_wait, None
            after_wait()

    def is_completed(self) -> bool:
        """The collective has finished (``wait()`` would not block), without waiting for it."""
        done = self._done is None or self._done.query()
        return done and all(work.is_completed() for work in self._works)

    def _order_issuer_after_side_stream(self) -> None:
        if self._done is not None:
            self._issuer.wait_event(self._done)  # a no-op repeat when the caller's stream is the issuer
            self._done, self._keep_alive = None, ()

    def __del__(self) -> None:
        # A handle dropped unwaited (a failure path) must still not let its tensors' memory
        # be reused under a running collective.
        try:
            self._order_issuer_after_side_stream()
        except Exception:  # interpreter shutdown: nothing left to protect
            pass


def _label(comm: CommContext, kind: CollectiveKind, what: str) -> CollectiveLabel:
    return CollectiveLabel(kind, what, comm.progress.position())


def _handle(
    comm: CommContext,
    work: dist.Work | list[dist.Work] | None,
    kind: CollectiveKind,
    what: str,
    after_wait: Callable[[], None] | None = None,
) -> Handle:
    return Handle(work, _label(comm, kind, what), comm.rank, after_wait)


def _on_side_stream(
    comm: CommContext,
    stream: torch.cuda.Stream,
    tensors: tuple[torch.Tensor, ...],
    launch: Callable[[], None],
    kind: CollectiveKind,
    what: str,
) -> Handle:
    """CUDA, FSDP2's stream pattern: the side stream waits for what the compute stream
    wrote, the collective is enqueued on it synchronously (``async_op=False``, so it
    runs on that stream and not on NCCL's internal one, and nothing needs
    ``record_stream``), and an event recorded after it is what ``wait()`` orders the
    compute stream behind. All-gathers and reduce-scatters have a stream each, so a
    prefetch never queues behind a reduce-scatter."""
    issuer = torch.cuda.current_stream(stream.device)
    stream.wait_stream(issuer)
    with torch.cuda.stream(stream):
        launch()
        done = stream.record_event()
    return Handle(None, _label(comm, kind, what), comm.rank, done=done, keep_alive=tensors, issuer=issuer)
