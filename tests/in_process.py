"""A module's command line (``python -m MODULE ARGS``), run in this process.

A new interpreter spends seconds importing torch and Lightning before a checkpoint tool's own work, which
takes a fraction of a second. ``runpy`` runs the module's ``__main__`` block as ``python -m`` does (its
``sys.argv`` and ``__main__`` swapped in for the run); only the interpreter is shared with the test. For
commands without process-wide state: nothing of the run stays behind but the files it writes.
"""

from __future__ import annotations

import runpy
import sys
import warnings

import pytest


def run_module(module: str, *args: str) -> None:
    """``python -m module *args`` here; fails as ``subprocess.run(..., check=True)`` would on a non-zero exit."""
    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings():
        patch.setattr(sys, "argv", [module, *args])
        # A module the test imported already is run anew as __main__, as in a new interpreter; runpy warns of it.
        warnings.filterwarnings(
            "ignore", message=".* found in sys.modules after import of package", category=RuntimeWarning
        )
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as exit:
            if exit.code not in (None, 0):
                raise AssertionError(f"python -m {module} {' '.join(args)} exited with {exit.code}") from exit
