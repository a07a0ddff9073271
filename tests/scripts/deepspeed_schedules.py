"""A DeepSpeed config with an ``optimizer`` and a ``scheduler`` section, trained three ways: by DeepSpeed itself
(which builds both from the config), by ``ZeroStrategy(config=file)`` under Lightning's Trainer (whose
LightningModule returns no optimizer, as under Lightning's DeepSpeed strategy), and by ZeroStrategy with the
same optimizer and schedule built by hand in ``configure_optimizers``. Rank 0 writes OUT/<case>.json with each
run's per-step losses and learning rates.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 tests/scripts/deepspeed_schedules.py OUT
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.lightning_module import TokenDataset  # noqa: E402
from tests.models import TinyTransformer, lm_loss  # noqa: E402
from zero_core.deepspeed.schedulers import OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR  # noqa: E402

MICRO_BATCH, STEPS = 2, 6


def _adamw(net: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)


def _muon_as_deepspeed_splits_it(net: torch.nn.Module) -> torch.optim.Optimizer:
    """DeepSpeed's engine's split, by hand: Muon for the trainable tensors of 2+ dimensions whose names hold
    neither "embed" nor "lm_head", Adam with decoupled decay for the rest, DeepSpeed's defaults beside the
    config's muon_lr and lr."""
    from zero_core import MuonWithAuxAdamW

    named = [(name, p) for name, p in net.named_parameters() if p.requires_grad]
    muon = [p for name, p in named if p.ndim >= 2 and "embed" not in name and "lm_head" not in name]
    rest = [p for name, p in named if all(p is not q for q in muon)]
    return MuonWithAuxAdamW([
        {"params": muon, "use_muon": True, "lr": 2e-2, "momentum": 0.95, "weight_decay": 0.0},
        {"params": rest, "use_muon": False, "lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0},
    ])  # fmt: skip


# case -> (stage, optimizer section, scheduler section, the same built by hand: the model -> (optimizer, schedule))
CASES: dict[str, tuple[int, dict, dict, Callable[[Any], tuple]]] = {
    "fused-adamw-decay": (
        2,
        {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},  # DeepSpeed's FusedAdam
        {"type": "WarmupDecayLR", "params": {"total_num_steps": 6, "warmup_max_lr": 1e-2, "warmup_num_steps": 2}},
        lambda net: (o := _adamw(net), WarmupDecayLR(o, 6, warmup_max_lr=1e-2, warmup_num_steps=2)),
    ),
    "torch-adam-cosine": (
        1,
        {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},  # AdamW, torch's weight decay 0.01
        {"type": "WarmupCosineLR", "params": {"total_num_steps": 6, "warmup_num_steps": 2, "warmup_type": "linear"}},
        lambda net: (o := _adamw(net), WarmupCosineLR(o, 6, warmup_num_steps=2, warmup_type="linear")),
    ),
    "onecycle-stage3": (
        3,
        {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        {"type": "OneCycle", "params": {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_first_step_size": 2,
                                        "decay_step_size": 1, "decay_lr_rate": 0.5}},
        lambda net: (o := _adamw(net), OneCycle(o, 1e-3, 1e-2, 0.5, cycle_first_step_size=2, decay_step_size=1)),
    ),
    # DeepSpeed's Muon (ZeRO 2): the standard Newton-Schulz, as torch's; unclipped (DeepSpeed would clip the
    # orthogonalised update, which a number here is refused for).
    "muon-stage2": (
        2,
        {"type": "Muon", "params": {"lr": 3e-3, "muon_lr": 2e-2, "ns_method": "standard"}},
        {"type": "WarmupLR", "params": {"warmup_num_steps": 2, "warmup_max_lr": 2e-2, "warmup_type": "linear"}},
        lambda net: (o := _muon_as_deepspeed_splits_it(net), WarmupLR(o, warmup_max_lr=2e-2, warmup_num_steps=2,
                                                                     warmup_type="linear")),
    ),
}  # fmt: skip


def config(case: str) -> dict:
    stage, optimizer, scheduler, _ = CASES[case]
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0 if case.startswith("muon") else 0.5,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": optimizer,
        "scheduler": scheduler,
    }


def model() -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer(blocks=2, batchnorm=False)


def data(rank: int, world_size: int) -> DataLoader:
    dataset = TokenDataset(MICRO_BATCH * STEPS * world_size)
    return DataLoader(dataset, batch_size=MICRO_BATCH, sampler=DistributedSampler(dataset, world_size, rank, False))


def deepspeed_run(config_file: Path) -> tuple[list[float], list[float]]:
    import deepspeed

    net = model()
    trainable = [p for p in net.parameters() if p.requires_grad]
    ds_model, *_ = deepspeed.initialize(model=net, model_parameters=trainable, config=str(config_file))
    losses, lrs = [], []
    for ids in data(torch.distributed.get_rank(), torch.distributed.get_world_size()):
        lrs.append(ds_model.get_lr()[0])
        loss = lm_loss(ds_model(ids), ids)
        ds_model.backward(loss)
        ds_model.step()
        losses.append(loss.item())
    return losses, lrs


def ours(config_file: Path, by_hand: Callable[[Any], tuple] | None) -> tuple[list[float], list[float]]:
    """ZeroStrategy(config=file); ``by_hand``: configure_optimizers returns that optimizer and schedule (and the
    config's sections are dropped), else it returns None and the config's are built."""
    import lightning.pytorch as pl

    from lightning_zero import ZeroStrategy

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model()
            self.losses: list[float] = []
            self.lrs: list[float] = []

        def training_step(self, ids: torch.Tensor, index: int) -> torch.Tensor:
            self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
            loss = lm_loss(self.net(ids), ids)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> Any:
            if by_hand is None:
                return None  # the config's, as under Lightning's DeepSpeed strategy
            optimizer, scheduler = by_hand(self.net)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

        def train_dataloader(self) -> DataLoader:
            return data(self.global_rank, self.trainer.world_size)

    settings = json.loads(config_file.read_text())
    if by_hand is not None:
        del settings["optimizer"], settings["scheduler"]
    module = Module()
    trainer = pl.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=ZeroStrategy(config=settings),
        max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(module)
    return module.losses, module.lrs


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    import deepspeed

    deepspeed.init_distributed("gloo")
    rank = torch.distributed.get_rank()
    for case in CASES:
        config_file = out / f"ds_config_{case}.json"
        if rank == 0:
            config_file.write_text(json.dumps(config(case)))
        torch.distributed.barrier()
        ds_losses, ds_lrs = deepspeed_run(config_file)
        config_losses, config_lrs = ours(config_file, None)
        hand_losses, hand_lrs = ours(config_file, CASES[case][3])
        if rank == 0:
            report = {
                "deepspeed_losses": ds_losses, "deepspeed_lrs": ds_lrs, "config_losses": config_losses,
                "config_lrs": config_lrs, "hand_losses": hand_losses, "hand_lrs": hand_lrs,
            }  # fmt: skip
            (out / f"{case}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
