"""Optimizers that need whole tensors (``torch.optim.Muon``), stepped over flat shards: each tensor at one owner.

ZeRO gives each rank flat pieces of its parameters; Muon orthogonalises each matrix's momentum as a whole
(Newton-Schulz), so no piece can be updated from its own elements. Each step, every parameter the optimizer
steps gets an owner rank of the shard group, balanced by the Newton-Schulz cost m·n·min(m, n). In rounds of
one tensor per owner, its holders send the owner their pieces of the fp32 master weight, the reduced
gradient and the state shaped like the weight (Muon's momentum); the owner runs the optimizer's own
``step`` on the whole tensors (the same code DDP runs, so the same numbers: bitwise where the whole-tensor
kernels match); and it sends each holder its pieces of the new weight and state back. Between steps the
state lives in the pieces (``optimizer.state[piece]``), sharded like every elementwise state: checkpoints,
resharding to another world size and ``memory_report()`` treat it as they treat Adam's.

Why not DeepSpeed's design (the momentum updated in place on each rank, only the momentum gathered, the
orthogonalised update sent back in bf16): it mirrors Muon's arithmetic in our code, and every change of
torch's Muon would have to be followed by hand. Here torch's own step runs; the price is the bytes: per
element of a stepped tensor not on its owner, 4 B of weight, 4 of gradient and 4 per state tensor there,
and 4 + 4 per state tensor back (counted as ``send`` in the traffic). In flight on a rank: one whole tensor
of each kind for the round it owns, beside the pieces it sends.

A failure of the owner's step (a hyperparameter torch refuses) is raised alike on every rank after the
round's exchange, so no rank waits alone.
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

import torch
import torch.distributed as dist

from .. import collectives
from ..collectives import CommContext, all_gather_objects
from ..unit import FlatUnit, MasterPiece
from ..unit.layout import ParamSlot, ShardPiece
from .host_step import raw_step_of
from .param_groups import OptimizerGroups
from .rebuild import whole_tensor_rule


class _Held(NamedTuple):
    """One parameter across the shard group: its slot, and each rank's piece of it (rank order)."""

    unit: FlatUnit
    slot: ParamSlot
    pieces: tuple[tuple[int, ShardPiece], ...]

    @property
    def cost(self) -> int:
        """Newton-Schulz's work for an m x n matrix is m·n·min(m, n); a tensor of another rank, its size."""
        shape = self.slot.shape
        return shape[0] * shape[1] * min(shape) if len(shape) == 2 else self.slot.numel


class _Round(NamedTuple):
    """What one rank stepped in one round: the whole tensors it owns, their group, their state."""

    held: _Held
    group: int
    weight: torch.Tensor
    state: dict[str, torch.Tensor]


