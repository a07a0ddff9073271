"""Fabric with strategy="zero3": train, save (model, optimizer, LR scheduler, a
step count), keep training; then a fresh model refuses a load that asks for a
missing entry (changing nothing), loads the checkpoint and trains the same
steps. Last, a file a one-process run saved (as a DDP run saves one: full model
and optimizer state dicts) is loaded into a fresh sharded model, and both go on.
Then torch's Muon through ``fabric.setup``, beside DDP with Muon. Rank 0 writes OUT/fabric.pt.

    python tests/scripts/fabric_run.py OUT_DIR
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning.fabric import Fabric  # noqa: E402

import lightning_zero  # noqa: E402, F401  (registers the strategies)
from tests.models import TinyTransformer, batch, lm_loss, make_optimizer  # noqa: E402


def train(fabric: Fabric, model, optimizer, scheduler, steps: range) -> list[float]:  # type: ignore[no-untyped-def]
    losses = []
    for step in steps:
        ids = batch(step, fabric.global_rank)
        loss = lm_loss(model(ids), ids)
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return losses


def fresh(fabric: Fabric):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = TinyTransformer(batchnorm=False)
    model, optimizer = fabric.setup(model, make_optimizer("adamw", model))
    return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def one_process(steps: range, model=None, optimizer=None, scheduler=None):  # type: ignore[no-untyped-def]
    """The reference: one process on the global batch (both ranks' batches)."""
    if model is None:
        torch.manual_seed(0)
        model = TinyTransformer(batchnorm=False)
        optimizer = make_optimizer("adamw", model)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    losses = []
    for step in steps:
        ids = torch.cat([batch(step, 0), batch(step, 1)])
        loss = lm_loss(model(ids), ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(loss.item())
    return model, optimizer, scheduler, losses


def muon_against_ddp(fabric: Fabric) -> dict:
    """torch's Muon over the matrices through fabric.setup, beside DDP with Muon in the same processes."""
    torch.manual_seed(0)
    model = TinyTransformer(batchnorm=False)
    reference = copy.deepcopy(model)
    model, optimizer = fabric.setup(model, make_optimizer("muon", model))
    ddp, reference_optimizer = DistributedDataParallel(reference), make_optimizer("muon", reference)
    losses, reference_losses = [], []
    for step in range(3):
        ids = batch(step, fabric.global_rank)
        loss = lm_loss(model(ids), ids)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        reference_loss = lm_loss(ddp(ids), ids)
        reference_loss.backward()
        reference_optimizer.step()
        reference.zero_grad()
        losses.append(loss.item())
        reference_losses.append(reference_loss.item())
    final = fabric.strategy.engine.full_state_dict()
    return {"losses": losses, "reference_losses": reference_losses, "final": final, "ddp": reference.state_dict()}


def main() -> None:
    out = Path(sys.argv[1])
    fabric = Fabric(accelerator="cpu", devices=2, strategy="zero3")
    fabric.launch()
    model, optimizer, scheduler = fresh(fabric)
    first = train(fabric, model, optimizer, scheduler, range(3))
    fabric.save(out / "fabric-ckpt", {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 3})
    continued = train(fabric, model, optimizer, scheduler, range(3, 5))
    uninterrupted = fabric.strategy.engine.full_state_dict()

    model, optimizer, scheduler = fresh(fabric)
    before = fabric.strategy.engine.full_state_dict()
    try:
        fabric.load(out / "fabric-ckpt", {"model": model, "optimizer": optimizer, "epoch": 0})
        refused = "loaded"
    except KeyError as error:
        refused = str(error)
    after = fabric.strategy.engine.full_state_dict()
    refused_changed_nothing = all(torch.equal(before[k], v) for k, v in after.items())
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    remainder = fabric.load(out / "fabric-ckpt", state)
    resumed = train(fabric, model, optimizer, scheduler, range(state["step"], 5))
    result = {
        "first": first,
        "continued": continued,
        "resumed": resumed,
        "step": state["step"],
        "remainder": remainder,
        "uninterrupted": uninterrupted,
        "final": fabric.strategy.engine.full_state_dict(),
        "strategy": type(fabric.strategy).__name__,
        "refused": refused,
        "refused_changed_nothing": refused_changed_nothing,
        "lr": scheduler.get_last_lr(),
    }
    plain, plain_optimizer, plain_scheduler, _ = one_process(range(3))
    file = out / "one-process.ckpt"
    if fabric.global_rank == 0:
        saved = {"model": plain.state_dict(), "optimizer": plain_optimizer.state_dict(), "step": 3}
        torch.save({**saved, "scheduler": plain_scheduler.state_dict()}, file)
    fabric.barrier()
    one_process(range(3, 5), plain, plain_optimizer, plain_scheduler)
    result["one_process_final"] = {k: v.detach().clone() for k, v in plain.state_dict().items()}
    model, optimizer, scheduler = fresh(fabric)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    result["from_file_remainder"] = fabric.load(file, state)
    result["from_file"] = train(fabric, model, optimizer, scheduler, range(state["step"], 5))
    result["from_file_final"] = fabric.strategy.engine.full_state_dict()
    result["muon"] = muon_against_ddp(fabric)
    if fabric.global_rank == 0:
        torch.save(result, out / "fabric.pt")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
