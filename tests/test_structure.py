"""The core's structure, read from its source (in process, no torch.distributed): imports between
``zero_core`` modules form no circle (``TYPE_CHECKING`` imports included), the unit and step layers
point one way, and their files and functions stay small."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parent.parent / "zero_core"
SMALL_LAYERS = ("unit", "step")
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
# The circle through the engine's checkpoint, full-parameter and state_dict helpers is still there;
# the model and checkpoint layers remove it (then this set is empty).
KNOWN_CIRCLES = [
    {"zero_core.engine", "zero_core.engine_checkpoints", "zero_core.full_params", "zero_core.state_dict_hooks"}
]
# Who may import the step layer, and what the step layer may import outside itself.
STEP_IMPORTERS = ("zero_core", "zero_core.engine", "zero_core.model_changes", "zero_core.full_params")
STEP_IMPORTERS += ("zero_core.state_dict_hooks", "zero_core.engine_checkpoints")  # and zero_core.checkpoint.*
STEP_MAY_IMPORT = ("zero_core.unit", "zero_core.collectives", "zero_core.config", "zero_core.host_memory")
STEP_MAY_IMPORT += ("zero_core.optim", "zero_core.param_groups", "zero_core.precision", "zero_core.grad_ops")
STEP_MAY_IMPORT += ("zero_core.setup_agreement",)


def _module_name(path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(CORE.parent).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The zero_core modules ``path`` imports, at any depth of its code (TYPE_CHECKING blocks too)."""
    name, is_package = _module_name(path)
    package = name.split(".") if is_package else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    paths = sorted(CORE.rglob("*.py"))
    modules = {_module_name(path)[0] for path in paths}
    return {_module_name(path)[0]: _imports(path, modules) for path in paths}


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in graph[module]:
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = set()
            while True:
                other = stack.pop()
                component.add(other)
                if other == module:
                    break
            if len(component) > 1:
                found.append(component)

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def _in(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes)


def test_circles_detected() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [{"a", "b", "c"}]


def test_no_import_circle_in_the_core() -> None:
    unexpected = [circle for circle in circles(import_graph()) if circle not in KNOWN_CIRCLES]
    assert unexpected == []


def test_unit_layer_imports_nothing_above_it() -> None:
    below = ("zero_core.unit", "zero_core.collectives", "zero_core.config", "zero_core.host_memory")
    upward = {
        module: sorted(d for d in deps if not _in(d, below))
        for module, deps in import_graph().items()
        if _in(module, ("zero_core.unit",))
    }
    assert {module: deps for module, deps in upward.items() if deps} == {}


def test_step_layer_arrows_point_one_way() -> None:
    graph = import_graph()
    importers = [
        module
        for module, deps in graph.items()
        if not _in(module, ("zero_core.step",)) and any(_in(d, ("zero_core.step",)) for d in deps)
    ]
    assert sorted(m for m in importers if not (m in STEP_IMPORTERS or _in(m, ("zero_core.checkpoint",)))) == []
    reaching_out = {
        module: sorted(d for d in deps if not _in(d, ("zero_core.step", *STEP_MAY_IMPORT)))
        for module, deps in graph.items()
        if _in(module, ("zero_core.step",))
    }
    assert {module: deps for module, deps in reaching_out.items() if deps} == {}


@pytest.mark.parametrize("layer", SMALL_LAYERS)
def test_layer_files_and_functions_stay_small(layer: str) -> None:
    long_files, long_functions = [], []
    for path in sorted((CORE / layer).rglob("*.py")):
        source = path.read_text()
        if len(source.splitlines()) > MAX_FILE_LINES:
            long_files.append(path.name)
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.end_lineno is not None and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                    long_functions.append(f"{path.name}:{node.name}")
    assert (long_files, long_functions) == ([], [])
