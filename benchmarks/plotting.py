"""matplotlib for the benchmark reports' plots: the ``bench`` extra (``pip install -e ".[bench]"``).

Asked for before any benchmark runs, so a missing matplotlib stops a long run at its start,
not after it; ``--no-plots`` writes the reports without plots on purpose.
"""

from __future__ import annotations

from typing import Any


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
