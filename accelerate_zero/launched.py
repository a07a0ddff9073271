"""What each process ``accelerate-zero launch`` starts runs: the user's script (or ``-m`` module), watched by
``plain_training``'s check that a ZeroAccelerator, not a plain Accelerator or Trainer, does the training, and by
the refusal of DeepSpeed's import when transformers would hand it the run (``DeepSpeedHandoffRefusal``).

    python -m accelerate_zero.launched [--module] TARGET [ARGS ...]
"""

from __future__ import annotations

import importlib.abc
import os
import runpy
import sys
from collections.abc import Sequence
from typing import Any

from accelerate_zero.plain_training import watch_for_plain_training

DEEPSPEED_HANDOFF_ERROR = (
    "accelerate-zero launch: {reason}. This launcher trains on the ZeRO engine, not DeepSpeed, so DeepSpeed is not "
    "imported for it: build the arguments with accelerate_zero.ZeroTrainingArguments (the same arguments: `from "
    "accelerate_zero import ZeroTrainingArguments as TrainingArguments`), whose deepspeed= config ZeroTrainer runs "
    "here, and load the model after them as before."
)


class DeepSpeedHandoffRefusal(importlib.abc.MetaPathFinder):
    """Refuses the first ``import deepspeed`` of a process this launcher started while transformers is about to
    give DeepSpeed work, with what to do instead.

    Plain ``TrainingArguments(deepspeed=...)`` acts on its config as it is built. It registers the config
    globally; with a stage-3 one, every later ``from_pretrained`` (and ``from_config``) sees
    ``is_deepspeed_zero3_enabled()`` and loads the model inside ``deepspeed.zero.Init``, partitioned by DeepSpeed,
    whose own distributed state this launch never sets up (on CPU it fails there; on GPUs ZeroTrainer would get a
    partitioned model). Off the CPU it also sets ``ACCELERATE_USE_DEEPSPEED`` while Accelerate sets up its
    processes, which makes Accelerate initialise DeepSpeed's communication. Both start with ``import deepspeed``,
    which transformers and Accelerate defer to that moment: this finder, ahead of the others on
    ``sys.meta_path``, refuses it then, on every process alike, before DeepSpeed runs anything. Any other import of
    DeepSpeed (its ops, say) goes ahead. Where DeepSpeed was imported earlier in the process (by the script, or by
    Accelerate's ``extract_model_from_parallel``, which ``save_pretrained`` and ``unwrap_model`` call) this finder
    is not asked again; ZeroTrainer still refuses a model DeepSpeed partitioned."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None, target: Any = None) -> None:
        if fullname == "deepspeed":
            reason = _deepspeed_handoff()
            if reason is not None:
                raise ImportError(DEEPSPEED_HANDOFF_ERROR.format(reason=reason), name=fullname)
        return None  # the other finders find it


def _deepspeed_handoff() -> str | None:
    """Why DeepSpeed is being imported, when transformers is handing it the run; None otherwise."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":  # never set by this launcher
        return (
            "TrainingArguments(deepspeed=...) (or ACCELERATE_USE_DEEPSPEED=true) asks Accelerate to set up "
            "DeepSpeed's own distributed state"
        )
    # Only transformers' integration holds its config; while that module is still being imported (it probes for
    # DeepSpeed as it starts), nothing is registered yet.
    zero3_enabled = getattr(sys.modules.get("transformers.integrations.deepspeed"), "is_deepspeed_zero3_enabled", None)
    if zero3_enabled is not None and zero3_enabled():
        return (
            "TrainingArguments(deepspeed=<a stage-3 config>) makes transformers load and build models inside "
            "deepspeed.zero.Init, partitioned by DeepSpeed"
        )
    return None


def refuse_deepspeed_handoff() -> None:
    if not any(isinstance(finder, DeepSpeedHandoffRefusal) for finder in sys.meta_path):
        sys.meta_path.insert(0, DeepSpeedHandoffRefusal())


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    as_module = bool(argv) and argv[0] == "--module"
    if as_module:
        argv = argv[1:]
    if not argv:
        raise SystemExit("usage: python -m accelerate_zero.launched [--module] TARGET [ARGS ...]")
    watch_for_plain_training()
    refuse_deepspeed_handoff()
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
