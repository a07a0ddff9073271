"""Optimizers that need whole tensors under ZeRO, planned: how each one's state lives between steps, which
rank steps which tensor, in which rounds, and what that sends.

Pure functions of the optimizer's class and the units' layouts, alike on every rank with no collective: the
step's exchange (``optim/whole_tensor_step.py``) runs this plan, the checkpoint loaders ask its rules which
state shapes to accept, and ``zero-estimate`` counts the same bytes from a model's layouts before launch.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from enum import Enum
from typing import NamedTuple

import torch

from .muon_with_adamw import MuonWithAuxAdamW
from .unit.layout import FlatLayout, ParamSlot, ShardPiece


class StateKind(Enum):
    """How a whole-tensor optimizer's state value lives between steps: what the exchange sends and keeps."""

    PER_ELEMENT = "per element"  # shaped like the parameter (a momentum): sharded like it, in each holder's pieces
    FACTOR = "factor"  # a smaller fp32 tensor on the weight's device (a row or column mean): every holder keeps it
    STEP = "step"  # a 0-d fp32 step count on the host, as torch keeps it: every holder keeps it
    COUNT = "count"  # a Python int step count, as transformers' Adafactor keeps it: every holder keeps it


class StateEntry(NamedTuple):
    key: str
    shape: tuple[int, ...]  # the whole tensor's (() for a count)
    kind: StateKind


def _muon_state(shape: tuple[int, ...], group: dict) -> tuple[StateEntry, ...]:
    return (StateEntry("momentum_buffer", shape, StateKind.PER_ELEMENT),)


def _adafactor_state(shape: tuple[int, ...], group: dict) -> tuple[StateEntry, ...]:
    """torch's Adafactor: the second moment factored into a row and a column mean for a tensor of 2 or more
    dimensions (reduced over its last, then its second-last dimension), per element for a vector."""
    step = StateEntry("step", (), StateKind.STEP)
    if len(shape) < 2:
        return (step, StateEntry("variance", shape, StateKind.PER_ELEMENT))
    rows = (*shape[:-1], 1)
    columns = (*shape[:-2], 1, shape[-1])
    return (step, StateEntry("row_var", rows, StateKind.FACTOR), StateEntry("col_var", columns, StateKind.FACTOR))


def _transformers_adafactor_state(shape: tuple[int, ...], group: dict) -> tuple[StateEntry, ...]:
    """transformers' Adafactor (the Hugging Face Trainer's ``optim="adafactor"``): its row and column means drop
    the reduced dimension, a first moment when the group has ``beta1``, the weight's RMS, a Python step count."""
    entries = [StateEntry("step", (), StateKind.COUNT), StateEntry("RMS", (), StateKind.FACTOR)]
    if group.get("beta1") is not None:
        entries.append(StateEntry("exp_avg", shape, StateKind.PER_ELEMENT))
    if len(shape) >= 2:
        entries += [
            StateEntry("exp_avg_sq_row", shape[:-1], StateKind.FACTOR),
            StateEntry("exp_avg_sq_col", (*shape[:-2], shape[-1]), StateKind.FACTOR),
        ]
    else:
        entries.append(StateEntry("exp_avg_sq", shape, StateKind.PER_ELEMENT))
    return tuple(entries)


def newton_schulz_cost(shape: tuple[int, ...]) -> int:
    """Newton-Schulz's work for an m x n matrix, m·n·min(m, n); another tensor, its size."""
    return shape[0] * shape[1] * min(shape) if len(shape) == 2 else math.prod(shape)


class WholeTensorRule(NamedTuple):
    """How an optimizer that needs whole tensors runs under ZeRO: the state it keeps for a parameter of a given
    shape in a given group (zeros before the first step, which is where the optimizer starts its own), the work
    of stepping a tensor (to balance the owners), and which of its groups are stepped whole (``group_flag``: the
    groups whose value for that key is true; None: every group)."""

    state_of: Callable[[tuple[int, ...], dict], tuple[StateEntry, ...]]
    cost_of: Callable[[tuple[int, ...]], int]
    group_flag: str | None = None
    matrices_only: bool = False  # a tensor of its whole groups that is not 2-D is refused, as torch's Muon does

    def steps_whole(self, group: dict) -> bool:
        return self.group_flag is None or group.get(self.group_flag) is True


