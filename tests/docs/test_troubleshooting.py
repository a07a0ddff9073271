"""The troubleshooting page's error reference: generated from the exception classes, complete, current.

``docs/generated/errors.md`` is ``python -m docs_tools.errors``'s output, committed; an exception
class added, moved or reworded (its docstring, where it is raised) without regenerating fails here.
Every exception class must carry the docstring form the entries are built from: a first line saying
what happened, a "What it means: ..." paragraph and a "What to do: ..." paragraph.
"""

from __future__ import annotations

import re

import pytest

from docs_tools import errors
from tests.paths import ROOT

errors.modules()  # every module imported at collection, as the other tests' imports are (not inside a test)

GENERATED = ROOT / "docs" / "generated" / "errors.md"
PAGE = ROOT / "docs" / "troubleshooting.md"
# The classes the package defines today: finding fewer means the walk over the packages broke.
KNOWN = {
    "CheckpointError",
    "CollectiveFailed",
    "LateGradientError",
    "ModelChangedError",
    "OffloadError",
    "ParameterAtRestError",
    "RanksDivergedError",
    "UnscaledBackwardError",
}


def test_committed_reference_is_the_generators_output() -> None:
    assert GENERATED.read_text() == errors.reference(), (
        "docs/generated/errors.md is stale: run `python -m docs_tools.errors > docs/generated/errors.md`"
    )


def test_every_exception_class_has_an_entry() -> None:
    classes = errors.exception_classes()
    assert KNOWN <= {cls.__name__ for cls in classes}
    text = GENERATED.read_text()
    for cls in classes:
        assert not errors.docstring_problems(cls), errors.docstring_problems(cls)
        assert f"### `{cls.__name__}` {{ #{cls.__name__} }}" in text
        assert f"`{errors.import_line(cls)}`" in text
        assert errors.raising_modules(cls), f"no module raises {cls.__name__}"


def test_the_import_lines_import() -> None:
    for cls in errors.exception_classes():
        namespace: dict = {}
        exec(errors.import_line(cls), namespace)
        assert namespace[cls.__name__] is cls


def test_a_class_without_the_docstring_form_is_refused() -> None:
    class BareError(RuntimeError):
        pass

    class VagueError(RuntimeError):
        """Something went wrong.

        What it means: something went wrong.
        """

    class GoodError(RuntimeError):
        """Something went wrong.

        What it means: a made-up failure.

        What to do: nothing; it is made up.
        """

    assert errors.docstring_problems(BareError) == ["BareError has no docstring"]  # not RuntimeError's
    assert any("'What to do:'" in problem for problem in errors.docstring_problems(VagueError))
    with pytest.raises(ValueError, match="What to do"):
        errors.parse_doc(VagueError)
    assert errors.docstring_problems(GoodError) == []
    doc = errors.parse_doc(GoodError)
    assert (doc.summary, doc.means, doc.todo) == (
        "Something went wrong.",
        "a made-up failure.",
        "nothing; it is made up.",
    )


def test_configuration_refusals_name_the_setting() -> None:
    from zero_core.config import user_settings

    for setting in user_settings():
        refusal = errors.configuration_refusal(setting.name)
        if refusal is not None:
            assert f"ZeroConfig.{setting.name}" in refusal[1]
    assert errors.configuration_refusal("stage") is not None
    for call in errors.COMBINATIONS:
        assert errors.combination_refusal(call).startswith("ZeroConfig.")


def test_the_page_includes_the_reference_and_its_anchors_exist() -> None:
    page = PAGE.read_text()
    assert '--8<-- "errors.md"' in page
    anchors = set(re.findall(r"\{ #(\w[\w-]*) \}", GENERATED.read_text()))
    for anchor in re.findall(r"\]\(#(\w[\w-]*)\)", page):
        assert anchor in anchors or re.search(rf"^#+ .*\b{anchor}\b", page, re.M | re.I), anchor
