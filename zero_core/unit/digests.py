"""``torch.equal`` between two stage-3 parameters at rest, answered exactly.

No rank holds a resting parameter's values, so comparing two of them needs
communication, which a tensor operation may only start where every rank runs
the same code. ``engine.comparable_parameters()`` marks such a stretch (every
rank enters it together; Lightning's strategy wraps ``BaseFinetuning``'s
epoch hook in it, whose ``filter_on_optimizer`` compares parameters this
way). Inside, the first comparison that metadata cannot settle gathers the
model once, unit by unit as ``full_state_dict`` does, and keeps one SHA-256 per
parameter; comparisons are then answered from those until the values change
(every rank changes them alike, so every rank gathers again alike). Outside,
such a comparison is refused (``guard.py``).

Exact: ``torch.equal`` compares values, and equal bytes are equal values
except for two cases handled here: ``-0.0 == 0.0`` (normalised by adding
``0.0``) and NaN, which equals nothing (recorded as no digest).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch
from torch import nn


class DigestedUnit(Protocol):
    """What digests need of a unit: its parameters and their full master values."""

    params: list[nn.Parameter]

    @property
    def resting_master(self) -> torch.Tensor: ...

    def gather_full_master(self) -> torch.Tensor: ...

    def full_param_views(self, full: torch.Tensor) -> list[torch.Tensor]: ...


class ParameterDigests:
    """Made before the units (each unit's guard asks it), told the units once they exist (``track``)."""

    def __init__(self) -> None:
        self.units: Sequence[DigestedUnit] = ()
        self._ids: set[int] = set()
        self.active = False
        self._digests: dict[int, bytes | None] | None = None  # id(param) -> digest; None: holds NaN
        self._computed_at: list[int] = []  # each master shard's version counter when they were computed

    def track(self, units: Sequence[DigestedUnit]) -> None:
        self.units = units
        self._ids = {id(p) for unit in units for p in unit.params}

    @contextlib.contextmanager
    def comparable(self) -> Iterator[None]:
        if self.active:  # nested: the outer stretch owns the digests
            yield
            return
        self.active = True
        try:
            yield
        finally:
            self.active = False
            self._digests = None  # parameters change after the stretch: never reuse digests

    def knows(self, tensor: object) -> bool:
        return isinstance(tensor, torch.nn.Parameter) and id(tensor) in self._ids

    def equal(self, a: torch.nn.Parameter, b: torch.nn.Parameter) -> bool:
        # Any write to the values (a step, a load, gathered_parameters' write-back) bumps a master
        # shard's version counter, which its views share: digests from before it are stale.
        # (Of the master as it rests: a version needs no values, and its file may hold them.)
        versions = [unit.storage.resting_master._version for unit in self.units]
        if self._digests is None or versions != self._computed_at:
            self._digests, self._computed_at = self._compute(), versions
        digest_a, digest_b = self._digests[id(a)], self._digests[id(b)]
        return digest_a is not None and digest_a == digest_b

    def _compute(self) -> dict[int, bytes | None]:
        digests: dict[int, bytes | None] = {}
        for unit in self.units:
            full = unit.storage.gather_full_master()
            for param, view in zip(unit.params, unit.full_param_views(full)):
                value = (view.to(param.dtype) + 0.0).reshape(-1).cpu()
                if torch.isnan(value).any():
                    digests[id(param)] = None
                    continue
                digest = hashlib.sha256(f"{param.dtype} {tuple(param.shape)}".encode())
                digest.update(value.view(torch.uint8).numpy())
                digests[id(param)] = digest.digest()
            del full
        return digests
