"""One DeepSpeed config file, trained by DeepSpeed itself and by ``ZeroStrategy(config=file)`` under Lightning's
Trainer: the switch a DeepSpeed user makes. Same model, data, optimizer and loop keys (accumulation, clipping);
rank 0 writes OUT/<case>.json with both runs' per-micro-batch losses and final full weights.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 tests/scripts/deepspeed_same_config.py OUT CASE [CASE ...]

CASE: a stage (1, 2, 3), with bf16 after it for a bf16 config (3bf16), or tbs after it for a config that gives
the global batch (train_batch_size) in place of the accumulation, which DeepSpeed then derives (2tbs). A case in
INF_CASES has an inf loss on rank 1 in one micro-batch, and its report says which steps each engine applied.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.lightning_module import TokenDataset  # noqa: E402
from tests.models import TinyTransformer, lm_loss  # noqa: E402

MICRO_BATCH, ACCUMULATE, STEPS, LR = 2, 2, 4, 1e-2
# Case -> its bf16 section's check_grad_overflow (None: left out, DeepSpeed's default true); rank 1's loss is inf
# in micro-batch POISONED (the first of step 1), so the gradients of step 1 hold inf or NaN there.
INF_CASES = {"1bf16inf": True, "2bf16inf": None, "3bf16inf": False, "2inf": None}
POISONED = 2


def _poison(index: int, poison: int | None) -> float:
    return math.inf if index == poison and torch.distributed.get_rank() == 1 else 1.0


def config(stage: int, bf16: bool) -> dict:
    """What a DeepSpeed user writes."""
    return {
        "bf16": {"enabled": bf16},
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": ACCUMULATE,
        "gradient_clipping": 0.5,
        "zero_optimization": {
            "stage": stage,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 5e8,
            "stage3_param_persistence_threshold": 0,
        },
    }


def model() -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer(blocks=2, batchnorm=False)


def data(rank: int, world_size: int) -> DataLoader:
    dataset = TokenDataset(MICRO_BATCH * ACCUMULATE * STEPS * world_size)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
    return DataLoader(dataset, batch_size=MICRO_BATCH, sampler=sampler)


def deepspeed_run(
    config_file: Path | dict, poison: int | None = None, applied: list[bool] | None = None
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """DeepSpeed's own engine on the config (a file, or a dict), the same model, data and AdamW; ``poison``: the
    micro-batch whose loss is inf on rank 1; ``applied`` gets whether each step was applied."""
    import deepspeed

    net = model()
    optimizer = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=LR)
    ds_model, *_ = deepspeed.initialize(
        model=net, optimizer=optimizer, config=config_file if isinstance(config_file, dict) else str(config_file)
    )
    losses = []
    for index, ids in enumerate(data(torch.distributed.get_rank(), torch.distributed.get_world_size())):
        loss = lm_loss(ds_model(ids), ids)
        ds_model.backward(loss * _poison(index, poison))
        ds_model.step()
        losses.append(loss.item())
        if applied is not None and (index + 1) % ds_model.gradient_accumulation_steps() == 0:
            applied.append(ds_model.was_step_applied())
    with deepspeed.zero.GatheredParameters(list(ds_model.module.parameters())):
        weights = {name: p.detach().clone() for name, p in ds_model.module.named_parameters()}
    return losses, weights


def ours(
    config_file: Path | None,
    precision: str,
    accumulate: int = ACCUMULATE,
    poison: int | None = None,
    applied: list[bool] | None = None,
    **settings: object,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Our Lightning run on the config file, or (``config_file`` None) on the same settings as keywords; one
    pass over the data, ``accumulate`` micro-batches a step (the config's own accumulation); ``poison`` and
    ``applied`` as for ``deepspeed_run``."""
    import lightning.pytorch as pl

    from lightning_zero import ZeroStrategy

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model()
            self.losses: list[float] = []

        def training_step(self, ids: torch.Tensor, index: int) -> torch.Tensor:
            loss = lm_loss(self.net(ids), ids)
            self.losses.append(loss.item())
            return loss * _poison(index, poison)

        def on_train_batch_end(self, outputs: object, ids: torch.Tensor, index: int) -> None:
            if applied is not None and (index + 1) % accumulate == 0:  # after the step
                applied.append(not self.trainer.strategy.engine.last_step_skipped)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW([p for p in self.net.parameters() if p.requires_grad], lr=LR)

        def train_dataloader(self) -> DataLoader:
            return data(self.global_rank, self.trainer.world_size)

    module = Module()
    strategy = ZeroStrategy(config=str(config_file)) if config_file is not None else ZeroStrategy(**settings)
    trainer = pl.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy,
        max_steps=STEPS * ACCUMULATE // accumulate, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, precision=precision,
    )  # fmt: skip
    trainer.fit(module)
    weights = {name.removeprefix("net."): value for name, value in module.state_dict().items()}  # gathered
    return module.losses, weights


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    import deepspeed

    deepspeed.init_distributed("gloo")
    rank = torch.distributed.get_rank()
    for case in sys.argv[2:]:  # "3", "3bf16", "2tbs" or one of INF_CASES
        stage, bf16 = int(case[0]), "bf16" in case
        config_file = out / f"ds_config_{case}.json"
        written = config(stage, bf16)
        poison = POISONED if case in INF_CASES else None
        applied: dict[str, list[bool]] = {"deepspeed": [], "ours": []}
        if bf16 and INF_CASES.get(case) is not None:
            written["bf16"]["check_grad_overflow"] = INF_CASES[case]
        if case.endswith("tbs"):  # micro-batch x accumulation x ranks, the accumulation left out
            del written["gradient_accumulation_steps"]
            written["train_batch_size"] = MICRO_BATCH * ACCUMULATE * torch.distributed.get_world_size()
        if rank == 0:
            config_file.write_text(json.dumps(written))
        torch.distributed.barrier()
        ds_losses, ds_weights = deepspeed_run(config_file, poison, applied["deepspeed"])
        our_losses, our_weights = ours(
            config_file, "bf16-mixed" if bf16 else "32-true", poison=poison, applied=applied["ours"]
        )
        if rank == 0:
            weights = {k: (v.flatten().tolist(), our_weights[k].flatten().tolist()) for k, v in ds_weights.items()}
            report = {"deepspeed": ds_losses, "ours": our_losses, "weights": weights, "applied": applied}
            (out / f"{case}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