def _balanced_owners(held: list[_Held], ranks: int) -> list[list[int]]:
    """Per rank, the indices into ``held`` it owns: the costliest first, each to the least loaded rank (ties to
    the lower rank), so every rank computes the same assignment."""
    load = [0] * ranks
    owned: list[list[int]] = [[] for _ in range(ranks)]
    for index in sorted(range(len(held)), key=lambda i: (-held[i].cost, i)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        load[rank] += held[index].cost
        owned[rank].append(index)
    return [sorted(indices) for indices in owned]


def _check_matrices(stepped: list[_Held]) -> None:
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
        self._held: dict[str, _Held] = {}
        self._master: dict[tuple[int, int], MasterPiece] = {}
        for unit in units:
            pieces: dict[int, list[tuple[int, ShardPiece]]] = defaultdict(list)
            for rank in range(comm.shard_size):
                for piece in unit.layout.pieces(rank):
                    pieces[piece.slot.index].append((rank, piece))
            for slot in unit.layout.slots:
                self._held[slot.fqns[0]] = _Held(unit, slot, tuple(pieces[slot.index]))
            for master in unit.master_pieces:
                self._master[(unit.index, master.piece.slot.index)] = master

    def step(self, groups: OptimizerGroups, slot_flags: list[list[bool]]) -> None:
        """Every rank together: each parameter of the groups stepped whole with a gradient somewhere
        (``slot_flags``, agreed) stepped at its owner; their pieces' ``.grad`` are then let go, so the
        optimizer's own step that follows leaves them alone and steps the other groups' pieces. Called with
        the groups showing the master pieces, their ``.grad`` attached."""
        optimizer = groups.optimizer
        rule = whole_tensor_rule(optimizer)
        assert rule is not None
        whole_groups = [rule.steps_whole(group) for group in optimizer.param_groups]
        stepped = [
            (index, self._held[name])
            for index, names in enumerate(groups.names)
            if whole_groups[index]
            for name in names
            if slot_flags[self._held[name].unit.index][self._held[name].slot.index]
        ]
        if rule.matrices_only:  # before anything is sent or let go
            _check_matrices([held for _, held in stepped])
        try:
            owned = _balanced_owners([held for _, held in stepped], self.comm.shard_size)
            failure: str | None = None
            for round_index in range(max((len(indices) for indices in owned), default=0)):
                this_round = {r: stepped[ix[round_index]] for r, ix in enumerate(owned) if round_index < len(ix)}
                mine = self._gather(this_round, rule.state_keys, optimizer)
                if mine is not None and failure is None:
                    failure = self._step_whole(optimizer, mine)
                self._scatter(this_round, rule.state_keys, optimizer, mine)
            self._raise_alike(failure, type(optimizer).__name__)
        finally:
            for _, held in stepped:
                master = self._master.get((held.unit.index, held.slot.index))
                if master is not None:
                    master.param.grad = None

    # -------------------------------------------------------------- exchange
    def _gather(self, this_round: dict[int, tuple[int, _Held]], keys: tuple[str, ...], optimizer) -> _Round | None:
        """The owners receive their tensors' pieces; this rank sends its pieces of the others' tensors."""
        me = self.comm.shard_rank
        sends: list[tuple[torch.Tensor, int]] = []
        receives: list[tuple[torch.Tensor, int]] = []
        mine: _Round | None = None
        for owner, (group, held) in sorted(this_round.items()):
            if owner == me:
                device = held.unit.storage.resting_master.device
                weight = torch.empty(held.slot.shape, dtype=torch.float32, device=device)
                weight.grad = torch.empty_like(weight)
                state = {key: torch.empty_like(weight) for key in keys}
                mine = _Round(held, group, weight, state)
                for rank, piece in held.pieces:
                    span = slice(piece.param_start, piece.param_start + piece.numel)
                    wholes = [weight.view(-1)[span], weight.grad.view(-1)[span]] + [
                        s.view(-1)[span] for s in state.values()
                    ]
                    if rank == me:
                        for whole, own in zip(wholes, self._own_tensors(held, keys, optimizer)):
                            whole.copy_(own)
                    else:
                        receives += [(whole, rank) for whole in wholes]
            elif any(rank == me for rank, _ in held.pieces):
                sends += [(own, owner) for own in self._own_tensors(held, keys, optimizer)]
        collectives.exchange(self.comm, sends, receives, "whole tensors to their owners").wait()
        return mine

    def _scatter(self, this_round, keys: tuple[str, ...], optimizer, mine: _Round | None) -> None:
        """Each holder's pieces of the new weight and state, from the owner, into its master piece and state."""
        me = self.comm.shard_rank
        sends: list[tuple[torch.Tensor, int]] = []
        receives: list[tuple[torch.Tensor, int]] = []
        for owner, (_, held) in sorted(this_round.items()):
            if owner == me:
                assert mine is not None
                for rank, piece in held.pieces:
                    span = slice(piece.param_start, piece.param_start + piece.numel)
                    wholes = [mine.weight.view(-1)[span]] + [mine.state[key].view(-1)[span] for key in keys]
                    if rank == me:
                        for own, whole in zip(self._own_targets(held, keys, optimizer), wholes):
                            own.copy_(whole)
                    else:
                        sends += [(whole, rank) for whole in wholes]
            elif any(rank == me for rank, _ in held.pieces):
                receives += [(own, owner) for own in self._own_targets(held, keys, optimizer)]
        collectives.exchange(self.comm, sends, receives, "whole tensors' updates to their holders").wait()

    def _own_tensors(self, held: _Held, keys: tuple[str, ...], optimizer) -> list[torch.Tensor]:
        """This rank's piece of the weight, its gradient and each state tensor (zeros before the first step,
        which is what the optimizer starts its state from)."""
        master = self._master[(held.unit.index, held.slot.index)]
        state = optimizer.state.get(master.param, {})
        weight = master.param.detach()
        return [weight, master.param.grad] + [state.get(key, torch.zeros_like(weight)) for key in keys]

    def _own_targets(self, held: _Held, keys: tuple[str, ...], optimizer) -> list[torch.Tensor]:
        """Where this rank's pieces of the new weight and state go: the master piece, its state (made here the
        first time, as the optimizer would make it)."""
        master = self._master[(held.unit.index, held.slot.index)]
        state = optimizer.state[master.param]
        weight = master.param.detach()
        for key in keys:
            if key not in state:
                state[key] = torch.empty_like(weight)
        return [weight] + [state[key] for key in keys]

    # ------------------------------------------------------------------ step
    def _step_whole(self, optimizer: torch.optim.Optimizer, mine: _Round) -> str | None:
        """The optimizer's own step (its class's, without the step hooks) on a view of it that lists only this
        whole tensor in its group and holds only its state: the user's groups and state are not touched."""
        view = object.__new__(type(optimizer))
        view.__dict__.update(optimizer.__dict__)  # the same hyperparameters, as a scheduler left them
        view.param_groups = [dict(group, params=[]) for group in optimizer.param_groups]
        view.param_groups[mine.group]["params"] = [mine.weight]
        view.state = defaultdict(dict, {mine.weight: mine.state})
        try:
            raw_step_of(optimizer)(view)
        except (ValueError, RuntimeError) as error:
            return f"{type(error).__name__}: {error} (stepping {mine.held.slot.fqns[0]})"
        stepped = view.state[mine.weight]
        for key in mine.state:
            if stepped[key] is not mine.state[key]:  # a state the step replaced rather than updated in place
                mine.state[key].copy_(stepped[key])
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
