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


def _section(title: str) -> str:
    start = PAGE.index(f"\n## {title}\n")
    return PAGE[start : PAGE.index("\n## ", start + 1)]


CORE_SOURCE = {path: path.read_text() for path in (ROOT / "zero_core").rglob("*.py")}


def _defined_anywhere(name: str) -> bool:
    """``Class.member``, ``function`` or ``CONSTANT`` (an enum member too) is defined somewhere in the core."""
    owner, _, member = name.rpartition(".")
    pattern = rf"^\s*(def {member}\(|class {member}\b|{member} = )"
    return any(
        re.search(pattern, text, re.M) and (not owner or re.search(rf"^class {owner}\b", text, re.M))
        for text in CORE_SOURCE.values()
    )


def _existing(path: str) -> bool:
    return (ROOT / path).exists() or (ROOT / "zero_core" / path).exists()


def test_one_training_step_names_parts_the_files_it_names_define() -> None:
    """Each row of "One training step, file by file": the part in its second column is defined in the file in
    its third (``Class.method``: that class and that method), and whatever the row names besides (files,
    parts, states) exists. A rename or a move fails here until the walk is redrawn."""
    table = [line for line in _section("One training step, file by file").splitlines() if line.startswith("| ")]
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in table[1:]]  # past the header
    assert len(rows) >= 15, "the walk lost its rows"
    for when, what, where, after in rows:
        if what == "torch's":
            continue
        (path,) = re.findall(r"`([\w/]+\.py)`", where)
        text = (ROOT / path).read_text()
        (part,) = re.findall(r"`([\w.]+)`", what)
        owner, _, member = part.rpartition(".")
        assert re.search(rf"^\s*def {member}\(", text, re.M), (part, path)
        assert not owner or re.search(rf"^class {owner}\b", text, re.M), (part, path)
        named = re.findall(r"`([^`]+)`", when + after)
        for name in named:
            if name.endswith(".py"):
                assert _existing(name), (when, name)
            elif re.fullmatch(r"[A-Za-z_][\w.]*", name) and name not in ("model(batch)",):
                assert _defined_anywhere(name), (when, name)


def test_where_to_add_a_feature_names_files_that_exist() -> None:
    text = _section("Where to add a feature")
    paths = re.findall(r"`([\w/]+\.py)`", text)
    assert len(paths) >= 15
    assert [p for p in paths if not _existing(p)] == []
    names = [n for n in re.findall(r"`([A-Z]\w+)`", text)]
    assert names and all(_defined_anywhere(n) for n in names), names
