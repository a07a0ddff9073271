"""Where collectives run (:class:`CommContext`: groups, ranks, streams, counters), hybrid sharding's
subgroups, how a collective that did not complete is named, and the process group destroyed at interpreter
exit once an engine took it (at the end of this file)."""

from __future__ import annotations

import dataclasses
import datetime
import weakref
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist

from .stats import CollectiveKind, CommStats, Span


class CollectiveFailed(RuntimeError):
    """A collective did not complete: a peer left, or the process group's timeout expired.

    What it means: almost always the ranks stopped running the same forwards, backwards and
    optimizer steps (evaluation or predict on rank 0 only, a batch skipped on one rank, an exception
    caught on one rank), so this rank waited for a collective the others never entered, until a
    peer exited or the process group's timeout expired. The message says which collective of which
    unit (its module path), in which phase of which optimizer step, this rank was waiting for. The
    same error, naming what differs, is raised on every rank when the ranks compare how many
    forwards, backwards and steps they ran at an optimizer step, or disagree on values every rank
    must share.

    What to do: run the same forwards, backwards and ``optimizer.step()`` on every rank, in the same
    order; for work on one rank only, gather on every rank first (``with engine.gathered_parameters():``
    or ``engine.full_state_dict()``), then compute or write on one. If a rank is legitimately slow
    (a long first compile, a slow filesystem), raise the process group's timeout:
    ``init_process_group(timeout=...)``, the ``timeout=`` of Lightning's strategies, or Accelerate's
    ``InitProcessGroupKwargs(timeout=...)``. After a collective timed out or a peer left, restart every
    process (the process group's connections are gone) and resume from the last checkpoint.
    """


DIVERGENCE_ADVICE = (
    "Every rank must run the same forwards, backwards and optimizer steps, in the same order: "
    "a forward, backward or step on some ranks only (evaluation or predict on rank 0 only, a batch "
    "skipped on one rank, an exception caught on one rank) leaves the others waiting. For work on one "
    "rank, gather on every rank first with engine.gathered_parameters() or engine.full_state_dict(). "
    "How long a rank waits is the process group's timeout: init_process_group(timeout=...), "
    "Lightning's DDP-style strategies' timeout=..., Accelerate's InitProcessGroupKwargs(timeout=...)."
)

BROKEN_GROUP_ADVICE = (
    "The process group is broken: its connections between the ranks are closed (a process exited, crashed or "
    "was killed, or a collective timed out on some rank), so no collective can complete in these processes "
    "again: restart every process, then resume from the last checkpoint that saved. If a rank left early or ran "
    "other work: "
)

# gloo's and NCCL's words for connections that are gone: a peer exited, or a collective that failed
# (timed out, mismatched) made the backend close them or abort the communicator.
_CLOSED_WORDS = ("connection closed by peer", "pair closure", "connection reset by peer", "broken pipe", "aborted")


def connections_closed(error: BaseException) -> bool | None:
    """What the backend's error (or one it was raised from) says: True where its connections are closed (the
    process group is broken), False where a peer did not answer in time, None where it says neither."""
    seen: BaseException | None = error
    while seen is not None:
        text = str(seen).lower()
        if isinstance(seen, dist.DistNetworkError) or any(word in text for word in _CLOSED_WORDS):
            return True
        if "timed out" in text:  # gloo's and NCCL's wording for a peer that did not answer in time
            return False
        seen = seen.__cause__ or seen.__context__
    return None


class Position(NamedTuple):
    """Where the training loop was when a collective was issued (for error messages)."""

    phase: str
    optimizer_step: int


@dataclass
class TrainingProgress:
    """Where training is, for the message of a collective that fails: one per engine, made with its comm and
    given to the parts that move it. The pass state (``passes/state.py``) writes ``phase`` at each of its
    transitions; the optimizer step counts ``steps`` here (the one count: checkpoints save it, a resume sets
    it). A comm outside an engine stays at the setup."""

    phase: str = "setup"
    steps: int = 0  # optimizer steps applied (overflow-skipped ones not counted)

    def position(self) -> Position:
        return Position(self.phase, self.steps)


Subgroups = list[tuple[tuple[int, ...], dist.ProcessGroup]]  # (global ranks, their group)


def _create_subgroups(
    layout: tuple[tuple[int, ...], ...], size: int, timeout: datetime.timedelta | None
) -> tuple[Subgroups, Subgroups]:
    """Every rank creates every subgroup of every data-parallel group (``layout``, global ranks), in the same
    order, as new_group requires: groups of ``size`` consecutive ranks, and the ranks at the same place in
    each. Engines built again alike reuse them (groups are never freed before the world)."""
    create = lambda ranks: (ranks, dist.new_group(list(ranks), backend=dist.get_backend(), timeout=timeout))  # noqa: E731
    shard_groups, replicate_groups = [], []
    for ranks in layout:
        shard_groups += [create(ranks[first : first + size]) for first in range(0, len(ranks), size)]
        replicate_groups += [create(ranks[offset::size]) for offset in range(size)]
    return shard_groups, replicate_groups


