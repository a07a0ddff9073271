"""``Fabric(strategy=ZeroFabricStrategy(stage=..., tensor_parallel_size=2, parallelize_fn=...))`` on 4 CPU processes.

    python tests/scripts/fabric_tensor_parallel.py OUT_DIR

Launched as a plain script: Fabric's own launcher starts the other processes (the tests run it after the
Trainer's runs of lightning_tensor_parallel.py, in the processes Lightning's launcher started). ``fabric.setup_module``
splits a tiny Llama-style model with ``parallelize_fn`` over the strategy's ``device_mesh["tensor_parallel"]``
and shards it across the data-parallel ranks; the optimizer is made over the split parameters afterwards.
Each rank writes OUT_DIR/rank<r>.pt: its losses, the batches it trained on and the final whole weights;
and what ``fabric.setup(model, optimizer)`` (an optimizer made before the split) was told.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning.fabric import Fabric  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh  # noqa: E402

from lightning_zero import ZeroFabricStrategy  # noqa: E402
from tests.tensor_parallel_model import Layer, TinyLlama, loss_of, parallelize, tokens  # noqa: E402

STEPS, CLIP, LR = 3, 0.5, 1e-2


def split(model: TinyLlama, mesh: DeviceMesh) -> TinyLlama:
    """Fabric's parallelize_fn takes the whole mesh, as under its ModelParallelStrategy."""
    return parallelize(model, mesh["tensor_parallel"])


def fabric_for(stage: int) -> Fabric:
    strategy = ZeroFabricStrategy(stage=stage, tensor_parallel_size=2, wrap_policy=Layer, parallelize_fn=split)
    return Fabric(accelerator="cpu", devices=4, strategy=strategy)


def main(out: Path) -> None:
    fabric = fabric_for(3)
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(TinyLlama())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    dp_rank = fabric.strategy.device_mesh["data_parallel"].get_local_rank()
    losses, batches = [], []
    for step in range(STEPS):
        ids = tokens(step, dp_rank)
        loss = loss_of(model(ids), ids)
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        batches.append(ids)
    result = {"losses": losses, "batches": batches, "weights": fabric.strategy.engine.full_state_dict()}
    torch.manual_seed(0)
    early = TinyLlama()
    try:
        fabric.setup(early, torch.optim.AdamW(early.parameters(), lr=LR))
    except ValueError as error:
        result["optimizer_first"] = str(error)
    torch.save(result, out / f"rank{fabric.global_rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
