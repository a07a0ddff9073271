"""The error reference of the troubleshooting page, generated from the exception classes themselves.

``python -m docs_tools.errors > docs/generated/errors.md`` writes it; ``tests/docs/test_troubleshooting.py``
holds the committed file equal to this output, so an exception class added, moved or reworded
without regenerating fails the suite. Every module of the three packages is imported and every
exception class defined there gets a section: its docstring (a first line saying what happened, then
a "What it means: ..." paragraph and a "What to do: ..." paragraph, which :func:`docstring_problems`
checks), how to import it, what ``except`` catches it, and the modules that raise it (found in their
source). The configuration refusals come from ``ZeroConfig`` itself: each setting given an invalid
value, and the message it raises.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

PACKAGES = ("zero_core", "lightning_zero", "accelerate_zero")
MEANS = "What it means: "
TODO = "What to do: "
# Values tried, in order, until ZeroConfig refuses one: the first refusal is the example shown.
_INVALID_CANDIDATES: tuple[Any, ...] = (-1, "invalid", 1.5)
# Settings valid alone and refused together, as a user writes them.
COMBINATIONS = (
    'ZeroConfig(stage=2, offload_params="cpu")',
    'ZeroConfig(offload_optimizer="cpu", offload_step_in_backward=True, '
    "mixed_precision=MixedPrecision(compute_dtype=torch.float16))",
    "ZeroConfig(stage=1, quantize_weights=True)",
    "ZeroConfig(stage=2, secondary_shard_group_size=2)",
    "ZeroConfig(stage=1, quantize_gradients=True)",
)


@cache
def modules() -> tuple[ModuleType, ...]:
    """Every module of the packages, imported (``__main__`` modules, which run a command, left out)."""
    found = []
    for name in PACKAGES:
        package = importlib.import_module(name)
        found.append(package)
        for info in pkgutil.walk_packages(package.__path__, f"{name}."):
            if info.name.rsplit(".", 1)[-1] != "__main__":
                found.append(importlib.import_module(info.name))
    return tuple(found)


def exception_classes() -> list[type[BaseException]]:
    """The exception classes the packages define (not those they import), by name."""
    classes = {
        value
        for module in modules()
        for value in vars(module).values()
        if isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == module.__name__
    }
    return sorted(classes, key=lambda cls: (cls.__name__, cls.__module__))


@dataclass(frozen=True)
class Doc:
    """An exception class's docstring, in its three parts."""

    summary: str
    means: str
    todo: str


def _paragraphs(text: str) -> list[str]:
    """The paragraphs, each on one line, with reStructuredText's ``code`` written as Markdown's `code`."""
    parts = [" ".join(part.split()) for part in re.split(r"\n\s*\n", text.strip()) if part.strip()]
    return [re.sub(r"``(.+?)``", r"`\1`", part) for part in parts]


def _cell(text: str) -> str:
    """Text as a Markdown table cell shows it literally."""
    return text.replace("|", "\\|").replace("*", "\\*").replace("<", "&lt;")


def docstring_problems(cls: type) -> list[str]:
    """What the class's docstring lacks of the form every error's entry needs (empty: nothing)."""
    doc = inspect.getdoc(cls) if cls.__doc__ else None  # not one inherited from the base class
    if not doc:
        return [f"{cls.__name__} has no docstring"]
    paragraphs = _paragraphs(doc)
    problems = []
    if paragraphs[0].startswith((MEANS, TODO)):
        problems.append(f"{cls.__name__}'s docstring does not open with a line saying what happened")
    for label in (MEANS, TODO):
        count = sum(p.startswith(label) for p in paragraphs)
        if count != 1:
            problems.append(
                f"{cls.__name__}'s docstring needs one paragraph starting {label.strip()!r} ({count} found)"
            )
    return problems


def parse_doc(cls: type) -> Doc:
    """The docstring's parts; raises ``ValueError`` naming what is missing."""
    problems = docstring_problems(cls)
    if problems:
        raise ValueError("; ".join(problems))
    paragraphs = _paragraphs(inspect.getdoc(cls) or "")
    means = [p for p in paragraphs if p.startswith(MEANS)][0]
    todo = [p for p in paragraphs if p.startswith(TODO)][0]
    summary = " ".join(p for p in paragraphs if p not in (means, todo))
    return Doc(summary, means[len(MEANS) :], todo[len(TODO) :])


def import_line(cls: type) -> str:
    """The shortest import that gives the class: the highest package of its module that exports it."""
    parts = cls.__module__.split(".")
    for end in range(1, len(parts) + 1):
        module = importlib.import_module(".".join(parts[:end]))
        if getattr(module, cls.__name__, None) is cls:
            return f"from {module.__name__} import {cls.__name__}"
    raise ValueError(f"{cls.__name__} is not importable from {cls.__module__}")


