"""What the user's optimizer's ``param_groups`` hold, and when.

Between steps each group's ``params`` lists the model's own parameters, as
under DDP, so whatever reads or edits groups sees what it built: schedulers,
``optimizer.add_param_group(...)`` (which refuses a parameter already in a
group, as usual), and Lightning's ``BaseFinetuning``, which maps the group
tensors back to parameter names and re-creates the groups on restart.

For the duration of ``optimizer.step()``, ``optimizer.state_dict()`` and
``optimizer.load_state_dict()`` each group holds this rank's fp32 master
pieces of its parameters instead: the update runs on them, and
``optimizer.state`` is keyed by them. The groups are re-read by name before
each of these, so a group added or replaced in between trains from then on.
"""

from __future__ import annotations

import contextlib
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterator
from enum import Enum

import torch
from torch import nn

from ..agreement import describe_value
from ..mesh import OPTIMIZER_BEFORE_SPLIT, made_before_split
from ..unit import FlatUnit
from .rebuild import canonical_names


class GroupsHold(Enum):
    """What ``optimizer.param_groups[i]["params"]`` lists right now."""

    MODEL_PARAMETERS = "model parameters"  # between steps: what users, schedulers and callbacks see
    MASTER_PIECES = "master pieces"  # inside step / state_dict / load_state_dict


