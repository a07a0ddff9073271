"""The wild corpus' plain DeepSpeed JSONs (numbers, no "auto": written for a script with DeepSpeed's own engine),
each given unedited to ``ZeroStrategy(config=file)`` under Lightning's Trainer, beside the same settings written as
keyword arguments (``ZeroStrategy(stage=...)`` and the Trainer's own accumulation, clipping and precision), and,
where DeepSpeed's engine runs the file on this CPU, DeepSpeed itself.
Rank 0 writes OUT/<file stem>.json with both runs' per-micro-batch losses, final full weights, and the
accumulation and clipping each Trainer trained with.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 tests/scripts/wild_corpus_lightning.py OUT CONFIG [CONFIG ...]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.models import TinyTransformer, TokenDataset, lm_loss  # noqa: E402

STEPS, LR = 3, 1e-2
# Per file: the DataLoader's micro-batch (the file's train_micro_batch_size_per_gpu, as a user of the file sets
# it), the Trainer's precision flag, and the file written our way: strategy keywords, the Trainer's accumulation
# and clipping, and the optimizer configure_optimizers returns where the file has an "optimizer" section.
CASES = {
    # bigscience Megatron-DeepSpeed's test config: micro-batch 1, train_batch_size 16, so DeepSpeed accumulates
    # 16 / (1 x 2 ranks) = 8 micro-batches a step; clipping at 1.0; fp16 with loss scaling from 2**12.
    "megatron_deepspeed_tests_ds_config": dict(
        micro_batch=1,
        # fp16 is not honoured on this CPU (Lightning turns Trainer(precision="16-mixed") into bf16-mixed on a
        # CPU): the run passes precision "32-true" and the file's fp16 section is switched off, as a user without
        # a GPU would. That override is the only one.
        precision="32-true",
        override={"fp16": {"enabled": False}},
        native=dict(stage=1),
        accumulate=8,
        clip=1.0,
        deepspeed=True,  # DeepSpeed's engine runs this one on this CPU (stage 1, fp32): a second reference
    ),
    # DeepSpeedExamples' bf16 baseline: ZeRO-3, bf16, an AdamW section, persistence threshold 0, micro-batch 4.
    "deepspeed_examples_bf16_master_weight_baseline": dict(
        micro_batch=4,
        precision="bf16-mixed",
        override={},
        native=dict(stage=3, persistence_threshold=0),
        accumulate=1,
        clip=None,
        optimizer=dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01),
    ),
}


def model() -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer(blocks=2, batchnorm=False)


def run(config: dict | None, case: dict) -> dict:
    """One fit: ``ZeroStrategy(config=config)`` (the Trainer left at its defaults), or with ``config`` None the
    case's settings as keywords and Trainer arguments."""
    import lightning.pytorch as pl

    from lightning_zero import ZeroStrategy

    by_hand = config is None
    micro_batch, accumulate = case["micro_batch"], case["accumulate"]

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model()
            self.losses: list[float] = []

        def training_step(self, ids: torch.Tensor, index: int) -> torch.Tensor:
            loss = lm_loss(self.net(ids), ids)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer | None:
            parameters = [p for p in self.net.parameters() if p.requires_grad]
            if "optimizer" not in case:
                return torch.optim.AdamW(parameters, lr=LR)
            # The file's "optimizer" section is built by the strategy where this returns None, as DeepSpeed's
            # engine builds it; by hand, the same AdamW.
            return torch.optim.AdamW(parameters, **case["optimizer"]) if by_hand else None

        def train_dataloader(self) -> DataLoader:
            world = self.trainer.world_size
            dataset = TokenDataset(micro_batch * accumulate * STEPS * world)
            sampler = DistributedSampler(dataset, num_replicas=world, rank=self.global_rank, shuffle=False)
            return DataLoader(dataset, batch_size=micro_batch, sampler=sampler)

    module = Module()
    loop = dict(accumulate_grad_batches=accumulate, gradient_clip_val=case["clip"]) if by_hand else {}
    trainer = pl.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]),
        strategy=ZeroStrategy(**case["native"]) if by_hand else ZeroStrategy(config=config),
        max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, precision=case["precision"], **loop,
    )  # fmt: skip
    trainer.fit(module)
    state = module.state_dict()  # gathered
    weights = {name.removeprefix("net."): value.float().flatten().tolist() for name, value in state.items()}
    return {
        "losses": module.losses,
        "weights": weights,
        "accumulate": trainer.accumulate_grad_batches,
        "clip": trainer.gradient_clip_val,
        "optimizer": type(trainer.optimizers[0]).__name__,
    }


def deepspeed_run(config: dict, case: dict) -> dict:
    """DeepSpeed's own engine on the (overridden) file, the same model, data and AdamW; it derives the accumulation
    from train_batch_size itself."""
    import deepspeed

    net = model()
    optimizer = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=LR)
    ds_model, *_ = deepspeed.initialize(model=net, optimizer=optimizer, config=config)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    dataset = TokenDataset(case["micro_batch"] * case["accumulate"] * STEPS * world)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False)
    losses = []
    for ids in DataLoader(dataset, batch_size=case["micro_batch"], sampler=sampler):
        loss = lm_loss(ds_model(ids), ids)
        ds_model.backward(loss)
        ds_model.step()
        losses.append(loss.item())
    state = ds_model.module.state_dict()  # stage 1: every rank holds the full weights
    weights = {name: p.detach().float().flatten().tolist() for name, p in state.items()}
    return {"losses": losses, "weights": weights, "accumulate": ds_model.gradient_accumulation_steps()}


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    import deepspeed

    deepspeed.init_distributed("gloo")
    for path in map(Path, sys.argv[2:]):
        case = CASES[path.stem]
        config: dict | str = str(path)  # the file itself
        if case["override"]:  # only the key this CPU cannot honour, the rest of its section kept
            config = json.loads(path.read_text())
            for section, values in case["override"].items():
                config[section] = {**config[section], **values}
        report = {"file": run(config, case), "hand": run(None, case)}
        if case.get("deepspeed"):
            report["deepspeed"] = deepspeed_run(config, case)
        if torch.distributed.get_rank() == 0:
            (out / f"{path.stem}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