class CollectiveLabel(NamedTuple):
    kind: "CollectiveKind"
    what: str  # the unit or object it moves, e.g. "unit 'blocks.2'"
    position: Position

    def describe(self, rank: int) -> str:
        phase, step = self.position
        return f"{self.kind.value} of {self.what} (rank {rank}, {phase}, optimizer step {step})"


# (the world's process group, shard group size, timeout, data-parallel layout) -> every shard group and
# every replicate group. Keyed by the world group object itself: a world destroyed and initialised
# again is another key.
_SUBGROUPS: dict[tuple[object, int, object, tuple], tuple[Subgroups, Subgroups]] = {}


def world_timeout(device: torch.device) -> datetime.timedelta | None:
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
    unless hybrid sharding split them into groups, see :meth:`in_shard_groups`).
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
    # The phase and step that failure messages name, moved by the engine's pass state and optimizer step.
    progress: TrainingProgress = field(default_factory=TrainingProgress)
    shard_group: dist.ProcessGroup | None = None
    shard_rank: int = 0
    shard_size: int = 1
    replicate_group: dist.ProcessGroup | None = None  # the ranks holding this rank's shard, one per group
    replicas: int = 1  # how many shard groups hold a copy of the model state
    # A 2-D mesh: the ranks that split each layer with this one (tensor parallelism). ``group`` is then
    # this rank's data-parallel group; the tensor-parallel ranks hold different model states.
    tensor_parallel_group: dist.ProcessGroup | None = None
    tensor_parallel_rank: int = 0
    tensor_parallel_size: int = 1
    # A 2-D mesh: the global ranks of every data-parallel group (one per tensor-parallel rank), which hybrid
    # sharding splits alike; None: ``group`` is the whole world.
    data_parallel_groups: tuple[tuple[int, ...], ...] | None = None
    # hpZ (ZeRO++): the consecutive ranks of the shard group that keep a unit's pieces between its forward
    # and its backward (``with_secondary_groups``); size 1: every rank keeps the whole unit.
    secondary_group: dist.ProcessGroup | None = None
    secondary_size: int = 1
    # qgZ's second hop (ZeRO++): the ranks at this rank's place in each secondary group of the shard group.
    # Only without hybrid sharding (one shard group); None: gradients reduce in one hop.
    across_secondary_group: dist.ProcessGroup | None = None

    @classmethod
    def create(
        cls, group: dist.ProcessGroup | None, device: torch.device, progress: TrainingProgress | None = None
    ) -> "CommContext":
        """Every rank of ``group`` (default: the world) in one shard group; :meth:`in_shard_groups` divides it.
        ``progress``: another comm's, when both serve one engine (its messages name the same step)."""
        backend = "gloo"
        if dist.is_available() and dist.is_initialized():
            rank, world_size = dist.get_rank(group), dist.get_world_size(group)
            backend = str(dist.get_backend(group))
            destroy_process_group_at_exit()  # the first engine on a group: from now on it must end cleanly
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
            progress=progress if progress is not None else TrainingProgress(),
        )

    def in_shard_groups(self, shard_group_size: int) -> CommContext:
        """Hybrid sharding: this context, sharding inside groups of ``shard_group_size`` consecutive ranks
        (a node, as torchrun numbers ranks) and replicating across them. Every rank calls it with the same
        size (the setup agreement compared it). On a 2-D mesh each data-parallel group is split alike. A new
        context: the one it is made from stays as it was (the setup's agreement ran on it)."""
        size = shard_group_size
        if size == self.world_size:
            return self
        if size > self.world_size or self.world_size % size:
            raise ValueError(
                f"ZeroConfig.shard_group_size={size} must divide the number of ranks ({self.world_size}): "
                "use the number of devices per node, or leave it unset to shard across every rank."
            )
        shard_group, replicate_group = self._consecutive_groups(
            size, "shard_group_size", "hybrid sharding makes its own groups"
        )
        return dataclasses.replace(
            self,
            shard_group=shard_group,
            replicate_group=replicate_group,
            shard_rank=self.rank % size,
            shard_size=size,
            replicas=self.world_size // size,
        )

    def _consecutive_groups(self, size: int, setting: str, whose: str) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        """This rank's group of ``size`` consecutive ranks and the group of the ranks at its place in the
        others, each data-parallel group split alike; every rank makes every group, in the same order (the
        ``setting`` named in the error, ``whose`` groups they are)."""
        layout = self.data_parallel_groups or (tuple(range(dist.get_world_size())),)
        if self.data_parallel_groups is None and self.world_size != dist.get_world_size():
            # new_group needs every rank of the world, and ranks outside this group never get here.
            raise ValueError(
                f"ZeroConfig.{setting} needs the engine to span every rank: build it without "
                f"process_group= ({whose} inside the world)."
            )
        world = dist.group.WORLD
        for stale in [key for key in _SUBGROUPS if key[0] is not world]:
            del _SUBGROUPS[stale]  # of a world destroyed since: its groups are gone with it
        timeout = world_timeout(self.device)
        key = (world, size, timeout, layout)
        if key not in _SUBGROUPS:
            _SUBGROUPS[key] = _create_subgroups(layout, size, timeout)
        me = dist.get_rank()
        consecutive, replicate = (next(g for ranks, g in groups if me in ranks) for groups in _SUBGROUPS[key])
        return consecutive, replicate

    def with_secondary_groups(self, size: int) -> CommContext:
        """hpZ: this context with groups of ``size`` consecutive ranks inside each shard group, made by every
        rank alike (after :meth:`in_shard_groups`, with the agreed size); a new context, as there."""
        if size >= self.shard_size or self.shard_size % size:
            raise ValueError(
                f"ZeroConfig.secondary_shard_group_size={size} must divide the ranks of a shard group "
                f"({self.shard_size}) and be smaller: use the devices per node (or fewer), or leave it unset."
            )
        if size == 1:
            return dataclasses.replace(self, secondary_size=1)  # each rank keeps the whole unit: no group
        groups = self._consecutive_groups(size, "secondary_shard_group_size", "the secondary groups are made")
        # The ranks at one place in each group (qgZ's second hop): inside the shard group only then.
        across = groups[1] if self.replicas == 1 else None
        return dataclasses.replace(self, secondary_size=size, secondary_group=groups[0], across_secondary_group=across)

    def span(self, span: "Span") -> tuple[dist.ProcessGroup | None, int]:
        """The process group and its size that ``span`` names, from this rank."""
        if span is Span.SHARD_GROUP:
            return self.shard_group, self.shard_size
        if span is Span.ACROSS_GROUPS:
            return self.replicate_group, self.replicas
        if span is Span.TENSOR_PARALLEL:
            return self.tensor_parallel_group, self.tensor_parallel_size
        if span is Span.SECONDARY:
            return self.secondary_group, self.secondary_size
        if span is Span.ACROSS_SECONDARY:
            return self.across_secondary_group, self.shard_size // self.secondary_size
        return self.group, self.world_size

    def rank_in(self, span: "Span") -> int:
        """This rank's index among the ranks ``span`` names."""
        if span is Span.SHARD_GROUP:
            return self.shard_rank
        if span is Span.ACROSS_GROUPS:
            return self.rank // self.shard_size
        if span is Span.TENSOR_PARALLEL:
            return self.tensor_parallel_rank
        if span is Span.SECONDARY:
            return self.shard_rank % self.secondary_size
        if span is Span.ACROSS_SECONDARY:
            return self.shard_rank // self.secondary_size
        return self.rank

    @property
    def uses_rooted_collectives(self) -> bool:
        """On gloo, all-gather as one broadcast per rank and reduce-scatter as one
        reduce per rank, each on its slice of the flat buffer in place (over two
        CPU ranks, a reduce-scatter into a shard of its own is one exchange instead:
        ``collectives/ops.py``).

        Gloo's list-form all-gather and reduce-scatter flatten their inputs into
        a freshly allocated buffer and copy the result out (and its single-tensor
        forms are emulated with an all-reduce); broadcast and reduce run on the
        tensor itself (measured in benchmarks/NOTES.md,
        "Collectives on gloo"). NCCL keeps its single-tensor collectives.
        """
        return self.backend == "gloo"


