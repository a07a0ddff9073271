"""The records of the settings schema, and the text parsers its fields name (sizes among them).

A user-facing field of ``ZeroConfig`` is declared with :func:`setting`, which
puts a :class:`_Declared` into the field's metadata; ``zero_core.config.user_settings()``
completes it with the field's name, type and default into a :class:`Setting`.
Every adapter (the Lightning and Fabric strategies' keyword arguments,
Accelerate's ``ZeroPlugin`` fields, its YAML keys, ``ACCELERATE_ZERO_*``
variables and ``accelerate-zero launch`` flags) is generated from those
records, so a new setting is one field declared here and nowhere else.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

SETTING_KEY = "zero_setting"  # the key of a field's metadata that holds its declaration


def is_count(value: object, minimum: int) -> bool:
    """An integer (not a bool, which Python counts as one) of at least ``minimum``: what a count setting, a
    DeepSpeed count key and a manifest's sizes are checked with."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def check_flags(config: Any, names: Sequence[str]) -> None:
    """Each named field of ``config`` (a ``ZeroConfig``) is True or False, not 1, "yes" or None: the one
    check of the boolean settings, in the order given."""
    for name in names:
        if not isinstance(getattr(config, name), bool):
            raise ValueError(f"ZeroConfig.{name} must be True or False.")


def parse_bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{value!r} is not a boolean; use true or false.")


def parse_prefetch(value: str) -> int | str:
    """A depth, or "auto" (chosen from measured times)."""
    return "auto" if value.strip().lower() == "auto" else int(value)


def parse_optional_int(value: str) -> int | None:
    return None if value.strip().lower() in ("", "none") else int(value)


def parse_class_names(value: str | Sequence[str]) -> tuple[str, ...]:
    """Class names as a comma-separated string (a flag, a variable) or a list (YAML, Python)."""
    names = value.split(",") if isinstance(value, str) else value
    return tuple(str(name).strip() for name in names if str(name).strip())


def join_names(names: Sequence[str]) -> str:
    return ",".join(names)


BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
BYTE_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def parse_quantity(text: str, units: dict[str, int], example: str) -> int:
    """A positive number with an optional unit of ``units`` (case aside), rounded; ``ValueError`` otherwise."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
    if match is None or match.group(2) not in units:
        raise ValueError(f"{text!r} is not a size: use a number with an optional unit, e.g. {example}")
    number = float(match.group(1)) * units[match.group(2)]
    if not math.isfinite(number):
        raise ValueError(f"{text!r} is not a finite size: use e.g. {example}")
    value = round(number)
    if value < 1:
        raise ValueError(f"{text!r} is not positive: use e.g. {example}")
    return value


def parse_bytes(text: str) -> int:
    """``80GiB``, ``80GB``, ``8.5e10`` (bytes): B, KB, MB, GB, TB (powers of 1000), KiB, MiB, GiB, TiB (of 1024)."""
    return parse_quantity(text, BYTE_UNITS, "80GiB, 40GB or 8e10")


def _same(value: Any) -> Any:
    return value


def _same_for_any_model(value: Any, model: Any) -> Any:
    return value


class KeywordForm(NamedTuple):
    """A setting as Lightning and Fabric take it: a keyword argument of their strategies."""

    annotation: Any  # what ``inspect.signature`` shows, and LightningCLI/jsonargparse parses by
    default: Any
    to_config: Callable[[Any], Any]  # the argument -> ZeroConfig's value


class TextForm(NamedTuple):
    """A setting as Accelerate writes it: a ``ZeroPlugin`` field, a YAML key, the variable
    ``ACCELERATE_ZERO_<NAME>`` and a launcher flag."""

    name: str
    annotation: Any
    default: Any
    parse: Callable[[str], Any]  # a flag's or variable's text -> the value
    format: Callable[[Any], str]  # the value -> a variable's text; parse(format(v)) == v
    normalize: Callable[[Any], Any]  # an explicit (Python or YAML) value -> the value
    resolve: Callable[[Any, Any], Any]  # (the value, the model or None) -> ZeroConfig's value
    flag: str
    example: Any  # a valid value other than the default, in this spelling


@dataclasses.dataclass(frozen=True)
class Setting:
    """One user-facing field of ``ZeroConfig``, as every adapter spells it."""

    name: str  # the ZeroConfig field, and the strategies' keyword
    doc: str  # one line: --help, generated docstrings
    values: str  # the valid values, as the configuration reference prints them
    default: Any  # ZeroConfig's default
    keyword: KeywordForm
    text: TextForm


class TextSpelling(NamedTuple):
    """Where Accelerate's text differs from the field: a setting whose text names what the
    field holds (``wrap_classes``: class names, looked up in the model when it is sharded)."""

    name: str
    annotation: Any
    default: Any
    normalize: Callable[[Any], Any]
    resolve: Callable[[Any, Any], Any]


@dataclasses.dataclass(frozen=True)
class _Declared:
    """What a field declares; what it leaves out is the field's own (name, type, default)."""

    doc: str
    values: str
    parse: Callable[[str], Any]
    example: Any
    format: Callable[[Any], str]
    flag: str | None
    keyword: KeywordForm | None
    text: TextSpelling | None


def setting(
    default: Any = dataclasses.MISSING,
    *,
    doc: str,
    values: str,
    parse: Callable[[str], Any],
    example: Any,
    default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
    format: Callable[[Any], str] = str,
    flag: str | None = None,
    keyword: KeywordForm | None = None,
    text: TextSpelling | None = None,
) -> Any:
    """A ``ZeroConfig`` field that users set through every adapter.

    doc: one line. values: the valid values, in words (``"1, 2 or 3"``), for the configuration
    reference. parse: the text form's value from its text; format: back. example: a valid
    non-default value of the text form (the schema test sets every setting to it).
    flag: the launcher flag, where ``--zero_<text name>`` cannot be used. keyword/text:
    how the strategies' keyword and Accelerate's text spell it, where not as the field.
    """
    declared = _Declared(doc, values, parse, example, format, flag, keyword, text)
    return dataclasses.field(default=default, default_factory=default_factory, metadata={SETTING_KEY: declared})


def complete(field: dataclasses.Field, annotation: Any, default: Any) -> Setting:
    """The record of a declared field, its forms filled in from the field where it left them out."""
    declared: _Declared = field.metadata[SETTING_KEY]
    keyword = declared.keyword or KeywordForm(annotation, default, _same)
    spelling = declared.text or TextSpelling(field.name, annotation, default, _same, _same_for_any_model)
    text = TextForm(
        name=spelling.name,
        annotation=spelling.annotation,
        default=spelling.default,
        parse=declared.parse,
        format=declared.format,
        normalize=spelling.normalize,
        resolve=spelling.resolve,
        flag=declared.flag or f"--zero_{spelling.name}",
        example=declared.example,
    )
    return Setting(field.name, declared.doc, declared.values, default, keyword, text)
