"""Every rank agrees on the model, the config and the optimizer before sharding.

Why: ranks that built different things fail badly and far from the cause.
Transposed shapes of equal size train silently on wrong values, a different
``compute_dtype`` aborts inside the backend, a different ``prefetch`` or
``broadcast_buffers`` hangs, a different learning rate or param group trains
silently and fails later on one rank only.

Plan: each rank describes its setup as an ordered list of (field, value)
pairs, values as rank-independent strings (no devices, no addresses). The
ranks all-gather a fixed-size digest of that list (one small collective);
only when the digests differ do they gather the full lists, find the first
differing field and raise the same ``ValueError`` everywhere, naming the
field and each rank's value. Counts come before the entries they count, so
the first difference names the cause, not its consequences.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from .. import collectives
from ..collectives import CommContext
from ..config import ZeroConfig
from ..unit import UnitPlan

ADVICE = "Every rank must build the same model, config and optimizer before sharding."

_DIGEST_WORDS = 4  # sha256 as four int64


class Field(NamedTuple):
    """One described fact, e.g. ``("parameter 3 'up.weight' shape", "(16, 48)")``."""

    name: str
    value: str


def describe_value(value: Any) -> str:
    """A string equal on every rank exactly when the values mean the same.

    Classes and functions by qualified name (their repr holds an address),
    tensors by value and dtype (their repr holds the rank's device), and
    integral floats as integers, so ``weight_decay=0`` agrees with ``0.0``.
    """
    if isinstance(value, type) or (callable(value) and hasattr(value, "__qualname__")):
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    if isinstance(value, torch.Tensor):
        return f"tensor({describe_value(value.tolist())}, dtype={value.dtype})"
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return repr(int(value))
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(describe_value(v) for v in value) + ")"
    if isinstance(value, (set, frozenset)):  # iteration order depends on each process's hash seed
        return "{" + ", ".join(sorted(describe_value(v) for v in value)) + "}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{describe_value(k)}: {describe_value(v)}" for k, v in value.items()) + "}"
    text = repr(value)
    if " at 0x" in text:  # a default repr (or a partial's) holds the object's address, different per rank
        return f"<{type(value).__module__}.{type(value).__qualname__}>"
    return text


def describe_config(config: Any, prefix: str = "config") -> list[Field]:
    """Every field of a (nested) config dataclass, e.g. ``config.mixed_precision.compute_dtype``."""
    fields = []
    for spec in dataclasses.fields(config):
        value = getattr(config, spec.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            fields += describe_config(value, f"{prefix}.{spec.name}")
        elif spec.name == "module_classes":  # order does not matter, and a set given by the user has none
            fields.append(Field(f"{prefix}.{spec.name}", repr(sorted(describe_value(c) for c in value))))
        else:
            fields.append(Field(f"{prefix}.{spec.name}", describe_value(value)))
    return fields


def _describe_tensors(kind: str, named: list[tuple[str, torch.Tensor]], requires_grad: bool) -> list[Field]:
    fields = [Field(f"{kind} count", str(len(named)))]
    for index, (name, tensor) in enumerate(named):
        # The name first: the later fields' labels carry it, so they read alike on every rank.
        fields.append(Field(f"{kind} {index} name", repr(name)))
        fields.append(Field(f"{kind} {index} {name!r} shape", repr(tuple(tensor.shape))))
        fields.append(Field(f"{kind} {index} {name!r} dtype", str(tensor.dtype)))
        if requires_grad:
            fields.append(Field(f"{kind} {index} {name!r} requires_grad", repr(tensor.requires_grad)))
    return fields


def describe_units(plans: list[UnitPlan]) -> list[Field]:
    """Which module each unit is and which parameters (under every name) it flattens."""
    fields = [Field("unit count", str(len(plans)))]
    for plan in plans:
        fields.append(Field(f"unit {plan.index} module", repr(plan.name)))
        fields.append(Field(f"unit {plan.index} parameter count", str(len(plan.param_fqns))))
        fields += [Field(f"unit {plan.index} parameter {i}", repr(fqns)) for i, fqns in enumerate(plan.param_fqns)]
    return fields


def describe_optimizer(
    optimizer: torch.optim.Optimizer | None, names: Mapping[int, str], group_names: list[list[str]] | None = None
) -> list[Field]:
    """Type, defaults, groups, each group's parameters by name and every hyperparameter.

    ``names``: id(parameter) -> its canonical name in the model. Once the
    optimizer is rebuilt over shards its groups hold pieces that differ per
    rank: ``group_names`` (the engine's names per group) describes them instead.
    """
    if optimizer is None:
        return [Field("optimizer type", "None")]
    fields = [
        Field("optimizer type", describe_value(type(optimizer))),
        Field("optimizer param group count", str(len(optimizer.param_groups))),
    ]
    for g, group in enumerate(optimizer.param_groups):
        if group_names is not None:
            described = [repr(name) for name in group_names[g]]
        else:
            described = [
                repr(names[id(p)]) if id(p) in names else f"<a tensor not in the model, shape {tuple(p.shape)}>"
                for p in group["params"]
            ]
        fields.append(Field(f"optimizer param group {g} parameter count", str(len(described))))
        for i, value in enumerate(described):
            fields.append(Field(f"optimizer param group {g} parameter {i}", value))
        keys = sorted(key for key in group if key != "params")
        fields.append(Field(f"optimizer param group {g} hyperparameters", repr(keys)))
        fields += [Field(f"optimizer param group {g} {key}", describe_value(group[key])) for key in keys]
    # Last: a default differs alone only where no group uses it yet (a group added later takes it).
    fields += [
        Field(f"optimizer default {key}", describe_value(optimizer.defaults[key])) for key in sorted(optimizer.defaults)
    ]
    return fields


def describe_setup(
    model: nn.Module, plans: list[UnitPlan], config: ZeroConfig, optimizer: torch.optim.Optimizer | None
) -> list[Field]:
    """The config first (a different wrap policy explains different units), then
    parameters, buffers, the unit plan and the optimizer."""
    names = {id(p): fqns[0] for plan in plans for p, fqns in zip(plan.params, plan.param_fqns)}
    return (
        describe_config(config)
        + _describe_tensors("parameter", list(model.named_parameters()), requires_grad=True)
        + _describe_tensors("buffer", list(model.named_buffers()), requires_grad=False)
        + describe_units(plans)
        + describe_optimizer(optimizer, names)
    )


def _digest(fields: list[Field]) -> list[int]:
    # Separators no name or value contains keep ("ab", "c") apart from ("a", "bc").
    text = "".join(f"{name}\x00{value}\x01" for name, value in fields)
    raw = hashlib.sha256(text.encode()).digest()
    return [int.from_bytes(raw[8 * i : 8 * i + 8], "little", signed=True) for i in range(_DIGEST_WORDS)]


def first_difference(described: list[list[Field]]) -> str:
    """The message for the first field where ranks differ (the same on every rank)."""
    length = max(len(fields) for fields in described)
    for index in range(length):
        entries = [fields[index] if index < len(fields) else None for fields in described]
        if len(set(entries)) == 1:
            continue
        names = {entry.name for entry in entries if entry is not None}
        if len(names) == 1:
            what = names.pop()
            values = [entry.value if entry is not None else "(nothing)" for entry in entries]
        else:  # unreachable while counts precede what they count; kept for safety
            what = f"setup entry {index}"
            values = [f"{e.name} = {e.value}" if e is not None else "(nothing)" for e in entries]
        ranks_of: dict[str, list[int]] = {}
        for rank, value in enumerate(values):
            ranks_of.setdefault(value, []).append(rank)
        where = "; ".join(
            f"{value} on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
            for value, ranks in ranks_of.items()
        )
        return f"ZeRO: ranks disagree on {what}: {where}. {ADVICE}"
    return f"ZeRO: ranks disagree on their setup (equal descriptions, different digests). {ADVICE}"


def agree_on_setup(comm: CommContext, fields: list[Field]) -> None:
    """Raise the same ValueError on every rank unless every rank described the same setup."""
    local = torch.tensor(_digest(fields), dtype=torch.int64, device=comm.device)
    gathered = torch.empty(comm.world_size * _DIGEST_WORDS, dtype=torch.int64, device=comm.device)
    collectives.all_gather(comm, gathered, local, label="setup digest", span=collectives.Span.WORLD).wait()
    if bool((gathered.view(comm.world_size, _DIGEST_WORDS) == local).all()):
        return
    described = collectives.all_gather_objects(comm, fields, label="setup description")
    raise ValueError(first_difference(described))