# Optimizers that need whole tensors and run here whole, each tensor at one owner rank (whole_tensor_step.py).
STEPPED_WHOLE: dict[type[torch.optim.Optimizer], WholeTensorRule] = {
    torch.optim.Muon: WholeTensorRule(_muon_state, newton_schulz_cost, matrices_only=True),
    # Its AdamW groups step their pieces.
    MuonWithAuxAdamW: WholeTensorRule(_muon_state, newton_schulz_cost, group_flag="use_muon", matrices_only=True),
    # Every tensor whole, vectors too: its step size reads the norm of the whole weight and of the whole update.
    torch.optim.Adafactor: WholeTensorRule(_adafactor_state, math.prod),
}
_TRANSFORMERS_ADAFACTOR = WholeTensorRule(_transformers_adafactor_state, math.prod)


def whole_tensor_rule(optimizer: torch.optim.Optimizer) -> WholeTensorRule | None:
    """How ``optimizer`` runs under ZeRO if it needs whole tensors (None: it steps this rank's pieces itself)."""
    rule = next((rule for kind, rule in STEPPED_WHOLE.items() if isinstance(optimizer, kind)), None)
    # transformers' own Adafactor, looked up only where transformers is loaded (it is not a dependency).
    optimization = sys.modules.get("transformers.optimization")
    if rule is None and optimization is not None and isinstance(optimizer, optimization.Adafactor):
        return _TRANSFORMERS_ADAFACTOR
    return rule


def kept_state_entry(optimizer: torch.optim.Optimizer | None, shape: tuple[int, ...], key: str) -> StateEntry | None:
    """The rule's entry for ``key`` of a parameter of ``shape`` (its shape and kind do not depend on the group;
    only whether a group keeps it does, so every group is asked)."""
    rule = whole_tensor_rule(optimizer) if optimizer is not None else None
    if rule is None:
        return None
    entries = (entry for group in optimizer.param_groups for entry in rule.state_of(shape, group))
    return next((entry for entry in entries if entry.key == key), None)


def whole_state_problem(
    optimizer: torch.optim.Optimizer | None, shape: tuple[int, ...], key: str, size: tuple[int, ...]
) -> str | None:
    """Why a loaded state value of ``size`` (a number's: ``()``) cannot be ``key`` of a parameter of ``shape``
    for this optimizer: a key its rule keeps must have the rule's shape (the exchange copies it into whole
    tensors of that shape). None: the rule does not keep the key (the checks for elementwise state apply), or
    the shape is its own."""
    entry = kept_state_entry(optimizer, shape, key)
    if entry is None or tuple(size) == entry.shape:
        return None
    return f"{key} {tuple(size)}, {type(optimizer).__name__} keeps {entry.shape} for a parameter of {shape}"


def is_whole_state(
    optimizer: torch.optim.Optimizer | None, shape: tuple[int, ...], key: str, size: tuple[int, ...]
) -> bool:
    """A tensor the rule keeps whole on every holder (Adafactor's row and column means), with its shape: never
    sharded, even where its shape is the parameter's (the row means of an m x 1 matrix)."""
    entry = kept_state_entry(optimizer, shape, key)
    return entry is not None and entry.kind is not StateKind.PER_ELEMENT and entry.shape == tuple(size)


# A step count is a Python int below float64's exact range (it travels in the packed float64 tensor).
_LARGEST_COUNT = 2**53


