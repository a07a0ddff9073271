"""A small GPT trained with the Lightning Trainer and ZeRO-3 on CPU.

    python examples/lightning_gpt.py [--strategy zero3] [--devices 2] [--precision 32-true]

Lightning's launcher starts the processes. Validation perplexity comes from
torchmetrics; at the end every rank prints its bytes of parameters,
gradients and optimizer state.
"""

from __future__ import annotations

import argparse
import os
import sys

import lightning.pytorch as pl
import torch
import torchmetrics
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import GPT, GPTBlock, GPTConfig, next_token_loss, synthetic_batch  # noqa: E402

import lightning_zero  # noqa: E402, F401  (registers "zero1", "zero2", "zero3")
from lightning_zero import ZeroStrategy  # noqa: E402


class CountingSequences(Dataset):
    def __init__(self, config: GPTConfig, size: int, seed: int):
        self.data = synthetic_batch(config, size, step=seed, rank=0)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.data[index]


class LitGPT(pl.LightningModule):
    def __init__(self, width: int = 128, depth: int = 4, lr: float = 3e-3):
        super().__init__()
        self.save_hyperparameters()
        self.config = GPTConfig(width=width, depth=depth)
        self.perplexity = torchmetrics.text.Perplexity()

    def configure_model(self) -> None:
        # Called under the strategy's sharded context: ZeRO builds it on the
        # meta device and materialises one block at a time.
        if not hasattr(self, "gpt"):
            self.gpt = GPT(self.config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.gpt(ids)

    def training_step(self, ids: torch.Tensor, batch_index: int) -> torch.Tensor:
        loss = next_token_loss(self(ids), ids)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, ids: torch.Tensor, batch_index: int) -> None:
        logits = self(ids)
        self.perplexity(logits[:, :-1].float(), ids[:, 1:])
        self.log("val_perplexity", self.perplexity, sync_dist=True)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.trainer.max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(CountingSequences(self.config, 512, seed=0), batch_size=8, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(CountingSequences(self.config, 64, seed=1), batch_size=16)


class PrintMemory(pl.Callback):
    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        if not isinstance(strategy, ZeroStrategy):
            return
        report = strategy.engine.memory_report()
        for rank in range(trainer.world_size):
            if rank == trainer.global_rank:
                print(
                    f"rank {rank}: stage {strategy.engine.stage}, {strategy.engine.num_parameters:,} parameters: "
                    f"params {report.parameter_bytes / 2**20:.2f} MiB, grads {report.gradient_bytes / 2**20:.2f} MiB, "
                    f"optimizer {report.optimizer_state_bytes / 2**20:.2f} MiB",
                    flush=True,
                )
            strategy.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--strategy", default="zero3")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--max-steps", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // args.devices))
    pl.seed_everything(0)
    strategy = (
        ZeroStrategy(stage=int(args.strategy[-1]), wrap_policy=GPTBlock)
        if args.strategy.startswith("zero")
        else args.strategy
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        precision=args.precision,
        max_steps=args.max_steps,
        val_check_interval=min(20, args.max_steps),  # a shorter run still validates once (its perplexity is printed)
        limit_val_batches=2,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        callbacks=[PrintMemory()],
        enable_progress_bar=False,
    )
    trainer.fit(LitGPT())
    if trainer.global_rank == 0:
        print(
            f"final train_loss {trainer.callback_metrics['train_loss']:.4f}, "
            f"val_perplexity {trainer.callback_metrics['val_perplexity']:.2f}"
        )


if __name__ == "__main__":
    main()
