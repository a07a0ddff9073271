"""What ZeroAccelerator assumes of plain Accelerate's save_state/load_state, checked on a plain
``Accelerator`` in one CPU process; prints a JSON report ``{check: true/false}``.

python tests/scripts/accelerate_assumptions.py WORKDIR

ZeroAccelerator saves the model and optimizer itself. For the model it takes Accelerate's
documented route (a save/load-state pre-hook empties ``weights``/``models``); for the optimizer
there is none, so it empties the private ``_optimizers`` list around the call; it registers the
model in the private ``_models`` list; and it lifts ``project_configuration.total_limit`` around
the call because Accelerate prunes old checkpoints before it saves. Each check below is one of
those assumptions.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration


class _Recording(Accelerator):
    """Records the ``unwrap`` of every get_state_dict call, in order with the pre-hooks' calls."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(cpu=True, **kwargs)
        self.events: list[str] = []

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict:
        self.events.append(f"get_state_dict(unwrap={unwrap})")
        return super().get_state_dict(model, unwrap=unwrap)


def _prepared(**kwargs: Any) -> tuple[_Recording, torch.nn.Module, Any]:
    accelerator = _Recording(**kwargs)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    return accelerator, model, optimizer


def _save_checks(work: Path) -> dict[str, bool]:
    accelerator, model, optimizer = _prepared()
    report = {
        "_models and _optimizers are lists holding the prepared model and optimizer": (
            isinstance(accelerator._models, list)
            and isinstance(accelerator._optimizers, list)
            and any(m is model for m in accelerator._models)
            and any(o is optimizer for o in accelerator._optimizers)
        )
    }
    seen: dict[str, Any] = {}

    def drop_weights(models: list, weights: list, location: str) -> None:
        accelerator.events.append("pre-hook")
        seen.update(models=list(models), weights=len(weights))
        weights.clear()

    handle = accelerator.register_save_state_pre_hook(drop_weights)
    optimizers, accelerator._optimizers = accelerator._optimizers, []
    try:
        accelerator.save_state(str(work / "plain"))
    finally:
        accelerator._optimizers = optimizers
    handle.remove()
    files = {p.name for p in (work / "plain").iterdir()}
    report["save_state collects each model's weights by get_state_dict(unwrap=False) before its pre-hooks"] = (
        accelerator.events == ["get_state_dict(unwrap=False)", "pre-hook"]
    )
    report["save pre-hooks receive _models and the weights list, one entry per model"] = (
        len(seen["models"]) == 1 and seen["models"][0] is model and seen["weights"] == 1
    )
    report["a save pre-hook that empties weights leaves no model file"] = not any(
        name.startswith(("model", "pytorch_model")) for name in files
    )
    report["save_state writes the optimizers of _optimizers, read when it is called"] = not any(
        name.startswith("optimizer") for name in files
    )
    accelerator.save_state(str(work / "with-optimizer"))
    report["save_state writes an optimizer file when _optimizers holds one"] = (
        work / "with-optimizer" / "optimizer.bin"
    ).exists()
    return report


def _load_checks(work: Path) -> dict[str, bool]:
    """Load the folder saved without model or optimizer files: only if Accelerate honours both routes."""
    accelerator, model, _ = _prepared()
    seen: list[list] = []

    def drop_models(models: list, location: str) -> None:
        seen.append(list(models))
        models.clear()

    handle = accelerator.register_load_state_pre_hook(drop_models)
    optimizers, accelerator._optimizers = accelerator._optimizers, []
    try:
        accelerator.load_state(str(work / "plain"))
        loaded = True
    except Exception:  # noqa: BLE001 - reported: a file Accelerate now insists on
        loaded = False
    finally:
        accelerator._optimizers = optimizers
    handle.remove()
    return {
        "load pre-hooks receive the models of _models": len(seen) == 1 and [m is model for m in seen[0]] == [True],
        "load_state loads no model emptied by a pre-hook, nor optimizers missing from _optimizers": loaded,
    }


def _pruning_checks(work: Path) -> dict[str, bool]:
    """A checkpoint saved, then saves that fail in a pre-hook: with total_limit lifted to None
    nothing is pruned; with total_limit=1 Accelerate prunes before it writes (none is left)."""
    config = ProjectConfiguration(project_dir=str(work / "auto"), automatic_checkpoint_naming=True, total_limit=1)
    accelerator, _, _ = _prepared(project_config=config)
    accelerator.save_state()
    checkpoints = work / "auto" / "checkpoints"

    def fail(models: list, weights: list, location: str) -> None:
        raise OSError("disk full")

    def failed_save(limit: int | None) -> bool:
        """Whether checkpoint_0 survived a failed save under ``limit``."""
        accelerator.project_configuration.total_limit = limit
        try:
            accelerator.save_state()
        except OSError:
            pass
        shutil.rmtree(checkpoints / "checkpoint_1", ignore_errors=True)  # the failed save's folder
        return (checkpoints / "checkpoint_0").exists()

    handle = accelerator.register_save_state_pre_hook(fail)
    kept_without_limit, kept_with_limit = failed_save(None), failed_save(1)
    handle.remove()
    return {
        "save_state reads total_limit when called (None: no pruning)": kept_without_limit,
        "save_state prunes beyond total_limit before it saves": not kept_with_limit,
    }


def main() -> None:
    work = Path(sys.argv[1])
    torch.set_num_threads(1)
    report = {**_save_checks(work), **_load_checks(work), **_pruning_checks(work)}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
