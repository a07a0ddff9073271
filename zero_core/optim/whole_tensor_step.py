"""Optimizers that need whole tensors (``torch.optim.Muon``, ``Adafactor``), stepped over flat shards: each
tensor at one owner.

ZeRO gives each rank flat pieces of its parameters; Muon orthogonalises each matrix's momentum as a whole
(Newton-Schulz) and Adafactor factors each matrix's second moment into row and column means and scales its
step by the whole weight's norm, so no piece can be updated from its own elements. Each step, every
parameter the optimizer steps gets an owner rank of the shard group, balanced by the rule's cost (Muon's
m·n·min(m, n)). In rounds, its holders send the owner their pieces of the fp32 master weight, the reduced
gradient and the state shaped like the weight (Muon's momentum), and one holder the state every holder keeps
whole (Adafactor's factors and step); the owner runs the optimizer's own ``step`` on the whole tensors (the
same code DDP runs, so the same numbers: bitwise where the whole-tensor kernels match); and it sends each
holder its pieces of the new weight and per-element state, and the new whole state. Between steps the state
lives in the pieces (``optimizer.state[piece]``): per-element state sharded like Adam's, the factors (a row
and a column, small beside the matrix) and the step on every holder of the tensor. So checkpoints, resharding
to another world size and ``memory_report()`` treat it as they treat Adam's (``rebuild.StateKind``).

Why not DeepSpeed's design (the momentum updated in place on each rank, only the momentum gathered, the
orthogonalised update sent back in bf16): it mirrors Muon's arithmetic in our code, and every change of
torch's Muon would have to be followed by hand. Here torch's own step runs; the price is the bytes: per
element of a stepped tensor not on its owner, 4 B of weight, 4 of gradient and 4 per per-element state
tensor there, and 4 + 4 per state tensor back (counted as ``send`` in the traffic), plus the small whole
state. A round gives each owner tensors up to the size of the largest stepped tensor, so in flight on a rank
is at most that many elements of each kind for the round it owns, beside the pieces it sends.

A failure of the owner's step (a hyperparameter torch refuses) is raised alike on every rank after the
round's exchange, so no rank waits alone.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .. import collectives
from ..collectives import CommContext, all_gather_objects
from ..unit import FlatUnit, MasterPiece
from ..unit.layout import ParamSlot, ShardPiece
from ..whole_tensor_plan import (
    PlannedTensor,
    StateEntry,
    StateKind,
    StepRounds,
    WholeTensorRule,
    pieces_by_slot,
    whole_tensor_rule,
)
from .host_step import raw_step_of
from .param_groups import OptimizerGroups


class _Whole(NamedTuple):
    """One tensor at its owner for a round: the whole weight (``.grad`` the whole gradient), its state."""

    held: PlannedTensor
    weight: torch.Tensor
    state: dict[str, torch.Tensor]  # the per-element state, whole
    kept: torch.Tensor  # the packed whole state (empty when the rule keeps none)


def _check_matrices(stepped: list[PlannedTensor]) -> None:
    """Muon's constructor refuses a tensor that is not 2-D; one added later (``add_param_group``) is refused
    here, on every rank alike (they see the same shapes), before anything is sent."""
    for held in stepped:
        if len(held.slot.shape) != 2:
            raise ValueError(
                f"Muon only supports 2D parameters whereas we found a parameter with size: "
                f"{tuple(held.slot.shape)} ({held.slot.fqns[0]}). Give Muon the hidden matrices and "
                "another optimizer (AdamW) the embeddings, norms, biases and head."
            )


def check_whole_tensor_settings(
    optimizer: torch.optim.Optimizer, units: list[FlatUnit], nvme: bool, in_backward: bool
) -> None:
    """The settings the optimizers of ``STEPPED_WHOLE`` do not run with yet, refused when one is attached (every
    rank alike: the settings were agreed)."""
    if whole_tensor_rule(optimizer) is None:
        return
    refused = [
        (nvme, 'offload_optimizer="nvme" (its state is stepped unit by unit from files)', 'offload_optimizer="cpu"'),
        (in_backward, "offload_step_in_backward (units step one by one during backward)", "leave it off"),
        (
            any(slot.place is not None for unit in units for slot in unit.layout.slots),
            "tensor parallelism (each rank holds part of each matrix)",
            "a data-parallel mesh only",
        ),
    ]
    for applies, what, instead in refused:
        if applies:
            raise ValueError(
                f"{type(optimizer).__name__} under ZeRO does not run with {what}: use {instead}, "
                "or an elementwise optimizer."
            )


class WholeTensorStep:
    """The step of an optimizer in ``STEPPED_WHOLE`` over this rank's master pieces (see the module's text)."""

    def __init__(self, units: list[FlatUnit], comm: CommContext):
        self.comm = comm
        self._slots: dict[str, tuple[FlatUnit, ParamSlot, tuple[tuple[int, ShardPiece], ...]]] = {}
        self._device: dict[str, torch.device] = {}  # where each parameter's master rests
        # The round's whole tensors this rank owns, alive from its gather to its scatter (memory_report() counts
        # them as communication bytes); empty between rounds and outside the step.
        self.in_flight: list[torch.Tensor] = []
        self._master: dict[str, MasterPiece] = {}
        for unit in units:
            pieces = pieces_by_slot(unit.layout)
            for slot in unit.layout.slots:
                self._slots[slot.fqns[0]] = (unit, slot, pieces[slot.index])
                self._device[slot.fqns[0]] = unit.storage.resting_master.device
            for master in unit.master_pieces:
                self._master[master.piece.slot.fqns[0]] = master

    def step(self, groups: OptimizerGroups, slot_flags: list[list[bool]]) -> None:
        """Every rank together: each parameter of the groups stepped whole with a gradient somewhere
        (``slot_flags``, agreed) stepped at its owner; their pieces' ``.grad`` are then let go, so the
        optimizer's own step that follows leaves them alone and steps the other groups' pieces. Called with
        the groups showing the master pieces, their ``.grad`` attached."""
        optimizer = groups.optimizer
        rule = whole_tensor_rule(optimizer)
        assert rule is not None
        stepped = self._stepped(groups, slot_flags, rule)
        if rule.matrices_only:  # before anything is sent or let go
            _check_matrices(stepped)
        try:
            plan = StepRounds.plan(stepped, rule, self.comm.shard_size)
            failure: str | None = None
            for this_round in plan.rounds:
                tensors = {owner: [stepped[i] for i in indices] for owner, indices in this_round.items()}
                mine = self._gather(tensors, optimizer)
                self.in_flight = [t for w in mine for t in (w.weight, w.weight.grad, w.kept, *w.state.values())]
                if mine and failure is None:
                    failure = self._step_whole(optimizer, mine)
                self._scatter(tensors, optimizer, mine)
                self.in_flight = []
            self._raise_alike(failure, type(optimizer).__name__)
        finally:
            self.in_flight = []
            for held in stepped:
                master = self._master.get(held.name)
                if master is not None:
                    master.param.grad = None

    def _stepped(
        self, groups: OptimizerGroups, slot_flags: list[list[bool]], rule: WholeTensorRule
    ) -> list[PlannedTensor]:
        """The parameters of the whole groups with a gradient somewhere, in the groups' order (alike on every
        rank: the names and flags are)."""
        stepped = []
        for index, (group, names) in enumerate(zip(groups.optimizer.param_groups, groups.names)):
            if not rule.steps_whole(group):
                continue
            for name in names:
                unit, slot, pieces = self._slots[name]
                if slot_flags[unit.index][slot.index] and slot.numel:  # an empty tensor has nothing to step
                    stepped.append(PlannedTensor(slot, pieces, index, rule.state_of(tuple(slot.shape), group)))
        return stepped

    # -------------------------------------------------------------- exchange
    def _gather(self, tensors: dict[int, list[PlannedTensor]], optimizer) -> list[_Whole]:
        """The owners receive their tensors' pieces (and whole state); this rank sends its part of the others'."""
        me = self.comm.shard_rank
        sends: list[tuple[torch.Tensor, int]] = []
        receives: list[tuple[torch.Tensor, int]] = []
        mine: list[_Whole] = []
        for owner, held_list in sorted(tensors.items()):
            for held in held_list:
                if owner == me:
                    whole = self._whole_buffers(held)
                    mine.append(whole)
                    for rank, piece in held.pieces:
                        span = slice(piece.param_start, piece.param_start + piece.numel)
                        parts = [whole.weight.view(-1)[span], whole.weight.grad.view(-1)[span]]
                        parts += [whole.state[e.key].view(-1)[span] for e in held.per_element]
                        if rank == me:
                            for part, own in zip(parts, self._own_pieces(held, optimizer)):
                                part.copy_(own)
                        else:
                            receives += [(part, rank) for part in parts]
                    source = held.kept_source(owner)
                    if source == me:
                        whole.kept.copy_(self._own_kept(held, optimizer, whole.kept.device))
                    elif whole.kept.numel():
                        receives.append((whole.kept, source))
                elif held.holds(me):
                    sends += [(own, owner) for own in self._own_pieces(held, optimizer)]
                    if held.kept_source(owner) == me and held.kept_whole:
                        sends.append((self._own_kept(held, optimizer, self._device[held.name]), owner))
        collectives.exchange(self.comm, sends, receives, "whole tensors to their owners").wait()
        return mine

    def _scatter(self, tensors: dict[int, list[PlannedTensor]], optimizer, mine: list[_Whole]) -> None:
        """Each holder's pieces of the new weight and per-element state, and the new whole state, from the owner."""
        me = self.comm.shard_rank
        sends: list[tuple[torch.Tensor, int]] = []
        receives: list[tuple[torch.Tensor, int]] = []
        arriving: list[tuple[PlannedTensor, torch.Tensor]] = []  # whole state to keep once received
        by_name = {whole.held.name: whole for whole in mine}
        for owner, held_list in sorted(tensors.items()):
            for held in held_list:
                if owner == me:
                    whole = by_name[held.name]
                    for rank, piece in held.pieces:
                        span = slice(piece.param_start, piece.param_start + piece.numel)
                        parts = [whole.weight.view(-1)[span]]
                        parts += [whole.state[e.key].view(-1)[span] for e in held.per_element]
                        if rank == me:
                            for own, part in zip(self._own_targets(held, optimizer), parts):
                                own.copy_(part)
                            self._keep(held, optimizer, whole.kept)
                        else:
                            sends += [(part, rank) for part in parts]
                            if held.kept_whole:
                                sends.append((whole.kept, rank))
                elif held.holds(me):
                    receives += [(own, owner) for own in self._own_targets(held, optimizer)]
                    if held.kept_whole:
                        kept = torch.empty(held.kept_numel, dtype=torch.float64, device=self._device[held.name])
                        receives.append((kept, owner))
                        arriving.append((held, kept))
        collectives.exchange(self.comm, sends, receives, "whole tensors' updates to their holders").wait()
        for held, kept in arriving:
            self._keep(held, optimizer, kept)

    # ----------------------------------------------------- this rank's parts
    def _whole_buffers(self, held: PlannedTensor) -> _Whole:
        """The owner's whole tensors for one parameter, filled by the exchange."""
        device = self._device[held.name]
        weight = torch.empty(held.slot.shape, dtype=torch.float32, device=device)
        weight.grad = torch.empty_like(weight)
        state = {entry.key: torch.empty_like(weight) for entry in held.per_element}
        kept = torch.empty(held.kept_numel, dtype=torch.float64, device=device)
        return _Whole(held, weight, state, kept)

    def _master_of(self, held: PlannedTensor) -> MasterPiece:
        return self._master[held.name]

    def _own_pieces(self, held: PlannedTensor, optimizer) -> list[torch.Tensor]:
        """This rank's piece of the weight, its gradient and each per-element state tensor (zeros before the
        first step, which is what the optimizer starts its state from)."""
        master = self._master_of(held)
        state = optimizer.state.get(master.param, {})
        weight = master.param.detach()
        # fp32 on the wire whatever a load left (a DDP state dict of a bf16 model): the owner's whole tensors are.
        parts = [state.get(e.key, torch.zeros_like(weight)).to(torch.float32) for e in held.per_element]
        return [weight, master.param.grad, *parts]

    def _own_kept(self, held: PlannedTensor, optimizer, device: torch.device) -> torch.Tensor:
        """The whole state this holder keeps, packed (zeros before the first step)."""
        return _packed(held.kept_whole, optimizer.state.get(self._master_of(held).param, {}), device)

    def _own_targets(self, held: PlannedTensor, optimizer) -> list[torch.Tensor]:
        """Where this rank's pieces of the new weight and per-element state go: the master piece, its state
        (made here the first time, as the optimizer would make it)."""
        master = self._master_of(held)
        state = optimizer.state[master.param]
        weight = master.param.detach()
        for entry in held.per_element:
            if entry.key not in state or state[entry.key].dtype != torch.float32:  # as the fp32 master's optimizer
                state[entry.key] = torch.empty_like(weight)
        return [weight] + [state[entry.key] for entry in held.per_element]

    def _keep(self, held: PlannedTensor, optimizer, kept: torch.Tensor) -> None:
        """The new whole state into this holder's state, as the optimizer keeps it."""
        optimizer.state[self._master_of(held).param].update(_unpacked(held.kept_whole, kept, self._device[held.name]))

    # ------------------------------------------------------------------ step
    def _step_whole(self, optimizer: torch.optim.Optimizer, mine: list[_Whole]) -> str | None:
        """The optimizer's own step (its class's, without the step hooks) on a view of it that lists only this
        round's whole tensors in their groups and holds only their state: the user's groups and state are not
        touched."""
        view = object.__new__(type(optimizer))
        view.__dict__.update(optimizer.__dict__)  # the same hyperparameters, as a scheduler left them
        view.param_groups = [dict(group, params=[]) for group in optimizer.param_groups]
        view.state = defaultdict(dict)
        try:  # any failure here is this owner's alone: reported, and raised alike on every rank after the round
            for whole in mine:
                view.param_groups[whole.held.group]["params"].append(whole.weight)
                kept = _unpacked(whole.held.kept_whole, whole.kept, whole.kept.device)
                view.state[whole.weight] = {**whole.state, **kept}
            raw_step_of(optimizer)(view)
            for whole in mine:
                stepped = view.state[whole.weight]
                for key, value in whole.state.items():
                    if stepped[key] is not value:  # a state the step replaced rather than updated in place
                        value.copy_(stepped[key])
                whole.kept.copy_(_packed(whole.held.kept_whole, stepped, whole.kept.device))
        except Exception as error:
            names = ", ".join(whole.held.slot.fqns[0] for whole in mine)
            return f"{type(error).__name__}: {error} (stepping {names})"
        return None

    def _raise_alike(self, failure: str | None, name: str) -> None:
        """One small all-reduce per step: any owner's failure raised on every rank, with the first one's text."""
        flag = torch.tensor([0.0 if failure is None else 1.0], device=self.comm.device)
        collectives.all_reduce(self.comm, flag, dist.ReduceOp.MAX, "whole-tensor step outcome").wait()
        if flag.item() == 0:
            return
        reported = all_gather_objects(self.comm, failure, "whole-tensor step failure")
        ranks = [rank for rank, text in enumerate(reported) if text]
        raise ValueError(f"ZeRO: {name}.step() failed on ranks {ranks}: {reported[ranks[0]]}")


