"""DeepSpeed's ``optimizer`` section as the torch optimizer DeepSpeed 0.19's engine builds from it
(``DeepSpeedEngine._configure_basic_optimizer``), or refused where torch has no equal.

What DeepSpeed does with each type:

- "Adam" / "AdamW" (any case): ``adam_w_mode`` (default true) makes "Adam" AdamW too: decoupled weight decay
  unless the type is "Adam" and ``adam_w_mode`` is false. With ``torch_adam`` true DeepSpeed builds
  ``torch.optim.AdamW``/``Adam`` with torch's defaults (AdamW's weight decay 0.01); otherwise its FusedAdam (or
  DeepSpeedCPUAdam when offloading), whose defaults are lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0
  and whose update is the same formula (the two agree to float rounding): here torch's Adam or AdamW with
  FusedAdam's defaults.
- "Adagrad" (any case): ``torch.optim.Adagrad``.
- any other name of a torch optimizer, spelt as torch spells it ("SGD", "RMSprop"): that class, with the
  params as its arguments (DeepSpeed asks for ``zero_allow_untested_optimizer`` with them; any elementwise
  optimizer trains exactly under our ZeRO).
- "Muon" (any case): DeepSpeed's split (``deepspeed.set_optimizer_flags``): Muon for each trainable parameter
  of 2 or more dimensions whose name holds neither "embed" nor "lm_head", Adam with decoupled weight decay for
  the rest, with DeepSpeed's defaults (Muon: lr 0.02, momentum 0.95; Adam: lr 3e-4, betas (0.9, 0.95), eps
  1e-10; weight decay 0), ``muon_lr``/``adam_lr`` over ``lr``: ``zero_core.MuonWithAuxAdamW`` over torch's
  Muon and AdamW. torch's Muon takes 2-D matrices: a marked tensor of more dimensions (a conv filter, which
  DeepSpeed reshapes) is refused. ``ns_method`` is accepted; torch's Muon runs the standard iteration in bf16.
- "Lamb", "Lion" and the mup optimizers have no torch equal: refused with the nearest torch optimizer.
"""

from __future__ import annotations

import difflib
import inspect
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..muon_with_adamw import MuonWithAuxAdamW
from .common import AUTO

# DeepSpeed's own types (matched in any case), as its config lower-cases them.
ADAM_TYPES = ("adam", "adamw")
# Refused: no torch optimizer trains as these do. Type (lower case) -> what to do.
_NO_TORCH_EQUAL = {
    "lamb": 'LAMB scales each tensor\'s step by its trust ratio, which torch has no optimizer for: use "AdamW" '
    "(the nearest), or train LAMB with DeepSpeed",
    "lion": 'torch has no Lion optimizer: use "AdamW" (the nearest), or train Lion with DeepSpeed',
    "muadam": 'the mup optimizers scale each tensor by its width (mup\'s MuAdam): use "Adam", or train mup with '
    "DeepSpeed",
    "muadamw": 'the mup optimizers scale each tensor by its width (mup\'s MuAdamW): use "AdamW", or train mup '
    "with DeepSpeed",
    "musgd": 'the mup optimizers scale each tensor by its width (mup\'s MuSGD): use "SGD", or train mup with DeepSpeed',
    "onebitadam": "DeepSpeed 0.19 has no 1-bit Adam any more, and its compressed communication changes the steps: "
    'use "Adam"',
    "zerooneadam": "DeepSpeed 0.19 has no 0/1 Adam any more, and its compressed communication changes the steps: "
    'use "Adam"',
    "onebitlamb": 'DeepSpeed 0.19 has no 1-bit LAMB any more: use "AdamW"',
}
# DeepSpeed's Muon: the params each half takes (engine.py, _configure_basic_optimizer), and its defaults.
MUON_TYPE = "muon"
_MUON_KEYS = ("lr", "momentum", "weight_decay", "muon_lr", "ns_method")
_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay", "adam_lr")
_MUON_DEFAULTS = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0}
_ADAM_DEFAULTS = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}
_NS_METHODS = ("gram", "standard")
# torch optimizers taken by name, as DeepSpeed takes them: elementwise ones step their flat shards, Adafactor
# steps each tensor whole at an owner rank (optim/whole_tensor_step.py).
TORCH_BY_NAME = ("SGD", "RMSprop", "Adamax", "NAdam", "RAdam", "Adadelta", "ASGD", "Rprop", "Adafactor")
_WHOLE_TENSOR = {
    "LBFGS": "LBFGS needs a closure and whole tensors",
    "SparseAdam": "SparseAdam needs sparse gradients",
}

