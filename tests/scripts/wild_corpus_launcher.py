"""What ``accelerate-zero launch ARGS`` hands its processes, set in this process: the wild corpus' Accelerate and
Trainer scripts (``wild_corpus_accelerate.py``, ``wild_corpus_trainer.py``) run all their files in one launch,
so each further file (and each native-flag reference) is read here by the launcher's own reading
(``plugin_from_arguments``) into the variables the launcher would set; for the launch's own file the scripts
report whether that reading gives exactly the variables the launcher set.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from accelerate_zero.deepspeed_flags import ACCUMULATION_VARIABLE  # noqa: E402
from accelerate_zero.launch import plugin_from_arguments  # noqa: E402
from accelerate_zero.plugin import ENV_PREFIX, USE_ZERO_ENV  # noqa: E402

WILD = Path(__file__).resolve().parents[1] / "deepspeed_configs" / "wild"
PRECISION_VARIABLE = "ACCELERATE_MIXED_PRECISION"


def launcher_variables() -> dict[str, str]:
    names = (USE_ZERO_ENV, PRECISION_VARIABLE, ACCUMULATION_VARIABLE)
    return {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIX) or k in names}


def read_as_the_launcher(arguments: list[str]) -> dict[str, str]:
    """Set the variables ``accelerate-zero launch ARGUMENTS --multi_gpu train.py`` sets for its processes (a
    file named in ARGUMENTS relative to the wild corpus); return them."""
    for name in list(launcher_variables()):
        del os.environ[name]  # nothing left of the previous reading
    argv = [str(WILD / a) if (WILD / a).is_file() else a for a in arguments]
    plugin, launch_args = plugin_from_arguments([*argv, "--multi_gpu", "train.py"])
    os.environ.update(plugin.environment())
    precision = launch_args.mixed_precision
    if precision is None and launch_args.config_file:  # Accelerate's launcher takes it from the file it is handed
        from accelerate.commands.config import load_config_from_file

        precision = load_config_from_file(launch_args.config_file).mixed_precision
    os.environ[PRECISION_VARIABLE] = str(precision or "no")  # Accelerate's launcher hands it on so
    return launcher_variables()


def fresh_state() -> None:
    AcceleratorState._reset_state()  # a new Accelerator's own settings, as accelerate_train.py's cases do
    GradientState._reset_state()


def attempt(run: Callable[[], dict]) -> dict:
    """The run's report, or what stopped it (every rank stops the same way, before or during training)."""
    try:
        return run()
    except Exception as error:  # reported: the test fails naming it
        return {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-3000:]}