def _packed(entries: list[StateEntry], state: dict, device: torch.device) -> torch.Tensor:
    """The whole state's values in one flat float64 tensor, in the rule's order (zeros for those not made yet:
    where the optimizer starts them)."""
    values = [
        torch.as_tensor(state[e.key], dtype=torch.float64).reshape(-1).to(device)
        if e.key in state
        else torch.zeros(math.prod(e.shape), dtype=torch.float64, device=device)
        for e in entries
    ]
    return torch.cat(values) if values else torch.empty(0, dtype=torch.float64, device=device)


def _unpacked(entries: list[StateEntry], kept: torch.Tensor, device: torch.device) -> dict[str, Any]:
    """The whole state's values from their packed tensor, as the optimizer keeps them (``StateKind``): fp32
    tensors on the weight's device, an fp32 0-d step on the host, an int step count."""
    values: dict[str, Any] = {}
    start = 0
    for entry in entries:
        size = math.prod(entry.shape)
        flat = kept[start : start + size]
        start += size
        if entry.kind is StateKind.COUNT:
            values[entry.key] = int(flat.item())
        elif entry.kind is StateKind.STEP:
            values[entry.key] = flat.to("cpu", torch.float32).reshape(())
        else:
            values[entry.key] = flat.to(device, torch.float32).reshape(entry.shape)
    return values