class OptimizerGroups:
    """The optimizer's groups by parameter name (every rank alike), and the switch between the two views."""

    def __init__(self, optimizer: torch.optim.Optimizer, units: list[FlatUnit]):
        self.optimizer = optimizer
        self._name_of = canonical_names(units)
        self._param_of: dict[str, nn.Parameter] = {}
        self._pieces_of: dict[str, list[nn.Parameter]] = defaultdict(list)
        for unit in units:
            for slot, param in zip(unit.layout.slots, unit.params):
                self._param_of[slot.fqns[0]] = param
            for master in unit.master_pieces:
                self._pieces_of[master.piece.slot.fqns[0]].append(master.param)
        self.holding = GroupsHold.MODEL_PARAMETERS
        # (group index, the list of pieces it was given): what show_model_parameters puts back.
        self._shown_pieces: list[tuple[int, list[nn.Parameter], list[str]]] = []
        self.names: list[list[str]] = self._names_in_groups()
        self.names_compared = [list(names) for names in self.names]

    # ------------------------------------------------------------------ reading
    def read(self) -> list[list[str]]:
        """The groups' parameters by name, as the optimizer holds them now.

        Raises ValueError (leaving ``names`` as they were) for a tensor the
        engine did not shard or a parameter listed twice.
        """
        self.show_model_parameters()  # a step or state_dict that raised midway left the pieces in
        self.names = self._names_in_groups()
        return self.names

    def _names_in_groups(self) -> list[list[str]]:
        names: list[list[str]] = []
        seen: set[str] = set()
        twice: list[str] = []
        unknown: list[torch.Tensor] = []
        for group in self.optimizer.param_groups:
            group_names = []
            for tensor in group["params"]:
                name = self._name_of.get(id(tensor))
                if name is None:
                    unknown.append(tensor)
                    continue
                if name in seen:
                    twice.append(name)
                seen.add(name)
                group_names.append(name)
            names.append(group_names)
        if unknown and made_before_split(self._param_of.values(), unknown):
            raise ValueError(OPTIMIZER_BEFORE_SPLIT)
        if unknown:
            raise ValueError(
                f"The optimizer's param groups hold {len(unknown)} tensor(s) the ZeRO engine did not shard: not "
                "parameters of the model, or of a layer added after the engine was built (given to "
                "optimizer.add_param_group?). "
                "Build the optimizer over model.parameters() (or groups of them), "
                "and add layers before building the engine."
            )
        if twice:
            raise ValueError(
                f"Parameters already in a param group were listed again ({', '.join(sorted(set(twice)))}); "
                "each parameter may be in one group only, once."
            )
        return names

    @property
    def fingerprint(self) -> int:
        """A number that differs when ranks' groups differ (compared at each step)."""
        return zlib.crc32(repr(self.names).encode())

    @property
    def settings_fingerprint(self) -> int:
        """Likewise for every group's hyperparameters (a scheduler or an edit on some ranks only)."""
        settings = [
            [(key, describe_value(value)) for key, value in sorted(group.items()) if key != "params"]
            for group in self.optimizer.param_groups
        ]
        return zlib.crc32(repr(settings).encode())

    def listed_parameters(self) -> list[nn.Parameter]:
        """What the groups list now, as model parameters (a step that raised midway left the pieces in)."""
        self.show_model_parameters()
        return [param for group in self.optimizer.param_groups for param in group["params"]]

    def pieces_in_groups(self) -> list[list[nn.Parameter]]:
        """Per group (as last read), this rank's master pieces of its parameters."""
        return [[piece for name in names for piece in self._pieces_of[name]] for names in self.names]

    @property
    def changed_since_compared(self) -> bool:
        return self.names != self.names_compared

    def mark_compared(self) -> None:
        self.names_compared = [list(names) for names in self.names]

    # ---------------------------------------------------------------- switching
    def show_pieces(self) -> None:
        """Each group lists this rank's master pieces of its parameters (call ``read`` first)."""
        if self.holding is GroupsHold.MASTER_PIECES:
            return
        self._shown_pieces = []
        for index, (group, names) in enumerate(zip(self.optimizer.param_groups, self.names)):
            pieces = [piece for name in names for piece in self._pieces_of[name]]
            group["params"] = pieces
            self._shown_pieces.append((index, pieces, names))
        self.holding = GroupsHold.MASTER_PIECES

    @contextlib.contextmanager
    def restricted(self) -> Iterator[Callable[[FlatUnit], None]]:
        """While the groups list master pieces: ``restrict_to(unit)`` makes each group list only that
        unit's pieces (a step of one unit, for the NVMe tier); the full lists come back on exit."""
        assert self.holding is GroupsHold.MASTER_PIECES
        groups = self.optimizer.param_groups

        def restrict_to(unit: FlatUnit) -> None:
            own = {id(master.param) for master in unit.master_pieces}
            for index, pieces, _ in self._shown_pieces:
                groups[index]["params"] = [piece for piece in pieces if id(piece) in own]

        try:
            yield restrict_to
        finally:
            for index, pieces, _ in self._shown_pieces:
                groups[index]["params"] = pieces

    def show_model_parameters(self) -> None:
        """Each group lists the model's parameters again. A group replaced meanwhile (by
        ``load_state_dict``, which makes new group dicts holding the same pieces, or by the
        user) is recognised by its pieces; one holding anything else is left as it is."""
        if self.holding is GroupsHold.MODEL_PARAMETERS:
            return
        groups = self.optimizer.param_groups
        for index, pieces, names in self._shown_pieces:
            if index < len(groups) and _same_tensors(groups[index]["params"], pieces):
                groups[index]["params"] = [self._param_of[name] for name in names]
        self._shown_pieces = []
        self.holding = GroupsHold.MODEL_PARAMETERS

    def install_hooks(self) -> list:
        """``optimizer.state_dict()`` / ``load_state_dict()`` work on the pieces, which key
        ``optimizer.state`` (a dict of this rank's shard only, as before)."""

        def to_pieces(optimizer: torch.optim.Optimizer) -> None:
            self.read()
            self.show_pieces()

        def to_pieces_for_loading(optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
            self.read()
            self._check_fits(state_dict)  # what torch would refuse midway, refused before switching
            self.show_pieces()

        def to_model_parameters(optimizer: torch.optim.Optimizer, state_dict: dict | None = None) -> None:
            self.show_model_parameters()

        return [
            self.optimizer.register_state_dict_pre_hook(to_pieces),
            self.optimizer.register_state_dict_post_hook(to_model_parameters),
            self.optimizer.register_load_state_dict_pre_hook(to_pieces_for_loading),
            self.optimizer.register_load_state_dict_post_hook(to_model_parameters),
        ]

    def _check_fits(self, state_dict: dict) -> None:
        saved = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        pieces = [sum(len(self._pieces_of[name]) for name in names) for names in self.names]
        if not isinstance(saved, list) or [len(group.get("params", ())) for group in saved] != pieces:
            raise ValueError(
                "optimizer.load_state_dict() got a state dict that does not fit this rank's shards (one from another "
                "rank, world size or model?). Under ZeRO, optimizer.state_dict() holds one rank's share only; "
                "checkpoint with the engine's save_checkpoint/load_checkpoint (or the Lightning/Accelerate APIs)."
            )


def _same_tensors(listed: list, expected: list[nn.Parameter]) -> bool:
    return len(listed) == len(expected) and all(a is b for a, b in zip(listed, expected))