def _called_name(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id[:1].isupper():
        return func.value.id  # a constructor classmethod: LateGradientError.for_parameter(...)
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


@cache
def _trees() -> dict[str, ast.Module]:
    trees = {}
    for module in modules():
        source = Path(module.__file__ or "")
        if source.suffix == ".py":
            trees[module.__name__] = ast.parse(source.read_text(), filename=str(source))
    return trees


def _factories(name: str) -> set[str]:
    """Module-level functions that build the class for their callers (annotated to return it)."""
    return {
        node.name
        for tree in _trees().values()
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.returns is not None
        if re.search(rf"\b{name}\b", ast.unparse(node.returns))
    }


def raising_modules(cls: type) -> list[str]:
    """The modules whose code builds the class: calls it, a constructor of it, or a factory of it."""
    names = {cls.__name__, *_factories(cls.__name__)}
    return sorted(
        module
        for module, tree in _trees().items()
        if any(isinstance(node, ast.Call) and _called_name(node) in names for node in ast.walk(tree))
    )


def _base(cls: type) -> str:
    """The base class, and the ``except`` clauses that catch the error besides its own."""
    bases = [base.__name__ for base in cls.__mro__[1:] if base not in (BaseException, object)]
    catching = " or ".join(f"`except {name}`" for name in bases)
    return f"`{bases[0]}` (caught by `except {cls.__name__}`, {catching})"


def _entry(cls: type[BaseException]) -> Iterator[str]:
    doc = parse_doc(cls)
    yield f"### `{cls.__name__}` {{ #{cls.__name__} }}"
    yield ""
    yield doc.summary
    yield ""
    yield f"**Import:** `{import_line(cls)}`"
    yield ""
    yield f"**Base class:** {_base(cls)}."
    yield ""
    yield f"**What it means:** {doc.means}"
    yield ""
    yield f"**What to do:** {doc.todo}"
    yield ""
    yield "**Raised in:** " + ", ".join(f"`{module}`" for module in raising_modules(cls)) + "."
    yield ""


def configuration_refusal(name: str) -> tuple[Any, str] | None:
    """An invalid value of the setting and the ``ValueError`` message ``ZeroConfig`` refuses it with."""
    from zero_core.config import ZeroConfig

    for value in _INVALID_CANDIDATES:
        try:
            ZeroConfig(**{name: value})
        except ValueError as error:
            return value, str(error)
        except TypeError:
            continue
    return None


def combination_refusal(call: str) -> str:
    """The ``ValueError`` message of a ``ZeroConfig(...)`` call of :data:`COMBINATIONS`."""
    import torch

    from zero_core import MixedPrecision, ZeroConfig

    try:
        eval(call, {"ZeroConfig": ZeroConfig, "MixedPrecision": MixedPrecision, "torch": torch})
    except ValueError as error:
        return str(error)
    raise AssertionError(f"{call} is not refused")


def _configuration() -> Iterator[str]:
    from zero_core.config import user_settings

    yield "### Configuration refusals { #configuration-refusals }"
    yield ""
    yield (
        "`ZeroConfig` checks every setting when it is built (so do the Lightning and Fabric strategies, "
        "`ZeroPlugin` and `accelerate-zero launch`, which build one): an invalid value raises `ValueError` "
        "naming the setting and what to use, before any model state is touched. The valid values of each "
        "setting are in the [configuration reference](configuration.md); for example:"
    )
    yield ""
    yield "| setting | valid values | an invalid value | the message |"
    yield "|---|---|---|---|"
    for setting in user_settings():
        refusal = configuration_refusal(setting.name)
        shown = (f"`{refusal[0]!r}`", _cell(refusal[1])) if refusal else ("", "(not refused)")
        link = f"[`{setting.name}`](configuration.md#{setting.name})"
        yield f"| {link} | {_cell(setting.values)} | {shown[0]} | {shown[1]} |"
    yield ""
    yield "Some settings are valid alone and refused together:"
    yield ""
    yield "| call | the message |"
    yield "|---|---|"
    for call in COMBINATIONS:
        yield f"| `{call}` | {_cell(combination_refusal(call))} |"
    yield ""


def _index(classes: list[type[BaseException]]) -> Iterator[str]:
    """One row per error, for a reader who has its name from a traceback."""
    yield "| error | what happened |"
    yield "|---|---|"
    for cls in classes:
        yield f"| [`{cls.__name__}`](#{cls.__name__}) | {parse_doc(cls).summary} |"
    yield "| [`ValueError` naming a setting](#configuration-refusals) | a setting's value is refused |"
    yield ""


def reference() -> str:
    lines = ["<!-- Generated by `python -m docs_tools.errors`; do not edit. -->", ""]
    lines.extend(_index(exception_classes()))
    for cls in exception_classes():
        lines.extend(_entry(cls))
    lines.extend(_configuration())
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    print(reference(), end="")
