"""The adapters and the tests use the core's public surface only (one process, no training):
``zero_core``'s exported names, its public submodules, and the engine's public members,
so the core's parts (the step runtime, the units, the loss scaler) can change shape freely."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import NamedTuple

import zero_core
from tests.paths import ROOT
from zero_core import ZeroEngine

ADAPTERS = ("lightning_zero", "accelerate_zero")
# zero_core.settings: the settings schema the adapters are generated from.
PUBLIC_SUBMODULES = ("zero_core.checkpoint", "zero_core.sharding", "zero_core.settings", "zero_core.deepspeed")
# What the engine holds as plain attributes and documents; everything else it offers is a method
# or property of its class. Its parts (the step runtime, the units, the loss scaler, ...) are private.
ENGINE_DATA = {"model", "config"}


class Finding(NamedTuple):
    path: str
    line: int
    what: str


def _python_files(*folders: str) -> list[Path]:
    return sorted(path for folder in folders for path in (ROOT / folder).rglob("*.py"))


def _public_names(module: str) -> set[str]:
    imported = importlib.import_module(module)
    return set(getattr(imported, "__all__", [n for n in vars(imported) if not n.startswith("_")]))


def _names_an_engine(node: ast.expr) -> bool:
    """``engine``, ``self.engine``, ``self._engine()``, ``engine_of(model)``: an expression whose
    last name says it is an engine."""
    if isinstance(node, ast.Call):
        node = node.func
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return "engine" in name.lower()


def _engine_members_used(tree: ast.AST, path: str) -> list[Finding]:
    allowed = {name for name in dir(ZeroEngine) if not name.startswith("_")} | ENGINE_DATA
    return [
        Finding(path, node.lineno, f"{ast.unparse(node)}: not a public member of ZeroEngine")
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and _names_an_engine(node.value) and node.attr not in allowed
    ]


def _core_imports(tree: ast.AST, path: str) -> list[Finding]:
    findings = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [(node.module, alias.name) for alias in node.names]
        else:
            continue
        for module, name in modules:
            if module != "zero_core" and not module.startswith("zero_core."):
                continue
            if module != "zero_core" and module not in PUBLIC_SUBMODULES:
                findings.append(Finding(path, node.lineno, f"imports {module}: not a public submodule"))
            elif name is not None and name not in _public_names(module):
                findings.append(Finding(path, node.lineno, f"imports {module}.{name}: not exported"))
    return findings


def _findings(folders: tuple[str, ...], adapter: bool) -> list[Finding]:
    found = []
    for path in _python_files(*folders):
        tree = ast.parse(path.read_text(), filename=str(path))
        relative = str(path.relative_to(ROOT))
        if adapter:
            found += _engine_members_used(tree, relative) + _core_imports(tree, relative)
        else:
            found += _engine_members_used(tree, relative)
    return found


def test_the_adapters_use_only_the_cores_public_surface() -> None:
    assert _findings(ADAPTERS, adapter=True) == []


def test_no_test_reaches_through_an_engine_into_its_parts() -> None:
    """Tests of an internal piece may build that piece themselves; through an engine they read reports."""
    assert _findings(("tests",), adapter=False) == []


def test_the_check_finds_what_it_looks_for() -> None:
    source = """
from zero_core.engine import engine_owning
from zero_core import ZeroEngine, DynamicLossScaler
import zero_core.runtime
engine.runtime.announce_scaled_backward()
self._engine().loss_scaler.scale_loss(loss)
engine._groups
engine.prefetch_depth
"""
    tree = ast.parse(source)
    found = [finding.what for finding in _engine_members_used(tree, "x") + _core_imports(tree, "x")]
    assert sorted(found) == sorted(
        [
            "engine.runtime: not a public member of ZeroEngine",
            "self._engine().loss_scaler: not a public member of ZeroEngine",
            "engine._groups: not a public member of ZeroEngine",
            "imports zero_core.engine: not a public submodule",
            "imports zero_core.DynamicLossScaler: not exported",
            "imports zero_core.runtime: not a public submodule",
        ]
    ), found


def test_every_exported_name_exists() -> None:
    assert all(hasattr(zero_core, name) for name in zero_core.__all__)
    for module in PUBLIC_SUBMODULES:
        assert _public_names(module)
