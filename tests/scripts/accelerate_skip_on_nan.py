"""The skip-on-NaN loop Accelerate users write, under plain Accelerate (DDP) and ZeroAccelerator at stages
1, 2 and 3, one case after another in one launch; rank 0 writes OUT/NAME.pt with each step's gradient norm
and the weights after it.

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 \\
        tests/scripts/accelerate_skip_on_nan.py OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from accelerate_zero import ZeroAccelerator, ZeroPlugin  # noqa: E402
from tests.models import TinyTransformer, batch, lm_loss, make_optimizer  # noqa: E402

STEPS = 5
NAN_STEP = 1  # rank 0's loss is NaN: the averaged gradients are NaN on every rank, the step is skipped
SKIPPED_STEP = 3  # finite, skipped all the same: its gradients must not reach the next step
CASES = {"ddp": None, "zero1": 1, "zero2": 2, "zero3": 3}


def train(out: Path, name: str, stage: int | None) -> None:
    if stage is None:
        accelerator = Accelerator()
    else:
        accelerator = ZeroAccelerator(zero_plugin=ZeroPlugin(stage=stage))
    torch.manual_seed(0)
    model = TinyTransformer(batchnorm=False)
    optimizer = make_optimizer("sgd", model)  # its update scales with the gradient: a leak shows
    model, optimizer = accelerator.prepare(model, optimizer)
    norms, weights = [], []
    for step in range(STEPS):
        ids = batch(step, accelerator.process_index)
        poison = float("nan") if step == NAN_STEP and accelerator.process_index == 0 else 1.0
        loss = lm_loss(model(ids), ids) * poison
        accelerator.backward(loss)
        norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
        if torch.isfinite(norm) and step != SKIPPED_STEP:
            optimizer.step()
        optimizer.zero_grad()
        norms.append(norm.item())
        weights.append({k: v.detach().cpu().clone() for k, v in accelerator.get_state_dict(model).items()})
    if accelerator.is_main_process:
        torch.save({"norms": norms, "weights": weights}, out / f"{name}.pt")
    accelerator.wait_for_everyone()


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    for index, (name, stage) in enumerate(CASES.items()):
        if index:  # Accelerate's state is made once per process: a fresh one per case, on the same process group
            AcceleratorState._reset_state()
            GradientState._reset_state()
        train(out, name, stage)


if __name__ == "__main__":
    main()
