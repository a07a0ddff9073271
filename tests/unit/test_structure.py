"""The core's structure, read from its code: the import contracts pyproject.toml declares (layers whose
imports point one way, inside ``checkpoint/`` and ``passes/`` too; nothing inside the core imports the
root package; no import circle), no import circle in the module graph as it is, and files and functions
under the caps (the core's and the adapters'). The caps are guard rails, not where to cut: a file holds
one concept whole, and is split only where the concept is.

The contracts are pyproject.toml's ``[tool.importlinter]`` section, the one statement of the layers:
``lint-imports`` checks them in .ci/run, and this test checks them in-process, so a plain pytest run
fails on a broken one. Every import counts, inside functions and under ``TYPE_CHECKING`` too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import grimp
import pytest
from importlinter import api  # configures import-linter's readers and graph builder on import
from importlinter.application import use_cases

from tests.paths import ROOT

CORE = ROOT / "zero_core"
ADAPTERS = (ROOT / "lightning_zero", ROOT / "accelerate_zero")
PYPROJECT = ROOT / "pyproject.toml"
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80
# The contracts the layering rests on; each is in pyproject.toml, none may be dropped.
CONTRACTS = {"core-layers", "core-root", "core-settings", "core-estimate-cli", "core-no-circles"}
CONTRACTS |= {"checkpoint-layers", "passes-layers", "offload-layers", "memory-layers"}


def test_the_import_contracts_hold() -> None:
    """As ``lint-imports`` does; a broken contract's chains are in the captured output."""
    assert use_cases.lint_imports(config_filename=str(PYPROJECT), cache_dir=None, no_logo=True)


def test_the_contracts_are_all_there_and_list_no_exception() -> None:
    contracts = api.read_configuration(str(PYPROJECT))["contracts_options"]
    assert CONTRACTS <= {c["id"] for c in contracts}
    # An exception is a hole: an import the layers refuse is fixed in the code, not listed here.
    assert [c["id"] for c in contracts if "ignore_imports" in c] == []
    loose = [c["id"] for c in contracts if c["type"] == "layers" and c.get("exhaustive") != "True"]
    assert loose == [], "a layers contract places every module of its package (exhaustive = true)"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_import_circle_in_the_core() -> None:
    """The module graph as it is, a package's ``__init__`` and its re-exports included: a module that
    imports its own package's ``__init__`` while that ``__init__`` imports it is a circle (the
    ``core-no-circles`` contract compares siblings, so it does not see this one)."""
    graph = grimp.build_graph("zero_core", cache_dir=None)
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    assert _cycles(edges) == []


@pytest.mark.parametrize(
    "path",
    sorted(path for package in (CORE, *ADAPTERS) for path in package.rglob("*.py")),
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_files_and_functions_are_under_the_caps(path: Path) -> None:
    source = path.read_text()
    assert len(source.splitlines()) <= MAX_FILE_LINES
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert long == []
