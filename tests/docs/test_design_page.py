"""The design page is the map of the code: its layout names every module under its package, and
names no module that is gone, so adding, moving or removing a file means updating the map."""

from __future__ import annotations

import re

from tests.paths import ROOT

PAGE = (ROOT / "docs" / "design.md").read_text()
LAYOUT = PAGE[PAGE.index("\n## Layout\n") : PAGE.index("\n## ", PAGE.index("\n## Layout\n") + 1)]
PACKAGES = ("zero_core", "lightning_zero", "accelerate_zero")


def _sections() -> dict[str, str]:
    """Each package folder the layout has a heading for (``zero_core/unit/``), with its text."""
    found = {}
    for match in re.finditer(r"^### `([\w/]+/)`[^\n]*\n(.*?)(?=^### |\Z)", LAYOUT, re.M | re.S):
        found[match[1]] = match[2]
    return found


def _folders() -> dict[str, list[str]]:
    folders: dict[str, list[str]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name != "__init__.py" and "__pycache__" not in path.parts:
                folders.setdefault(f"{path.parent.relative_to(ROOT).as_posix()}/", []).append(path.name)
    return folders


def test_every_module_is_on_the_map_under_its_package() -> None:
    sections = _sections()
    missing = {folder for folder in _folders() if folder not in sections}
    assert not missing, f"docs/design.md's Layout has no heading for {sorted(missing)}"
    unnamed = [
        f"{folder}{name}"
        for folder, names in _folders().items()
        for name in names
        if f"`{name}`" not in sections[folder]
    ]
    assert not unnamed, f"docs/design.md's Layout does not name {unnamed}"


def test_the_map_names_no_module_that_is_gone() -> None:
    folders = _folders()
    stale = [
        f"{folder}{name}"
        for folder, text in _sections().items()
        for name in re.findall(r"`(\w+\.py)`", text)
        if name != "__init__.py" and name not in folders.get(folder, [])
    ]
    assert not stale, f"docs/design.md's Layout names files that do not exist: {stale}"
