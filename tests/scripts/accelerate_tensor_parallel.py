"""ZeroAccelerator with tensor parallelism on 4 CPU processes (2 data-parallel × 2 tensor-parallel).

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 4 \\
        tests/scripts/accelerate_tensor_parallel.py OUT_DIR

Two cases in the same processes. "ours": ``ZeroPlugin(stage=3, tensor_parallel_size=2)``; the model is split
over ``accelerator.device_mesh["tensor_parallel"]`` before ``prepare``, as under Accelerate's own tensor
parallelism, trains 3 steps, evaluates with ``gather_for_metrics`` and ``reduce``, and saves its state.
"accelerate's": Accelerate's own setting, ``ParallelismConfig(tp_size=2)``, at stage 1, loads that state and
trains 2 steps more. Each rank writes OUT_DIR/rank<r>.pt: losses, the batches it trained on, whole weights,
what the metrics gathered, and the refusals of what does not apply.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from accelerate.parallelism_config import ParallelismConfig  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from accelerate_zero import ZeroAccelerator, ZeroPlugin  # noqa: E402
from tests.tensor_parallel_model import SEQUENCE, VOCAB, TinyLlama, loss_of, parallelize  # noqa: E402

CLIP, LR, BATCH = 0.5, 1e-2, 2
EVALUATED = 6  # samples: 3 per data-parallel rank


def sequences(count: int, seed: int) -> TensorDataset:
    return TensorDataset(torch.randint(0, VOCAB, (count, SEQUENCE), generator=torch.Generator().manual_seed(seed)))


def train(accelerator: ZeroAccelerator, steps: int, resume: Path | None = None) -> dict:
    torch.manual_seed(0)
    model = parallelize(TinyLlama(), accelerator.device_mesh["tensor_parallel"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    loader = DataLoader(sequences(BATCH * 2 * 5, seed=1), batch_size=BATCH)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)  # counts its steps only
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    skip = 0
    if resume is not None:
        accelerator.load_state(str(resume))
        skip = 3
    losses, batches = [], []
    for index, (ids,) in enumerate(loader):
        if index < skip:
            continue
        if index == skip + steps:
            break
        loss = loss_of(model(ids), ids)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        batches.append(ids)
    return {"model": model, "losses": losses, "batches": batches, "scheduler_steps": scheduler.scheduler.last_epoch}


def evaluate(accelerator: ZeroAccelerator, model: torch.nn.Module) -> dict:
    loader = accelerator.prepare_data_loader(DataLoader(sequences(EVALUATED, seed=2), batch_size=1))
    gathered, means = [], []
    with torch.no_grad():
        for (ids,) in loader:
            loss = loss_of(model(ids), ids)
            gathered.append(accelerator.gather_for_metrics(loss.reshape(1)))
            means.append(accelerator.reduce(loss, "mean"))
            largest = accelerator.reduce(loss, "max")
    try:
        accelerator.gather_for_metrics(["an object"])
        objects = None
    except ValueError as error:
        objects = str(error)
    return {
        "gathered": torch.cat(gathered),
        "means": torch.stack(means),
        "last_max": largest,
        "objects_refused": objects,
    }


def refusals() -> dict:
    result = {}
    for name, kwargs in {
        "fsdp_dimension": dict(parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2)),
        "sizes_differ": dict(zero_plugin=ZeroPlugin(stage=3, tensor_parallel_size=4),
                             parallelism_config=ParallelismConfig(tp_size=2)),
    }.items():  # fmt: skip
        try:
            ZeroAccelerator(**kwargs)
            result[name] = None
        except ValueError as error:
            result[name] = str(error)
    return result


def main(out: Path) -> None:
    torch.set_num_threads(1)
    result = {"refusals": refusals()}
    accelerator = ZeroAccelerator(zero_plugin=ZeroPlugin(stage=3, tensor_parallel_size=2, wrap_classes=["Layer"]))
    ours = train(accelerator, steps=3)
    result["ours"] = {key: ours[key] for key in ("losses", "batches", "scheduler_steps")}
    result["ours"]["weights"] = accelerator.get_state_dict(ours["model"])
    result["ours"].update(evaluate(accelerator, ours["model"]))
    accelerator.save_state(str(out / "state"))
    rank = accelerator.process_index
    accelerator.wait_for_everyone()
    AcceleratorState._reset_state()
    GradientState._reset_state()
    accelerator = ZeroAccelerator(
        zero_plugin=ZeroPlugin(stage=1, wrap_classes=["Layer"]), parallelism_config=ParallelismConfig(tp_size=2)
    )
    theirs = train(accelerator, steps=2, resume=out / "state")
    result["accelerates"] = {key: theirs[key] for key in ("losses", "batches")}
    result["accelerates"]["weights"] = accelerator.get_state_dict(theirs["model"])
    result["accelerates"]["stage"] = accelerator.engine.stage
    torch.save(result, out / f"rank{rank}.pt")
    accelerator.end_training()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