def count_problem(value: object) -> str | None:
    """Why a loaded value cannot be a ``StateKind.COUNT`` (None: it can)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _LARGEST_COUNT:
        return f"{value!r}, not a step count (an int from 0 to 2**53)"
    return None


class PlannedTensor(NamedTuple):
    """One parameter stepped whole, across the shard group: its slot, each rank's piece of it (rank order), its
    optimizer group and the state its rule keeps for it."""

    slot: ParamSlot
    pieces: tuple[tuple[int, ShardPiece], ...]
    group: int
    entries: tuple[StateEntry, ...]

    @property
    def name(self) -> str:
        return self.slot.fqns[0]

    @property
    def per_element(self) -> list[StateEntry]:
        return [entry for entry in self.entries if entry.kind is StateKind.PER_ELEMENT]

    @property
    def kept_whole(self) -> list[StateEntry]:
        """The state every holder keeps whole, sent packed in one flat float64 tensor (fp32 values and step
        counts both exact in it)."""
        return [entry for entry in self.entries if entry.kind is not StateKind.PER_ELEMENT]

    @property
    def kept_numel(self) -> int:
        return sum(math.prod(entry.shape) for entry in self.kept_whole)

    def holds(self, rank: int) -> bool:
        return any(holder == rank for holder, _ in self.pieces)

    def kept_source(self, owner: int) -> int:
        """Who gives the owner the whole state: the owner itself if it holds a piece, else the first holder."""
        return owner if self.holds(owner) else self.pieces[0][0]


def pieces_by_slot(layout: FlatLayout) -> list[tuple[tuple[int, ShardPiece], ...]]:
    """Each slot of a unit's layout (by index): every rank's piece of it, in rank order, as the holders of a
    tensor stepped whole."""
    pieces: list[list[tuple[int, ShardPiece]]] = [[] for _ in layout.slots]
    for rank in range(layout.world_size):
        for piece in layout.pieces(rank):
            pieces[piece.slot.index].append((rank, piece))
    return [tuple(held) for held in pieces]


def balanced_owners(costs: list[int], ranks: int) -> list[list[int]]:
    """Per rank, the indices into ``costs`` it owns: the costliest first, each to the least loaded rank (ties to
    the lower rank), so every rank computes the same assignment."""
    load = [0] * ranks
    owned: list[list[int]] = [[] for _ in range(ranks)]
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        load[rank] += costs[index]
        owned[rank].append(index)
    return [sorted(indices) for indices in owned]


def owner_rounds(owned: list[list[int]], sizes: list[int]) -> list[dict[int, list[int]]]:
    """Each owner's tensors in rounds, a round holding as many as fit in the largest tensor's size (at least
    one), so many small tensors (Adafactor's vectors) do not cost an exchange each."""
    cap = max(sizes, default=0)
    queues = [list(indices) for indices in owned]
    rounds: list[dict[int, list[int]]] = []
    while any(queues):
        this_round: dict[int, list[int]] = {}
        for owner, queue in enumerate(queues):
            taken, size = [], 0
            while queue and (not taken or size + sizes[queue[0]] <= cap):
                size += sizes[queue[0]]
                taken.append(queue.pop(0))
            if taken:
                this_round[owner] = taken
        rounds.append(this_round)
    return rounds


class StepRounds(NamedTuple):
    """The plan of one step: each round's tensors by owner (indices into the stepped list)."""

    stepped: list[PlannedTensor]
    rounds: list[dict[int, list[int]]]

    @classmethod
    def plan(cls, stepped: list[PlannedTensor], rule: WholeTensorRule, shard_size: int) -> StepRounds:
        owned = balanced_owners([rule.cost_of(tuple(t.slot.shape)) for t in stepped], shard_size)
        return cls(stepped, owner_rounds(owned, [t.slot.numel for t in stepped]))

    def sent_bytes(self, rank: int) -> int:
        """What ``rank`` sends in the step, to the owners and back, as the exchange sends it: fp32 weight,
        gradient and per-element state pieces to an owner (and the packed whole state from its source), fp32
        weight and per-element state pieces back to each holder with the packed whole state."""
        sent = 0
        for this_round in self.rounds:
            for owner, indices in this_round.items():
                for tensor in (self.stepped[i] for i in indices):
                    kept = 8 * tensor.kept_numel
                    for holder, piece in tensor.pieces:
                        if holder == rank != owner:
                            sent += 4 * (2 + len(tensor.per_element)) * piece.numel
                        if owner == rank != holder:
                            sent += 4 * (1 + len(tensor.per_element)) * piece.numel + kept
                    if rank != owner and tensor.kept_source(owner) == rank:
                        sent += kept
        return sent

    def working_bytes(self, rank: int) -> int:
        """The most ``rank`` builds at once as an owner: one round's whole fp32 weights, gradients and
        per-element state, and their packed whole state (what is in flight besides the pieces it sends)."""
        most = 0
        for this_round in self.rounds:
            tensors = [self.stepped[i] for i in this_round.get(rank, [])]
            most = max(most, sum(4 * (2 + len(t.per_element)) * t.slot.numel + 8 * t.kept_numel for t in tensors))
        return most
