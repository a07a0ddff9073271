"""Under ``accelerate-zero launch --zero_config_file ds.json`` whose config has Accelerate's usual "auto" optimizer and
scheduler sections: a script written for Accelerate's DeepSpeed integration (DummyOptim, DummyScheduler) trains
with the optimizer and schedule the config describes; then the same optimizer and schedule built by hand, with
no sections (the schedule stepped once per step, as DeepSpeed's engine steps it). Rank 0 writes OUT/NAME.json
with each run's losses and learning rates, and what a DummyOptim without a section raises.

    ACCELERATE_USE_CPU=1 accelerate-zero launch --zero_config_file ds.json --multi_gpu --num_processes 2 \\
        tests/scripts/accelerate_deepspeed_sections.py OUT
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import DummyOptim, DummyScheduler  # noqa: E402

from accelerate_zero import ZeroAccelerator, ZeroPlugin  # noqa: E402
from accelerate_zero.plugin import DEEPSPEED_CONFIG_ENV  # noqa: E402
from tests.models import TinyTransformer, TokenDataset, lm_loss  # noqa: E402
from zero_core.deepspeed.schedulers import WarmupDecayLR  # noqa: E402

STEPS, LR, WEIGHT_DECAY, WARMUP = 6, 1e-2, 0.01, 2


def train(accelerator: ZeroAccelerator, by_hand: bool, steps: int = STEPS) -> dict:
    """``steps`` optimizer steps with the config's optimizer and schedule (from DummyOptim/DummyScheduler), or
    (``by_hand``) the same built by hand and clipped at 1.0, as the config's step clips."""
    torch.manual_seed(0)
    model = TinyTransformer(blocks=2, batchnorm=False)
    data = DataLoader(TokenDataset(2 * steps * accelerator.num_processes), batch_size=2)
    if by_hand:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        scheduler = WarmupDecayLR(optimizer, steps, warmup_min_lr=0, warmup_max_lr=LR, warmup_num_steps=WARMUP)
    else:  # Accelerate's DeepSpeed way: the total counts every process's steps (divided among them)
        optimizer = DummyOptim(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        scheduler = DummyScheduler(
            optimizer, total_num_steps=steps * accelerator.num_processes, warmup_num_steps=WARMUP
        )
    model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, data, scheduler)
    losses, lrs, norms, skipped = [], [], [], []
    for ids in data:
        lrs.append(optimizer.param_groups[0]["lr"])
        loss = lm_loss(model(ids), ids)
        accelerator.backward(loss)
        if by_hand:  # what the config's run gets from its optimizer step
            norms.append(accelerator.clip_grad_norm_(model.parameters(), 1.0).item())
        optimizer.step()
        # By hand the schedule skips with the step, as the config's (stepped in the optimizer's step) does.
        if not (by_hand and optimizer.step_was_skipped):
            scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        skipped.append(optimizer.step_was_skipped)
    weights = {name: t.float().flatten().tolist() for name, t in accelerator.get_state_dict(model).items()}
    return {
        "losses": losses,
        "lrs": lrs,
        "norms": norms,
        "skipped": skipped,
        "weights": weights,
        "optimizer": type(optimizer.optimizer).__name__,
        "stage": accelerator.engine.stage,
        "mixed_precision": accelerator.mixed_precision,
    }


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    report = {"config": train(ZeroAccelerator(), by_hand=False)}  # the launcher's settings and sections
    # The same by hand: no sections (the launcher's file named no more), the schedule stepped once per step.
    del os.environ[DEEPSPEED_CONFIG_ENV]
    AcceleratorState._reset_state()  # a new Accelerator's own settings, as accelerate_train.py's cases do
    GradientState._reset_state()
    hand = ZeroAccelerator(zero_plugin=ZeroPlugin(), step_scheduler_with_optimizer=False)
    report["hand"] = train(hand, by_hand=True)
    try:
        hand.prepare(DummyOptim(torch.nn.Linear(2, 2).parameters()))
    except ValueError as error:
        report["dummy_without_section"] = str(error)
    if hand.is_main_process:
        (out / "sections.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