# FusedAdam's (and DeepSpeedCPUAdam's) arguments and defaults, which DeepSpeed builds unless torch_adam.
FUSED_ADAM_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
# Keys DeepSpeed pops before it builds the optimizer, and FusedAdam's own that torch's Adam has no equal of.
ADAM_SWITCHES = ("adam_w_mode", "torch_adam", "fp32_optimizer_states")
_FUSED_ONLY = ("bias_correction", "set_grad_none", "amsgrad")


def optimizer_class(kind: str, params: Mapping[str, Any]) -> type[torch.optim.Optimizer]:
    """The torch class DeepSpeed's ``type`` (and, for Adam, ``adam_w_mode``) stands for; ValueError if none."""
    lowered = kind.lower()
    if lowered in ADAM_TYPES:
        decoupled = lowered == "adamw" or params.get("adam_w_mode", True) is not False
        return torch.optim.AdamW if decoupled else torch.optim.Adam
    if lowered == "adagrad":
        return torch.optim.Adagrad
    if lowered == MUON_TYPE:
        return MuonWithAuxAdamW
    if lowered in _NO_TORCH_EQUAL:
        raise ValueError(_NO_TORCH_EQUAL[lowered])
    if kind in _WHOLE_TENSOR:
        raise ValueError(f'{_WHOLE_TENSOR[kind]}, which ZeRO\'s flat shards cannot give: use "AdamW" or "SGD"')
    if kind in TORCH_BY_NAME:
        return getattr(torch.optim, kind)
    known = ["Adam", "AdamW", "Adagrad", *TORCH_BY_NAME]
    nearest = difflib.get_close_matches(kind.lower(), [name.lower() for name in known], n=1, cutoff=0.5)
    hint = "".join(f"did you mean {name!r}? " for name in known if nearest and name.lower() == nearest[0])
    raise ValueError(
        f"not an optimizer DeepSpeed builds ({hint}DeepSpeed takes its own types in any case and torch's by "
        f"their exact name; here: {', '.join(known)})"
    )


def accepted_params(kind: str, params: Mapping[str, Any]) -> tuple[str, ...]:
    """The params DeepSpeed passes on without an error for this type."""
    cls = optimizer_class(kind, params)
    if cls is MuonWithAuxAdamW:
        return tuple(dict.fromkeys(_MUON_KEYS + _ADAM_KEYS))
    if kind.lower() in ADAM_TYPES and params.get("torch_adam", False) is not True:
        return (*FUSED_ADAM_DEFAULTS, *ADAM_SWITCHES, *_FUSED_ONLY)
    own = [name for name in inspect.signature(cls.__init__).parameters if name not in ("self", "params")]
    return (*own, *(ADAM_SWITCHES if kind.lower() in ADAM_TYPES else ()))


