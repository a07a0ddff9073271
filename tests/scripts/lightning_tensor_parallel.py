"""``Trainer(strategy=ZeroStrategy(stage=..., tensor_parallel_size=2))`` on 4 CPU processes.

    python tests/scripts/lightning_tensor_parallel.py OUT_DIR STAGE [FABRIC_OUT_DIR]

Launched as a plain script: Lightning's own launcher starts the other processes. ``configure_model``
splits a tiny Llama-style model over ``self.device_mesh["tensor_parallel"]``; the strategy shards it
across the data-parallel ranks. After STEPS steps the Trainer saves a checkpoint, and a second Trainer
at another stage resumes from it for one more step. Each rank writes OUT_DIR/rank<r>.pt: its losses and
the batches it trained on, and the whole weights, of both runs. With FABRIC_OUT_DIR, fabric_tensor_parallel.py's
run follows in the same processes (``Fabric.launch()`` finds them started, as under torchrun) and writes there:
a launch of 4 processes importing Lightning costs far more than the runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning.pytorch as pl  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from lightning_zero import ZeroStrategy  # noqa: E402
from tests.tensor_parallel_model import SEQUENCE, VOCAB, Layer, TinyLlama, loss_of, parallelize  # noqa: E402

STEPS, BATCH, CLIP, LR = 3, 2, 0.5, 1e-2


class SplitLlama(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model: TinyLlama | None = None
        self.losses: list[float] = []
        self.batches: list[torch.Tensor] = []

    def configure_model(self) -> None:
        if self.model is not None:
            return
        torch.manual_seed(0)
        self.model = parallelize(TinyLlama(), self.device_mesh["tensor_parallel"])

    def training_step(self, batch: list[torch.Tensor], batch_index: int) -> torch.Tensor:
        (ids,) = batch
        self.batches.append(ids.clone())
        loss = loss_of(self.model(ids), ids)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LR)


def samples() -> torch.Tensor:
    return torch.randint(0, VOCAB, (4 * STEPS * BATCH, SEQUENCE), generator=torch.Generator().manual_seed(7))


def trainer(stage: int, max_steps: int) -> pl.Trainer:
    strategy = ZeroStrategy(stage=stage, tensor_parallel_size=2, wrap_policy=Layer)
    quiet = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    return pl.Trainer(
        accelerator="cpu", devices=4, strategy=strategy, max_steps=max_steps, gradient_clip_val=CLIP, **quiet
    )


def main(out: Path, stage: int) -> None:
    loader = DataLoader(TensorDataset(samples()), batch_size=BATCH, shuffle=False)
    module = SplitLlama()
    fit = trainer(stage, max_steps=STEPS)
    fit.fit(module, loader)
    checkpoint = out / "split.ckpt"
    fit.save_checkpoint(checkpoint)
    result = {
        "losses": module.losses,
        "batches": module.batches,
        "split": [name for name, p in module.named_parameters() if isinstance(p, DTensor)],
        "weights": fit.strategy.engine.full_state_dict(),
    }
    resumed = SplitLlama()  # at another stage, one step more
    again = trainer(1 if stage != 1 else 3, max_steps=STEPS + 1)
    again.fit(resumed, loader, ckpt_path=checkpoint)
    result.update(
        resumed_losses=resumed.losses, resumed_batches=resumed.batches, resumed=again.strategy.engine.full_state_dict()
    )
    torch.save(result, out / f"rank{fit.global_rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
    if len(sys.argv) > 3:
        from tests.scripts import fabric_tensor_parallel

        fabric_tensor_parallel.main(Path(sys.argv[3]))
