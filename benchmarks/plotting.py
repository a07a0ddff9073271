"""matplotlib for the benchmark reports' plots: the ``bench`` extra (``pip install -e ".[bench]"``).

Asked for before any benchmark runs, so a missing matplotlib stops a long run at its start,
not after it; ``--no-plots`` writes the reports without plots on purpose.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# The docs site (mkdocs, docs/) includes the tracked reports, whose images sit beside them here; the
# site serves only files under docs/, so each published plot is copied there under the same name.
DOCS = HERE.parent / "docs"


def pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as error:
        raise SystemExit(
            "The benchmark plots need matplotlib, the project's 'bench' extra: pip install -e \".[bench]\" "
            "(or pass --no-plots to write the report without plots)."
        ) from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def copy_to_docs(plot: Path) -> None:
    """A plot written beside the tracked reports (benchmarks/) goes to docs/ too; others stay put."""
    if plot.resolve().parent == HERE and DOCS.is_dir():
        shutil.copyfile(plot, DOCS / plot.name)
