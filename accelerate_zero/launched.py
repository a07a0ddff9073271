"""What each process ``accelerate-zero launch`` starts runs: the user's script (or ``-m`` module), watched by
``plain_training``'s check that a ZeroAccelerator, not a plain Accelerator or Trainer, does the training.

    python -m accelerate_zero.launched [--module] TARGET [ARGS ...]
"""

from __future__ import annotations

import os
import runpy
import sys

from accelerate_zero.plain_training import watch_for_plain_training


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    as_module = bool(argv) and argv[0] == "--module"
    if as_module:
        argv = argv[1:]
    if not argv:
        raise SystemExit("usage: python -m accelerate_zero.launched [--module] TARGET [ARGS ...]")
    watch_for_plain_training()
    target = argv[0]
    sys.argv = argv
    if as_module:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        # As `python script.py` would: the script's folder (links resolved) first on the import path, unless
        # Python runs with a safe path (-P), which adds none.
        if not sys.flags.safe_path:
            sys.path[0] = os.path.dirname(os.path.realpath(target))
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main()