# ---------------------------------------------------------------- the process group at interpreter exit
# At interpreter exit: the default process group destroyed while the interpreter is still whole.
#
# A gloo process group still alive when the interpreter finalizes is destroyed with it: its worker
# threads can then release work objects that hold tensors (a GIL taken during finalization) or be
# destroyed unjoined, and a run that finished every step ends in SIGABRT ("terminate called without an
# active exception"), which torchrun reports as a failed job. torch destroys nothing at exit (pytorch
# #179291 proposed it), and Lightning destroys the group at exit for NCCL only.
#
# Nothing happens at import. The clean-up is armed when it is first needed: the first time an engine
# takes a process group (``CommContext.create``), so runs under any adapter, or none, end cleanly. It
# must still run after the exit handlers the script registers, even those registered before the engine
# was built (a user's own ``atexit.register(dist.destroy_process_group)``, a last metric's all-reduce):
# those still need the group. So it is a ``weakref.finalize`` with ``atexit=True`` rather than an
# ``atexit`` handler of its own: finalizers run from the one exit handler ``weakref`` registers when the
# first finalizer of the process is made, which ``import torch`` does, so it runs after every handler
# registered once torch is imported, whenever the engine arms it. A script that destroys the group
# itself is unaffected (the clean-up then finds nothing to do). The meetings' own exit handler,
# registered at the first meeting, runs before it and still has the store.


class _Process:
    """Lives as long as the interpreter: the object the exit-time clean-up is attached to."""


_PROCESS = _Process()
_armed: weakref.finalize | None = None


def destroy_process_group_at_exit() -> None:
    """Arms the exit-time clean-up, once per process."""
    global _armed
    if _armed is None:
        _armed = weakref.finalize(_PROCESS, _destroy_if_initialized)  # atexit=True is finalize's default


def _destroy_if_initialized() -> None:
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - exiting either way; nothing is left to report it to
            pass
