"""The LightningModules the Lightning tests train (their data: tests.models.TokenDataset)."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from .models import TinyTransformer, TokenDataset, lm_loss, make_optimizer, param_groups, uses_branch


class TinyLM(pl.LightningModule):
    def __init__(self, batchnorm: bool = True, lr: float = 1e-2, batch_size: int = 4, dataset_size: int = 96):
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = TinyTransformer(batchnorm=batchnorm)
        self.losses: list[float] = []

    def forward(self, ids: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        return self.net(ids, use_branch=use_branch)

    def training_step(self, ids: torch.Tensor, batch_index: int) -> torch.Tensor:
        loss = lm_loss(self(ids, use_branch=uses_branch(self.global_step)), ids)
        self.losses.append(loss.item())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, ids: torch.Tensor, batch_index: int) -> None:
        self.log("val_loss", lm_loss(self(ids), ids), sync_dist=True)

    def test_step(self, ids: torch.Tensor, batch_index: int) -> None:
        self.log("test_loss", lm_loss(self(ids), ids), sync_dist=True)

    def predict_step(self, ids: torch.Tensor, batch_index: int) -> torch.Tensor:
        return self(ids).argmax(-1)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        optimizer = torch.optim.AdamW(param_groups(self.net, self.hparams.lr), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TokenDataset(self.hparams.dataset_size), batch_size=self.hparams.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TokenDataset(16, seed=1), batch_size=4)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        return self.val_dataloader()


class WholeTensorTinyLM(TinyLM):
    """The same model trained with an optimizer that steps whole tensors, by its name in
    ``tests.models.make_optimizer``: torch's Muon over the matrices (the biases and norms left as they start),
    ``MuonWithAuxAdamW`` (AdamW for the rest), torch's Adafactor."""

    def __init__(self, optimizer_name: str = "muon", **kwargs):  # type: ignore[no-untyped-def]
        super().__init__(**kwargs)
        self.optimizer_name = optimizer_name

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return make_optimizer(self.optimizer_name, self.net, lr=self.hparams.lr)


class ManualTinyLM(TinyLM):
    """The same model with manual optimization: backward, clipping and step by hand."""

    def __init__(self, **kwargs):  # type: ignore[no-untyped-def]
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, ids: torch.Tensor, batch_index: int) -> None:
        optimizer = self.optimizers()
        loss = lm_loss(self(ids, use_branch=uses_branch(self.global_step)), ids)
        self.losses.append(loss.item())
        optimizer.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        optimizer.step()


class TwoStepsTinyLM(TinyLM):
    """Manual optimization stepping twice per batch, on each half of it (Lightning's truncated backprop
    pattern): the second half's forward runs inside the same training step, after the first step."""

    def __init__(self, **kwargs):  # type: ignore[no-untyped-def]
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, ids: torch.Tensor, batch_index: int) -> None:
        optimizer = self.optimizers()
        for half in ids.chunk(2):
            loss = lm_loss(self(half), half)
            self.losses.append(loss.item())
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()


class SkipOnNanTinyLM(TinyLM):
    """Manual optimization with the loop users write to survive a bad batch: clip, step only on a finite
    norm, zero the gradients every batch. Rank 0's loss is NaN at batch 1 (every rank's averaged gradients
    are then NaN), and batch 3 is skipped although finite: neither may leak into the steps after."""

    def __init__(self, **kwargs):  # type: ignore[no-untyped-def]
        super().__init__(**kwargs)
        self.automatic_optimization = False
        self.norms: list[float] = []

    def training_step(self, ids: torch.Tensor, batch_index: int) -> None:
        optimizer = self.optimizers()
        poison = float("nan") if batch_index == 1 and self.global_rank == 0 else 1.0
        loss = lm_loss(self(ids), ids) * poison
        self.losses.append(loss.item())
        self.manual_backward(loss)
        engine = getattr(self.trainer.strategy, "engine", None)
        if engine is not None:
            norm = engine.clip_grad_norm_(1.0)
        else:
            norm = torch.nn.utils.clip_grad_norm_(self.parameters(), 1.0)
        self.norms.append(norm.item())
        if math.isfinite(norm.item()) and batch_index != 3:
            optimizer.step()
        optimizer.zero_grad()


class BackboneTinyLM(TinyLM):
    """For Lightning's BackboneFinetuning: the first block is the backbone (frozen by the
    callback before the optimizer is made, which leaves it out); the optimizer keeps the
    scheduler and the two groups' hyperparameters of TinyLM."""

    @property
    def backbone(self) -> torch.nn.Module:
        return self.net.blocks[0]

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        groups = [
            dict(group, params=[p for p in group["params"] if p.requires_grad])
            for group in param_groups(self.net, self.hparams.lr)
        ]
        optimizer = torch.optim.AdamW(groups, lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
