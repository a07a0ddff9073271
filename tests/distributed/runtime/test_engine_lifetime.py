"""An engine lives as long as its user or its model needs it: a model still in use keeps its engine (and
``engine_of(model)`` finds it), and dropping both frees both, with what they hold (the optimizer state, an
NVMe tier's scratch files), instead of keeping them until the process exits. A deep copy of the model is an
ordinary module, not a second copy of the engine."""

from __future__ import annotations

import copy
import dataclasses
import gc
import os
import weakref
from pathlib import Path

import torch

import zero_core
from tests.models import TinyTransformer, make_optimizer
from tests.rank_pool import run_distributed
from tests.workers import config_for, train_accumulated


def _runtimes() -> int:
    return sum(1 for obj in gc.get_objects() if type(obj).__name__ == "StepRuntime")


def _deep_copy_is_ordinary(engine: zero_core.ZeroEngine) -> bool:
    """A deep copy of the model (an EMA copy, a teacher) holds the full values and trains on its own: the
    engine's hooks are inert in it, and no copy of the engine's runtime (its units, their buffers) is made."""
    runtimes = _runtimes()
    copied = copy.deepcopy(engine.model)
    ids = torch.randint(0, 37, (2, 6))
    copied(ids).sum().backward()
    return (
        _runtimes() == runtimes
        and all(p.grad is not None for p in copied.parameters() if p.requires_grad)
        and all(torch.equal(copied.state_dict()[k], v) for k, v in engine.full_state_dict().items())
    )


def _lifetimes(rank: int, world_size: int, directory: str) -> dict:
    results = {}
    for stage in (1, 3):
        model = TinyTransformer(batchnorm=False)
        config = dataclasses.replace(config_for(stage), offload_optimizer="nvme", offload_dir=directory)
        engine = zero_core.ZeroEngine(model, make_optimizer("adamw", model), config)
        train_accumulated(engine, rank, range(1))
        copy_is_ordinary = stage == 3 or _deep_copy_is_ordinary(engine)  # stage 3: refused, values not held
        alive = weakref.ref(engine)
        del engine
        gc.collect()
        kept = alive() is not None and zero_core.engine_of(model) is alive()
        train_accumulated(alive(), rank, range(1, 2))  # the model's engine still trains it
        del model
        gc.collect()
        results[stage] = {
            "deep copy is ordinary": copy_is_ordinary,
            "kept by its model": kept,
            "freed with it": alive() is None,
            "scratch left": sorted(str(p) for p in Path(directory).glob(f"*/rank{rank}/unit*.bin")),
        }
    return results


def test_a_dropped_engine_and_model_are_freed_with_their_scratch_files(tmp_path: Path) -> None:
    for results in run_distributed(_lifetimes, 2, str(tmp_path)):
        for stage, result in results.items():
            assert result["kept by its model"] and result["freed with it"], stage
            assert result["deep copy is ordinary"], stage
            assert result["scratch left"] == [], stage
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and p.name != "owner"], os.listdir(tmp_path)