def torch_arguments(kind: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of ``optimizer_class(kind, params)`` that train as DeepSpeed's optimizer does
    (``params`` with their "auto"s resolved)."""
    arguments = dict(params)
    if kind.lower() not in ADAM_TYPES:
        return arguments
    for switch in ADAM_SWITCHES:
        arguments.pop(switch, None)
    if params.get("torch_adam", False) is True:
        return arguments  # torch's own class and defaults, as DeepSpeed builds it
    # FusedAdam's defaults (weight decay 0, where torch's AdamW has 0.01); its other switches, held to the
    # values that train as torch's Adam does (read_optimizer_section refuses the others), say nothing more.
    for name in _FUSED_ONLY:
        arguments.pop(name, None)
    return {**FUSED_ADAM_DEFAULTS, **arguments}


# What build_optimizer and build_scheduler made: an adapter that finds one handed back to it knows the config's
# section made it (ZeroTrainer builds them itself and prepares them as the script's own).
_BUILT: weakref.WeakSet = weakref.WeakSet()


def built_from_config(obj: object) -> bool:
    """Whether ``obj`` (an optimizer or scheduler) was built from a DeepSpeed config's section."""
    return obj in _BUILT


def remember_built(obj: Any) -> Any:
    _BUILT.add(obj)
    return obj


def resolve_autos(section_key: str, params: Mapping[str, Any], auto: Mapping[str, Any], filled_by: str) -> dict:
    """``params`` with each "auto" replaced by the framework's value (``auto``), or a ValueError naming the
    key and what fills "auto" here."""
    missing = [name for name, value in params.items() if value == AUTO and name not in auto]
    if missing:
        keys = ", ".join(f"{section_key}.params.{name}" for name in missing)
        fills = ", ".join(sorted(auto)) or "nothing"
        raise ValueError(
            f'{keys} is "auto", and {filled_by} has no value for it ("auto" is filled here for: {fills}): write '
            "the value in the DeepSpeed config."
        )
    return {name: (auto[name] if value == AUTO else value) for name, value in params.items()}


def build_optimizer(
    section: Mapping[str, Any],
    parameters: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
    auto: Mapping[str, Any] | None = None,
    filled_by: str = "this framework",
    model: torch.nn.Module | None = None,
) -> torch.optim.Optimizer:
    """The torch optimizer DeepSpeed builds from the config's ``optimizer`` section (as ``from_deepspeed``
    checked it) over ``parameters`` (tensors or param groups, as DeepSpeed takes ``model_parameters``).

    ``auto`` maps a param's name ("lr", "betas", "eps", "weight_decay") to the framework's value, for the params
    the config sets to "auto"; ``filled_by`` names where those values come from, for the error about an "auto"
    it has no value for. ``model``: whose parameter names say which tensors a "Muon" section gives Muon."""
    kind = section["type"]
    params = resolve_autos("optimizer", section.get("params") or {}, auto or {}, filled_by)
    if kind.lower() == MUON_TYPE:
        return remember_built(_muon_with_adam(params, parameters, model))
    arguments = torch_arguments(kind, params)
    if isinstance(arguments.get("betas"), list):
        arguments["betas"] = tuple(arguments["betas"])  # JSON has no tuples; torch's optimizers keep one
    return remember_built(optimizer_class(kind, params)(parameters, **arguments))


def _muon_with_adam(
    params: Mapping[str, Any],
    parameters: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
    model: torch.nn.Module | None,
) -> MuonWithAuxAdamW:
    """DeepSpeed's Muon section as its engine splits it (see the module's text), over torch's Muon and AdamW."""
    if params.get("ns_method", "gram") not in _NS_METHODS:
        raise ValueError(f"optimizer.params.ns_method={params['ns_method']!r} (one of {', '.join(_NS_METHODS)})")
    tensors = [p for item in parameters for p in (item["params"] if isinstance(item, dict) else [item])]
    names = {id(p): name for name, p in model.named_parameters()} if model is not None else {}
    marked = [p for p in tensors if p.ndim >= 2 and not any(k in names.get(id(p), "").lower() for k in _UNMARKED)]
    if model is None and marked:
        raise ValueError(
            'a "Muon" section marks the matrices by their names ("embed" and "lm_head" are Adam\'s): '
            "this entry point did not give the model"
        )
    wide = [names.get(id(p), str(tuple(p.shape))) for p in marked if p.ndim > 2]
    if wide:
        raise ValueError(
            f"DeepSpeed's Muon reshapes {', '.join(wide)} (more than 2 dimensions) to matrices; torch's Muon takes "
            'matrices only: use "AdamW", or build zero_core.MuonWithAuxAdamW with those in an AdamW group'
        )
    chosen = {id(p) for p in marked}
    groups = []
    for use_muon, keys, defaults, own_lr in (
        (True, _MUON_KEYS, _MUON_DEFAULTS, "muon_lr"),
        (False, _ADAM_KEYS, _ADAM_DEFAULTS, "adam_lr"),
    ):
        group_params = [p for p in tensors if p.requires_grad and (id(p) in chosen) is use_muon]
        if not group_params:
            continue
        settings = {**defaults, **{k: params[k] for k in keys if k in params and k not in ("ns_method", own_lr)}}
        if own_lr in params:
            settings["lr"] = params[own_lr]  # DeepSpeed: muon_lr / adam_lr over lr
        if isinstance(settings.get("betas"), list):
            settings["betas"] = tuple(settings["betas"])
        groups.append({"params": group_params, "use_muon": use_muon, **settings})
    return MuonWithAuxAdamW(groups)


_UNMARKED = ("embed", "lm_head")  # DeepSpeed leaves these to Adam whatever their shape
