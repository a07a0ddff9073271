"""The core's structure, read from its code: layers whose imports point one way, no import circle
(also none under TYPE_CHECKING or inside functions), small files and functions.

Layers, highest first (a module may import its own layer and those below it, never one above, and
never a sibling of its layer):

    engine -> build -> {model, checkpoint, step, estimate} -> optim -> agreement -> unit -> {collectives, config, ...}
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parent.parent / "zero_core"

# Top-level module or package of zero_core -> (layer rank, sibling group). Higher ranks import lower ones.
LAYERS: dict[str, tuple[int, str]] = {
    "sharding": (7, "sharding"),
    "setup_summary": (7, "setup_summary"),  # reads an engine: above it, as sharding is
    "engine": (6, "engine"),
    "engine_checkpoints": (6, "engine"),  # the checkpoint methods ZeroEngine inherits
    "estimate": (4, "estimate"),  # before launch: plans units and offload as build.py does, then the formulas
    "estimate_cli": (4, "estimate"),
    "build": (5, "build"),
    "model": (4, "model"),
    "checkpoint": (4, "checkpoint"),
    "step": (4, "step"),
    "optim": (3, "optim"),
    "accounting": (3, "accounting"),
    "agreement": (2, "agreement"),
    "mesh": (2, "mesh"),  # the engine's groups on a device mesh (tensor parallelism), and what it refuses there
    "unit": (1, "unit"),
    "collectives": (0, "collectives"),
    "config": (0, "config"),
    "settings": (0, "config"),  # the records config.py declares its fields with
    "offload_settings": (0, "config"),  # the offload modes config.py declares, and their checks
    "wrap_policy": (0, "config"),  # the unit policy config.py declares, and its user-written forms
    "precision": (0, "config"),  # the dtype policy config.py holds, and the checks of its loss-scaling settings
    "deepspeed": (1, "deepspeed"),  # a DeepSpeed config read as the settings config.py declares
    "host_memory": (0, "host_memory"),
    "file_io": (0, "file_io"),  # tensors to and from the NVMe tier's files, for the optimizer's and the shards'
    "hook_copies": (0, "hook_copies"),  # the engine's hooks, inert in a deep copy of the model
}
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def _module_name(path: Path) -> str:
    parts = path.relative_to(CORE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    """The zero_core modules an ``from ... import ...`` names (a name may be a submodule)."""
    if node.level:
        base = module.split(".")
        base = base if is_package else base[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if not target.startswith("zero_core"):
        return []
    return [target] + [f"{target}.{alias.name}" for alias in node.names]


def _imports() -> dict[str, set[str]]:
    """Every zero_core module -> the zero_core modules it imports, wherever the import stands."""
    paths = {(_module_name(p)): p for p in CORE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                targets.update(_resolve(module, path.name == "__init__.py", node))
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names if alias.name.startswith("zero_core"))
        graph[module] = {t for t in targets if t in paths and t != module}
    return graph


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


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


# A package's __init__ re-exports its own modules; importing it is importing them.
def _without_init_reexports(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    return {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in graph.items()}


def test_no_import_circle_in_the_core() -> None:
    assert _cycles(_without_init_reexports(_imports())) == []


def test_every_top_level_module_has_a_layer() -> None:
    tops = {_top(m) for m in _imports()} - {""}
    assert tops <= set(LAYERS), f"give these a layer in LAYERS: {sorted(tops - set(LAYERS))}"


def test_imports_point_down_the_layers() -> None:
    wrong = []
    for module, targets in _imports().items():
        if not _top(module):
            continue  # zero_core/__init__.py: the public surface re-exports every layer
        rank, group = LAYERS[_top(module)]
        for target in targets:
            if not _top(target) or _top(target) == _top(module):
                continue
            target_rank, target_group = LAYERS[_top(target)]
            if target_rank > rank or (target_rank == rank and target_group != group):
                wrong.append(f"{module} -> {target}")
    assert wrong == []


@pytest.mark.parametrize("path", sorted(CORE.rglob("*.py")), ids=lambda p: str(p.relative_to(CORE)))
def test_core_files_and_functions_are_small(path: Path) -> None:
    source = path.read_text()
    assert len(source.splitlines()) <= MAX_FILE_LINES
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert long == []
