"""A DeepSpeed config's ``train_batch_size`` under ``ZeroAccelerator``, on every rank of one launch:

- the launcher's config (``--zero_config_file``: ``train_batch_size`` 8, micro-batch 2, no accumulation, on 2
  processes): the Accelerator accumulates the 2 micro-batches DeepSpeed derives, and trains as the native
  settings with ``gradient_accumulation_steps=2``;
- ``ZeroPlugin.from_deepspeed`` with the micro-batch "auto": the accumulation derived when the DataLoader is
  prepared, the same training;
- what is refused: a DataLoader whose batch size is not the config's micro-batch, and three numbers that
  disagree.

Each rank writes OUT/rank<r>.json.

    ACCELERATE_USE_CPU=1 accelerate-zero launch --zero_config_file ds.json --multi_gpu --num_processes 2 \\
        tests/scripts/accelerate_global_batch.py OUT
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from accelerate_zero import ZeroAccelerator, ZeroPlugin  # noqa: E402
from accelerate_zero.plugin import DEEPSPEED_CONFIG_ENV  # noqa: E402
from tests.models import TinyTransformer, TokenDataset, lm_loss  # noqa: E402

MICRO, STEPS = 2, 3
AUTO_MICRO = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2}}


def fresh() -> None:
    """A new Accelerator's own settings, as accelerate_train.py's cases do."""
    AcceleratorState._reset_state()
    GradientState._reset_state()


def train(accelerator: ZeroAccelerator, batch_size: int = MICRO, clip: bool = False) -> dict[str, Any]:
    """``clip``: at 1.0 in the loop, as a config's step clips where it names no gradient_clipping (DeepSpeed's
    default under Accelerate)."""
    torch.manual_seed(0)
    model = TinyTransformer(blocks=2, batchnorm=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = DataLoader(TokenDataset(MICRO * 2 * STEPS * accelerator.num_processes), batch_size=batch_size)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    losses, steps = [], 0
    for ids in data:
        with accelerator.accumulate(model):
            loss = lm_loss(model(ids), ids)
            accelerator.backward(loss)
            if clip and accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        steps += accelerator.sync_gradients
        losses.append(loss.item())
    weights = {name: t.flatten().tolist() for name, t in accelerator.get_state_dict(model).items()}
    return {
        "losses": losses,
        "steps": steps,
        "weights": weights,
        "accumulation": accelerator.gradient_accumulation_steps,
    }


def refused(build: Any) -> str:
    fresh()
    try:
        build()
    except ValueError as error:
        return str(error)
    return ""


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    report = {"launcher": train(ZeroAccelerator())}
    del os.environ[DEEPSPEED_CONFIG_ENV]  # the rest of the cases name their settings themselves
    fresh()
    report["auto"] = train(ZeroAccelerator(zero_plugin=ZeroPlugin.from_deepspeed(AUTO_MICRO)))
    fresh()
    native = ZeroAccelerator(zero_plugin=ZeroPlugin(stage=2), gradient_accumulation_steps=2)
    report["native"] = train(native, clip=True)
    fixed_micro = {**AUTO_MICRO, "train_micro_batch_size_per_gpu": MICRO}
    report["other_loader"] = refused(
        lambda: train(ZeroAccelerator(zero_plugin=ZeroPlugin.from_deepspeed(fixed_micro)), 4)
    )
    disagreeing = {**fixed_micro, "gradient_accumulation_steps": 4}
    report["disagreeing"] = refused(lambda: ZeroAccelerator(zero_plugin=ZeroPlugin.from_deepspeed(disagreeing)))
    rank = int(os.environ["RANK"])
    (out / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
