"""The one module that calls into ``torch.distributed``.

Collectives are pure functions: tensors, a :class:`CommContext` (process
group, stream, byte counters) in; a :class:`Handle` whose ``wait()`` is the
second half out. Counting bytes and choosing a primitive per backend happen
here and nowhere else. World size 1 takes the same path with the
communication skipped.

Byte counts are the logical payload the ZeRO formulas speak of: the full
(gathered) size of an all-gather, the full (input) size of a reduce-scatter,
the tensor size of an all-reduce or broadcast. They are kept per kind and per
:class:`Span` (which ranks took part), so hybrid sharding reports what
crossed the slow links between shard groups apart from what stayed inside one.

Hybrid sharding (``ZeroConfig.shard_group_size``): model states are sharded
inside groups of consecutive ranks (a node, as torchrun numbers them) and
replicated across groups. Parameter all-gathers and gradient reduce-scatters
run inside the shard group, the gradient shards are then all-reduced across
groups (between the ranks holding the same shard), and agreements, buffer
broadcasts and checkpoints span every rank.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

# torch 2.13 renamed the tensor collectives; keep working on older releases.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveKind(str, Enum):
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    BROADCAST = "broadcast"


class Span(str, Enum):
    """Which ranks a collective runs between."""

    WORLD = "every rank"
    SHARD_GROUP = "inside the shard group"  # the ranks that together hold one copy of the model state
    ACROSS_GROUPS = "across shard groups"  # the ranks holding the same shard, one per group


@dataclass
class CollectiveCount:
    calls: int = 0
    numel: int = 0
    bytes: int = 0


@dataclass
class CommStats:
    """Calls, elements and bytes per collective kind since the last reset."""

    counts: dict[CollectiveKind, CollectiveCount] = field(
        default_factory=lambda: {kind: CollectiveCount() for kind in CollectiveKind}
    )
    # The same calls again, by the ranks they ran between (hybrid sharding's link classes).
    spans: dict[Span, CollectiveCount] = field(default_factory=lambda: {span: CollectiveCount() for span in Span})

    def record(self, kind: CollectiveKind, tensor: torch.Tensor, span: Span = Span.SHARD_GROUP) -> None:
        for count in (self.counts[kind], self.spans[span]):
            count.calls += 1
            count.numel += tensor.numel()
            count.bytes += tensor.numel() * tensor.element_size()

    def reset(self) -> None:
        for kind in CollectiveKind:
            self.counts[kind] = CollectiveCount()
        for span in Span:
            self.spans[span] = CollectiveCount()

    def span_snapshot(self) -> dict[str, CollectiveCount]:
        """Calls, elements and bytes per :class:`Span` (keyed by its name, e.g. ``"ACROSS_GROUPS"``)."""
        return {span.name: CollectiveCount(**vars(c)) for span, c in self.spans.items()}

    def snapshot(self) -> dict[str, CollectiveCount]:
        return {kind.value: CollectiveCount(**vars(c)) for kind, c in self.counts.items()}

    @staticmethod
    def difference(
        later: dict[str, CollectiveCount], earlier: dict[str, CollectiveCount]
    ) -> dict[str, CollectiveCount]:
        return {
            kind: CollectiveCount(
                *(getattr(later[kind], f) - getattr(earlier[kind], f) for f in ("calls", "numel", "bytes"))
            )
            for kind in later
        }


class CollectiveFailed(RuntimeError):
    """A collective did not complete: a peer left, or the process group's timeout expired.

    Almost always the ranks stopped running the same forwards, backwards and
    steps; the message says which collective of which unit, in which phase of
    which step, this rank was waiting for.
    """


DIVERGENCE_ADVICE = (
    "Every rank must run the same forwards, backwards and optimizer steps, in the same order: "
    "a forward, backward or step on some ranks only (evaluation or predict on rank 0 only, a batch "
    "skipped on one rank, an exception caught on one rank) leaves the others waiting. For work on one "
    "rank, gather on every rank first with engine.gathered_parameters() or engine.full_state_dict(). "
    "How long a rank waits is the process group's timeout: init_process_group(timeout=...), "
    "Lightning's DDP-style strategies' timeout=..., Accelerate's InitProcessGroupKwargs(timeout=...)."
)


class Position(NamedTuple):
    """Where the training loop was when a collective was issued (for error messages)."""

    phase: str
    optimizer_step: int


def _nowhere() -> Position:
    return Position("setup", 0)


class CollectiveLabel(NamedTuple):
    kind: "CollectiveKind"
    what: str  # the unit or object it moves, e.g. "unit 'blocks.2'"
    position: Position

    def describe(self, rank: int) -> str:
        phase, step = self.position
        return f"{self.kind.value} of {self.what} (rank {rank}, {phase}, optimizer step {step})"


# (the world's process group, shard group size, timeout) -> (this rank's shard group, its replicate
# group). Keyed by the world group object itself: a world destroyed and initialised again is another key.
_SUBGROUPS: dict[tuple[object, int, object], tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}


def _world_timeout(device: torch.device) -> datetime.timedelta | None:
    """The timeout the world was initialised with (``init_process_group(timeout=...)``, Lightning's
    and Accelerate's timeout settings), for hybrid sharding's subgroups: ``new_group`` would give
    them the backend's default instead (30 minutes on gloo), so a rank that stopped would be
    waited for that long. torch has no public getter; None (the default) if this one moved."""
    try:
        return dist.group.WORLD._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None


@dataclass
class CommContext:
    """Where collectives run: the group, this rank's place in it, the stream.

    ``group``/``rank``/``world_size`` are every rank training together;
    ``shard_*`` the ranks this rank shards model states with (all of them,
    unless hybrid sharding split them into groups, see :meth:`split`).
    """

    group: dist.ProcessGroup | None
    rank: int
    world_size: int
    device: torch.device
    stats: CommStats = field(default_factory=CommStats)
    backend: str = "gloo"
    # CUDA only: collectives run on their own streams, ordered with events.
    all_gather_stream: torch.cuda.Stream | None = None
    reduce_scatter_stream: torch.cuda.Stream | None = None
    # Set by the engine: the phase and step that failure messages name.
    position: Callable[[], Position] = _nowhere
    shard_group: dist.ProcessGroup | None = None
    shard_rank: int = 0
    shard_size: int = 1
    replicate_group: dist.ProcessGroup | None = None  # the ranks holding this rank's shard, one per group
    replicas: int = 1  # how many shard groups hold a copy of the model state

    @classmethod
    def create(cls, group: dist.ProcessGroup | None, device: torch.device) -> "CommContext":
        """Every rank of ``group`` (default: the world) in one shard group; :meth:`split` divides it."""
        backend = "gloo"
        if dist.is_available() and dist.is_initialized():
            rank, world_size = dist.get_rank(group), dist.get_world_size(group)
            backend = str(dist.get_backend(group))
        else:
            rank, world_size = 0, 1
        streams: tuple[torch.cuda.Stream | None, torch.cuda.Stream | None] = (None, None)
        if device.type == "cuda" and backend != "gloo":
            # Gloo's CUDA collectives stage through the host on streams of their own.
            streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return cls(
            group,
            rank,
            world_size,
            device,
            CommStats(),
            backend,
            *streams,
            shard_group=group,
            shard_rank=rank,
            shard_size=world_size,
        )

    def split(self, shard_group_size: int) -> None:
        """Hybrid sharding: shard inside groups of ``shard_group_size`` consecutive ranks
        (a node, as torchrun numbers ranks), replicate across them. Every rank calls it
        with the same size (the setup agreement compared it)."""
        size = shard_group_size
        if size == self.world_size:
            return
        if size > self.world_size or self.world_size % size:
            raise ValueError(
                f"ZeroConfig.shard_group_size={size} must divide the number of ranks ({self.world_size}): "
                "use the number of devices per node, or leave it unset to shard across every rank."
            )
        if self.world_size != dist.get_world_size():
            # new_group needs every rank of the world, and ranks outside this group never get here.
            raise ValueError(
                "ZeroConfig.shard_group_size needs the engine to span every rank: build it without "
                "process_group= (hybrid sharding makes its own groups inside the world)."
            )
        world = dist.group.WORLD
        for stale in [key for key in _SUBGROUPS if key[0] is not world]:
            del _SUBGROUPS[stale]  # of a world destroyed since: its groups are gone with it
        timeout = _world_timeout(self.device)
        key = (world, size, timeout)
        if key not in _SUBGROUPS:
            # Every rank creates every subgroup, in the same order, as new_group requires; engines
            # built again with the same size reuse them (groups are never freed before the world).
            create = lambda ranks: dist.new_group(ranks, backend=dist.get_backend(), timeout=timeout)  # noqa: E731
            shard_groups = [create(list(range(first, first + size))) for first in range(0, self.world_size, size)]
            replicate_groups = [create(list(range(offset, self.world_size, size))) for offset in range(size)]
            _SUBGROUPS[key] = (shard_groups[self.rank // size], replicate_groups[self.rank % size])
        self.shard_group, self.replicate_group = _SUBGROUPS[key]
        self.shard_rank, self.shard_size, self.replicas = self.rank % size, size, self.world_size // size

    def span(self, span: "Span") -> tuple[dist.ProcessGroup | None, int]:
        """The process group and its size that ``span`` names, from this rank."""
        if span is Span.SHARD_GROUP:
            return self.shard_group, self.shard_size
        if span is Span.ACROSS_GROUPS:
            return self.replicate_group, self.replicas
        return self.group, self.world_size

    def rank_in(self, span: "Span") -> int:
        """This rank's index among the ranks ``span`` names."""
        if span is Span.SHARD_GROUP:
            return self.shard_rank
        if span is Span.ACROSS_GROUPS:
            return self.rank // self.shard_size
        return self.rank

    @property
    def uses_rooted_collectives(self) -> bool:
        """On gloo, all-gather as one broadcast per rank and reduce-scatter as one
        reduce per rank, each on its slice of the flat buffer in place.

        Gloo's list-form all-gather and reduce-scatter flatten their inputs into
        a freshly allocated buffer and copy the result out (and its single-tensor
        forms are emulated with an all-reduce); broadcast and reduce run on the
        tensor itself (measured in benchmarks/NOTES.md,
        "Collectives on gloo"). NCCL keeps its single-tensor collectives.
        """
        return self.backend == "gloo"


class Handle:
    """The wait half of a collective. ``wait()`` is safe to call twice.

    On the CPU it waits for the collective's work objects (one collective may
    be several calls, as gloo's rooted all-gather and reduce-scatter are). On
    a CUDA side stream it makes the caller's current stream wait for the event
    recorded after the collective: no host synchronisation.

    A wait that fails (the process group's timeout expired, a peer closed
    the connection) raises :class:`CollectiveFailed` naming the collective.
    """

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
                raise CollectiveFailed(f"ZeRO: {what} did not complete: {failure}\n{DIVERGENCE_ADVICE}") from failure
        if self._done is not None:
            # Later kernels on the caller's stream see the collective's output.
            torch.cuda.current_stream(self._issuer.device).wait_event(self._done)
            self._order_issuer_after_side_stream()
        if self._after_wait is not None:
            after_wait, self._after_wait = self._after_wait, None
            after_wait()

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
    return CollectiveLabel(kind, what, comm.position())


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


def all_gather(
    comm: CommContext,
    gathered_out: torch.Tensor,
    shard_in: torch.Tensor,
    label: str = "parameters",
    span: Span = Span.SHARD_GROUP,
) -> Handle:
    """Fill ``gathered_out`` (group size * shard numel) with every rank's shard, in group rank order."""
    comm.stats.record(CollectiveKind.ALL_GATHER, gathered_out, span)
    group, size = comm.span(span)
    with record_function("zero::all_gather"):
        in_place = gathered_out.data_ptr() == shard_in.data_ptr()
        if gathered_out.numel() == 0 or (size == 1 and in_place):
            return Handle()
        if comm.all_gather_stream is not None:
            # World size 1 too: NCCL runs one-rank collectives, so one GPU exercises this path.
            return _on_side_stream(
                comm,
                comm.all_gather_stream,
                (gathered_out, shard_in),
                lambda: _all_gather_single(gathered_out, shard_in, group=group, async_op=False),
                CollectiveKind.ALL_GATHER,
                label,
            )
        if size == 1:
            gathered_out.copy_(shard_in)
            return Handle()
        if comm.uses_rooted_collectives:
            slices = gathered_out.chunk(size)
            own = slices[comm.rank_in(span)]
            if own.data_ptr() != shard_in.data_ptr():
                own.copy_(shard_in)
            # Each rank broadcasts its slice, in place in every rank's flat output.
            works = [
                dist.broadcast(piece, group_src=src, group=group, async_op=True) for src, piece in enumerate(slices)
            ]
            return _handle(comm, works, CollectiveKind.ALL_GATHER, label)
        work = _all_gather_single(gathered_out, shard_in, group=group, async_op=True)
        return _handle(comm, work, CollectiveKind.ALL_GATHER, label)


def reduce_scatter(
    comm: CommContext, shard_out: torch.Tensor, full_in: torch.Tensor, label: str = "gradients"
) -> Handle:
    """Sum ``full_in`` over the shard group and leave this rank's slice in ``shard_out``.

    ``shard_out`` may be this rank's slice of ``full_in`` itself. The rest of
    ``full_in`` is undefined afterwards (gloo reduces in it).
    """
    comm.stats.record(CollectiveKind.REDUCE_SCATTER, full_in, Span.SHARD_GROUP)
    with record_function("zero::reduce_scatter"):
        if full_in.numel() == 0:
            return Handle()
        size = comm.shard_size
        own = full_in.chunk(size)[comm.shard_rank]
        in_place = own.data_ptr() == shard_out.data_ptr()
        if size == 1 and in_place:
            return Handle()
        if comm.reduce_scatter_stream is not None:
            # World size 1 too: NCCL runs one-rank collectives, so one GPU exercises this path.
            return _on_side_stream(
                comm,
                comm.reduce_scatter_stream,
                (shard_out, full_in),
                lambda: _reduce_scatter_single(shard_out, full_in, group=comm.shard_group, async_op=False),
                CollectiveKind.REDUCE_SCATTER,
                label,
            )
        if size == 1:
            shard_out.copy_(full_in)
            return Handle()
        if comm.uses_rooted_collectives:
            # Each slice is summed onto the rank that owns it, in place. The slices
            # this rank does not own are left holding partial sums: ``full_in`` is
            # scratch once handed over.
            works = [
                dist.reduce(piece, group_dst=dst, group=comm.shard_group, async_op=True)
                for dst, piece in enumerate(full_in.chunk(size))
            ]
            copy_out = None if in_place else (lambda: shard_out.copy_(own))
            return _handle(comm, works, CollectiveKind.REDUCE_SCATTER, label, after_wait=copy_out)
        work = _reduce_scatter_single(shard_out, full_in, group=comm.shard_group, async_op=True)
        return _handle(comm, work, CollectiveKind.REDUCE_SCATTER, label)


def all_reduce(
    comm: CommContext,
    tensor: torch.Tensor,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    label: str = "step flags",
    span: Span = Span.WORLD,
) -> Handle:
    comm.stats.record(CollectiveKind.ALL_REDUCE, tensor, span)
    group, size = comm.span(span)
    with record_function("zero::all_reduce"):
        if size == 1:
            return Handle()
        work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
        return _handle(comm, work, CollectiveKind.ALL_REDUCE, label)


def broadcast(comm: CommContext, tensor: torch.Tensor, src_rank: int = 0, label: str = "buffers") -> Handle:
    """Broadcast to every rank from ``src_rank`` of the group (a group rank, not a global one)."""
    comm.stats.record(CollectiveKind.BROADCAST, tensor, Span.WORLD)
    with record_function("zero::broadcast"):
        if comm.world_size == 1:
            return Handle()
        work = dist.broadcast(tensor, group_src=src_rank, group=comm.group, async_op=True)
        return _handle(comm, work, CollectiveKind.BROADCAST, label)


def differing_values(checks: dict[str, int], reduced: list[float]) -> list[str]:
    """``reduced`` ends with ``checks``' values then their negations, all-reduced with MAX
    (each value's highest and lowest over ranks): the values that differ between ranks,
    each as "name: lowest on some ranks, highest on others"; empty when all agree."""
    count = len(checks)
    highest = reduced[len(reduced) - 2 * count : len(reduced) - count]
    lowest = [-v for v in reduced[len(reduced) - count :]]
    return [
        f"{name}: {int(lo)} on some ranks, {int(hi)} on others"
        for name, lo, hi in zip(checks, lowest, highest)
        if lo != hi
    ]


def true_on_any_rank(
    comm: CommContext, flags: list[bool], what: str, must_agree: dict[str, int] | None = None
) -> list[bool]:
    """Per position: true on every rank if true on any rank.

    Ranks that disagree on how many flags there are, or on any value of
    ``must_agree`` (integers below 2**52, checked in the same call), get the
    same error.
    """
    n = len(flags)
    checks = {f"{what} (how many)": n, **(must_agree or {})}
    # The counts first, in a tensor of fixed size: all-reducing tensors of
    # different sizes is itself a mismatch no check could report.
    values = list(checks.values())
    agreed = torch.tensor(values + [-v for v in values], dtype=torch.float64, device=comm.device)
    all_reduce(comm, agreed, dist.ReduceOp.MAX, label=what).wait()
    differing = differing_values(checks, agreed.tolist())
    if differing:
        raise CollectiveFailed(f"ZeRO: ranks disagree on {'; '.join(differing)}.\n{DIVERGENCE_ADVICE}")
    tensor = torch.tensor([float(f) for f in flags], dtype=torch.float32, device=comm.device)
    all_reduce(comm, tensor, dist.ReduceOp.MAX, label=what).wait()
    return [v > 0 for v in tensor.tolist()]


def all_gather_objects(comm: CommContext, obj: object, label: str) -> list:
    """Every rank's small picklable ``obj``, in rank order: for agreements, not data.

    Not counted in ``comm.stats``: those count the model-state traffic the
    ZeRO formulas describe. A peer that never answers ends this after the
    process group's timeout with :class:`CollectiveFailed` naming ``label``.
    """
    if comm.world_size == 1:
        return [obj]
    gathered: list = [None] * comm.world_size
    # NCCL moves the pickled bytes through the current CUDA device: make it ours.
    device = torch.cuda.device(comm.device) if comm.device.type == "cuda" else contextlib.nullcontext()
    with record_function("zero::all_gather_object"), device:
        try:
            dist.all_gather_object(gathered, obj, group=comm.group)
        except (RuntimeError, ValueError) as error:  # gloo: timeout, closed connection
            raise CollectiveFailed(f"ZeRO: {label} did not complete on every rank ({error}).") from error
    return gathered
