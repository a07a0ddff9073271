"""A stage-3 model read on the main process only, under `accelerate launch` with 2 CPU processes.

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 tests/scripts/rank0_reads.py OUT

1. ``if is_main_process: torch.save(unwrap_model(model).state_dict(), f)`` then ``wait_for_everyone()``
   (the pattern of many user scripts): both processes must fail at once with the same message, and
   the fix it names (``get_state_dict`` on every process) must then work.
2. The second process returns from the script while the main one reads the model: the main one must
   fail at once, naming the exit, and both must exit normally.
Each process writes OUT/rank<N>.json.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from accelerate_zero import ZeroAccelerator, ZeroPlugin  # noqa: E402
from tests.models import TinyTransformer, batch, lm_loss, make_optimizer  # noqa: E402
from zero_core import RanksDivergedError  # noqa: E402


def attempt(report: dict, name: str, action) -> None:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    try:
        action()
        report[name] = None
    except RanksDivergedError as error:
        report[name] = str(error)
    report[f"{name} seconds"] = time.monotonic() - start


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    accelerator = ZeroAccelerator(zero_plugin=ZeroPlugin(stage=3, wrap_classes=["Block"]))
    torch.manual_seed(0)
    model = TinyTransformer(batchnorm=False)
    model, optimizer = accelerator.prepare(model, make_optimizer("adamw", model))
    ids = batch(0, accelerator.process_index)
    accelerator.backward(lm_loss(model(ids), ids))
    optimizer.step()
    rank = accelerator.process_index
    report: dict = {}

    def save_on_main_only() -> None:  # the main process fails in state_dict(), the other in the wait
        if accelerator.is_main_process:
            torch.save(accelerator.unwrap_model(model).state_dict(), out / "model.pt")
        accelerator.wait_for_everyone()

    attempt(report, "main only", save_on_main_only)
    state = accelerator.get_state_dict(model)  # the fix: every process gathers, the main one writes
    if accelerator.is_main_process:
        torch.save(state, out / "model.pt")
    accelerator.wait_for_everyone()
    report["fixed"] = torch.load(out / "model.pt", weights_only=True).keys() == state.keys()
    if rank == 1:
        (out / "rank1.json").write_text(json.dumps(report))
        return  # leaves while the main process reads the model
    time.sleep(2)
    attempt(report, "after exit", lambda: accelerator.unwrap_model(model).state_dict())
    (out / "rank0.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
