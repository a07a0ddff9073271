"""DeepSpeed's ``optimizer`` and ``scheduler`` sections: checked when the config is read (every type, param
name and value DeepSpeed would build with, or refused with what to do), kept in ``DeepSpeedSettings.optimizer``
/ ``.scheduler`` with their "auto"s, and built by the adapters when the framework asks for its optimizer:
``build_optimizer`` (``optimizers.py``) and ``build_scheduler`` (below), each the torch equal of what
DeepSpeed's engine builds.
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Collection, Mapping
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from .common import AUTO, DeepSpeedSettings, KeyRow, Treatment, apply_row, equals
from .optimizers import (
    ADAM_TYPES,
    FUSED_ADAM_DEFAULTS,
    TORCH_BY_NAME,
    accepted_params,
    build_optimizer,
    remember_built,
    resolve_autos,
)
from .scheduler_params import AUTO_PARAMS, SCHEDULES

MAPPED, RESOLVED, WITHOUT_EFFECT, REFUSED = (
    Treatment.MAPPED,
    Treatment.RESOLVED,
    Treatment.WITHOUT_EFFECT,
    Treatment.REFUSED,
)
# "auto" in the optimizer's params is filled, as Hugging Face fills it, for these (never under Lightning).
OPTIMIZER_AUTO_PARAMS = ("lr", "betas", "eps", "weight_decay")
_AUTO_SOURCES = (
    "TrainingArguments under ZeroTrainer, DummyOptim/DummyScheduler under Accelerate; refused under Lightning"
)
_SECTION_KEYS = {"optimizer": ("type", "params", "legacy_fusion"), "scheduler": ("type", "params")}


def _rows() -> tuple[KeyRow, ...]:
    built = "built as DeepSpeed's engine builds it, over the model's trainable parameters"
    rows = [
        KeyRow("optimizer", MAPPED, built + " (the framework's own optimizer is refused beside it)"),
        KeyRow(
            "optimizer.type",
            MAPPED,
            '"Adam", "AdamW", "Adagrad", "Muon" (any case) and torch\'s elementwise optimizers by name ("SGD", '
            '"RMSprop", ...); "Muon" as DeepSpeed splits it (Muon for the 2-D parameters whose names hold neither '
            '"embed" nor "lm_head", Adam for the rest): zero_core.MuonWithAuxAdamW over torch\'s Muon and AdamW; '
            "Lamb, Lion and the mup optimizers are refused",
        ),
        KeyRow("optimizer.params", MAPPED, "the optimizer's arguments, by name"),
        KeyRow("optimizer.legacy_fusion", WITHOUT_EFFECT, "DeepSpeed reads it only for fp16 without ZeRO"),
        KeyRow("scheduler", MAPPED, "DeepSpeed's schedule as a torch LRScheduler, stepped after each optimizer step"),
        KeyRow(
            "scheduler.type",
            MAPPED,
            ", ".join(SCHEDULES) + "; torch's schedulers by name are refused (DeepSpeed "
            "cannot build them over its ZeRO optimizer either)",
        ),
        KeyRow("scheduler.params", MAPPED, "the schedule's arguments, by name"),
    ]
    for name, users in sorted(_optimizer_param_users().items()):
        row = _OPTIMIZER_PARAM_ROWS.get(name)
        rows.append(row or KeyRow(f"optimizer.params.{name}", MAPPED, _meaning(name, users, "passed on")))
    for name in sorted({n for _, params, _ in SCHEDULES.values() for n in params}):
        users = [kind for kind, (_, params, _) in SCHEDULES.items() if name in params]
        row = _SCHEDULER_PARAM_ROWS.get(name)
        rows.append(row or KeyRow(f"scheduler.params.{name}", MAPPED, _meaning(name, users, "DeepSpeed's formula")))
    return tuple(rows)


def _meaning(name: str, users: list[str], what: str) -> str:
    auto = f' ("auto": the framework\'s: {_AUTO_SOURCES})' if name in (*OPTIMIZER_AUTO_PARAMS, *AUTO_PARAMS) else ""
    return f"{', '.join(users)}: {what}{auto}"


def _optimizer_param_users() -> dict[str, list[str]]:
    """Each optimizer param and the types that take it (Adam's with torch_adam true or not)."""
    users: dict[str, list[str]] = {}
    for label, kind, params in (
        ("Adam/AdamW", "AdamW", {}),
        ("Adam/AdamW with torch_adam", "AdamW", {"torch_adam": True}),
        *((kind, kind, {}) for kind in ("Adagrad", "Muon", *TORCH_BY_NAME)),
    ):
        for name in accepted_params(kind, params):
            users.setdefault(name, []).append(label)
    return users


_OPTIMIZER_PARAM_ROWS = {
    "adam_w_mode": KeyRow(
        "optimizer.params.adam_w_mode",
        MAPPED,
        'Adam: true (the default) is AdamW\'s decoupled weight decay, as in DeepSpeed; "AdamW" is AdamW either way',
    ),
    "torch_adam": KeyRow(
        "optimizer.params.torch_adam",
        MAPPED,
        "Adam/AdamW: torch's class with torch's defaults "
        "(AdamW's weight decay 0.01); without it, FusedAdam's (weight decay 0) in torch's class",
    ),
    "bias_correction": KeyRow(
        "optimizer.params.bias_correction",
        REFUSED,
        "torch's Adam always corrects the bias: drop the key",
        equals(True),
        "accepted when true",
    ),
    "fp32_optimizer_states": KeyRow(
        "optimizer.params.fp32_optimizer_states",
        REFUSED,
        "the optimizer states are fp32 here: drop the key",
        equals(True),
        "accepted when true",
    ),
    "muon_lr": KeyRow("optimizer.params.muon_lr", MAPPED, "Muon: the Muon half's lr, over lr"),
    "adam_lr": KeyRow("optimizer.params.adam_lr", MAPPED, "Muon: the Adam half's lr, over lr"),
    "ns_method": KeyRow(
        "optimizer.params.ns_method",
        WITHOUT_EFFECT,
        'Muon: "gram" or "standard"; torch\'s Muon runs the standard Newton-Schulz iteration in bf16',
    ),
    "set_grad_none": KeyRow(
        "optimizer.params.set_grad_none", WITHOUT_EFFECT, "zero_grad's set_to_none is the framework's call"
    ),
}
_SCHEDULER_PARAM_ROWS = {
    "last_batch_iteration": KeyRow(
        "scheduler.params.last_batch_iteration",
        REFUSED,
        "resume from a checkpoint, which holds the schedule's step",
        equals(-1),
        "accepted when -1",
    ),
}


def read_optimizer_section(key: str, section: Any, result: DeepSpeedSettings, refused: list[str]) -> None:
    """``key`` is "optimizer" or "scheduler": the section checked and kept in ``result``, or refused."""
    if not isinstance(section, Mapping):
        refused.append(f'{key}={section!r} (a JSON object with "type" and "params")')
        return
    before = len(refused)
    for name, value in section.items():
        if name not in _SECTION_KEYS[key]:
            nearest = difflib.get_close_matches(name, _SECTION_KEYS[key], n=1, cutoff=0.5)
            hint = f"did you mean {nearest[0]!r}?" if nearest else f"its keys are {', '.join(_SECTION_KEYS[key])}"
            refused.append(f"{key}.{name}={value!r} (not a key DeepSpeed reads; {hint})")
        elif name == "legacy_fusion":
            apply_row(ROW_BY_KEY["optimizer.legacy_fusion"], f"{key}.{name}", value, result, refused)
    kind, params = section.get("type"), section.get("params") or {}
    if not isinstance(kind, str):
        refused.append(
            f"{key}.type={kind!r} (the {key}'s name; without one DeepSpeed builds no {key} and ignores "
            "the section: name it, or drop the section)"
        )
    elif not isinstance(params, Mapping):
        refused.append(f"{key}.params={params!r} (a JSON object of the {key}'s arguments)")
    elif key == "optimizer":
        _check_optimizer(kind, params, result, refused)
    else:
        _check_scheduler(kind, params, result, refused)
    if len(refused) == before:
        setattr(result, key, copy.deepcopy(dict(section)))


def _check_optimizer(kind: str, params: Mapping[str, Any], result: DeepSpeedSettings, refused: list[str]) -> None:
    try:
        names = accepted_params(kind, params)
    except ValueError as error:
        refused.append(f"optimizer.type={kind!r} ({error})")
        return
    before = len(refused)
    for name, value in params.items():
        dotted = f"optimizer.params.{name}"
        refusal = _argument_refusal(dotted, name, repr(kind), value, names, OPTIMIZER_AUTO_PARAMS)
        if refusal:
            refused.append(refusal)
        elif name in _OPTIMIZER_PARAM_ROWS and _OPTIMIZER_PARAM_ROWS[name].treatment is not MAPPED:
            apply_row(_OPTIMIZER_PARAM_ROWS[name], dotted, value, result, refused)
        elif name in ("adam_w_mode", "torch_adam") and not isinstance(value, bool):
            refused.append(f"{dotted}={value!r} (true or false)")
    if (
        kind.lower() in ADAM_TYPES
        and params.get("torch_adam") is not True
        and params.get("amsgrad", False) is not False
    ):
        refused.append(
            f"optimizer.params.amsgrad={params['amsgrad']!r} (DeepSpeed's FusedAdam has no AMSGrad and "
            'fails: add "torch_adam": true to train torch\'s AMSGrad, or drop it)'
        )
    if len(refused) == before:
        _try_building(kind, params, refused)


def _argument_refusal(
    dotted: str, name: str, kind_text: str, value: Any, accepted: Collection[str], auto_filled: Collection[str]
) -> str | None:
    """Why a section's argument ``dotted`` (``optimizer.params.<name>``) is refused before its value is
    looked at, the optimizer's and the schedule's alike: a name the class does not take, or an "auto"
    nothing fills; None when neither."""
    if name not in accepted:
        return (
            f"{dotted}={value!r} (not an argument of {kind_text}: DeepSpeed would fail to build it; "
            f"its arguments are {', '.join(accepted)})"
        )
    if value == AUTO and name not in auto_filled:
        return f'{dotted}="auto" (nothing fills it: "auto" is filled for {", ".join(auto_filled)})'
    return None


def _try_building(kind: str, params: Mapping[str, Any], refused: list[str]) -> None:
    """Built once over a stand-in tensor, so that a value torch refuses (betas above 1, a negative rate) is
    refused now, in torch's words, instead of when training starts."""
    stand_ins = {**FUSED_ADAM_DEFAULTS, "betas": [0.9, 0.999]}
    section = {"type": kind, "params": {n: (stand_ins[n] if v == AUTO else v) for n, v in params.items()}}
    try:
        build_optimizer(section, [torch.zeros(1, requires_grad=True)])
    except (ValueError, TypeError) as error:
        refused.append(f"optimizer.params={dict(params)!r} (torch refuses them: {error})")


def _check_scheduler(kind: str, params: Mapping[str, Any], result: DeepSpeedSettings, refused: list[str]) -> None:
    if kind not in SCHEDULES:
        refused.append(f"scheduler.type={kind!r} ({_scheduler_hint(kind)})")
        return
    _, accepted, required = SCHEDULES[kind]
    for name, value in params.items():
        dotted = f"scheduler.params.{name}"
        refusal = _argument_refusal(dotted, name, kind, value, accepted, AUTO_PARAMS)
        if refusal:
            refused.append(refusal)
        elif value != AUTO and not accepted[name].accepts(value):
            refused.append(f"{dotted}={value!r} ({accepted[name].expected})")
    refused.extend(
        f"scheduler.params.{name} is missing ({kind} requires it)" for name in required if name not in params
    )


def _scheduler_hint(kind: str) -> str:
    if hasattr(torch.optim.lr_scheduler, kind):
        return (
            "DeepSpeed builds torch's schedulers over its ZeRO optimizer, which torch refuses: build it in the "
            f"script, or use one of DeepSpeed's: {', '.join(SCHEDULES)}"
        )
    nearest = difflib.get_close_matches(kind, list(SCHEDULES), n=1, cutoff=0.5)
    return (f"did you mean {nearest[0]!r}? " if nearest else "") + f"DeepSpeed's schedules are {', '.join(SCHEDULES)}"


def build_scheduler(
    section: Mapping[str, Any],
    optimizer: torch.optim.Optimizer,
    auto: Mapping[str, Any] | None = None,
    filled_by: str = "this framework",
) -> LRScheduler:
    """The schedule the config's ``scheduler`` section (as ``from_deepspeed`` checked it) names, over
    ``optimizer``: step it once after each optimizer step, as DeepSpeed's engine does.

    ``auto`` maps a param's name ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps")
    to the framework's value, for the params the config sets to "auto"; ``filled_by`` names where those values
    come from, for the error about an "auto" it has no value for."""
    params = resolve_autos("scheduler", section.get("params") or {}, auto or {}, filled_by)
    params.pop("last_batch_iteration", None)  # -1, the only value read_optimizer_section lets through
    return remember_built(SCHEDULES[section["type"]][0](optimizer, **params))


def auto_keys(section: Mapping[str, Any] | None, key: str) -> list[str]:
    """The dotted keys of a section (``key``: "optimizer" or "scheduler") set to "auto"."""
    params = (section or {}).get("params") or {}
    return [f"{key}.params.{name}" for name, value in params.items() if value == AUTO]


ROWS = _rows()
ROW_BY_KEY = {row.key: row for row in ROWS}
