"""Sharded checkpoints: save at one world size and stage, resume at another.

The data is one fixed global batch per step, split evenly over the ranks,
so training does not depend on the world size beyond rounding. Checked:
loading is bitwise exact (a checkpoint re-saved right after loading holds
the same full parameters and optimizer state), resuming at the same world
size continues bitwise like an uninterrupted run, and at another world size
or stage within fp32 rounding. Hybrid sharding (shard groups of 2 at 4
ranks) saves checkpoints that load flat at 2 or 3 ranks, and back.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.checkpoint_files import assert_same_checkpoint
from tests.models import SEQ, VOCAB, TinyTransformer, lm_loss, make_optimizer
from tests.rank_pool import run_distributed
from tests.workers import config_for, relative_difference
from zero_core import ZeroEngine

GLOBAL_BATCH = 12  # divisible by world sizes 1, 2, 3, 4
TOTAL_STEPS, SAVE_AT = 5, 2


def global_batch(step: int, rank: int, world_size: int) -> torch.Tensor:
    everything = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(step))
    share = GLOBAL_BATCH // world_size
    return everything[rank * share : (rank + 1) * share]


# A stage, and the shard group size of hybrid sharding (None: flat, every rank shards).
Setup = tuple[int, "int | None"]


def _name(world_size: int, setup: Setup) -> str:
    stage, group = setup
    return f"{world_size}-{stage}" + (f"-hybrid{group}" if group else "")


def _engine(setup: Setup) -> tuple[TinyTransformer, ZeroEngine]:
    stage, group = setup
    torch.manual_seed(0)
    model = TinyTransformer().eval()  # BatchNorm on running statistics: independent of the split
    return model, ZeroEngine(model, make_optimizer("adamw", model), config_for(stage, shard_group_size=group))


def _train(model: TinyTransformer, engine: ZeroEngine, steps: range) -> list[float]:
    rank, world_size = engine.rank, engine.world_size
    losses = []
    for step in steps:
        ids = global_batch(step, rank, world_size)
        loss = lm_loss(model(ids), ids)
        engine.backward(loss)
        engine.clip_grad_norm_(1.0)
        engine.step()
        mean = loss.detach().clone()  # the global batch's loss, whatever the split
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / world_size)
    return losses


def _save_job(rank: int, world_size: int, setups: list[Setup], directory: str) -> dict[Setup, dict]:
    """For each setup: train, save, keep training (the uninterrupted reference)."""
    results = {}
    for setup in setups:
        model, engine = _engine(setup)
        _train(model, engine, range(SAVE_AT))
        engine.save_checkpoint(
            Path(directory) / f"saved-{_name(world_size, setup)}", extra={"note": "hello", "step": SAVE_AT}
        )
        losses = _train(model, engine, range(SAVE_AT, TOTAL_STEPS))
        results[setup] = {"losses": losses, "final": engine.full_state_dict()}
        engine.unshard()
    return results


def _resume_job(rank: int, world_size: int, cases: list[tuple[int, Setup, Setup]], directory: str) -> dict[tuple, dict]:
    """For each (saved world size, saved setup, setup): load, re-save, train on."""
    results = {}
    for save_world, save_setup, setup in cases:
        model, engine = _engine(setup)
        saved = _name(save_world, save_setup)
        extra = engine.load_checkpoint(Path(directory) / f"saved-{saved}")
        engine.save_checkpoint(Path(directory) / f"reloaded-{saved}-to-{_name(world_size, setup)}")
        losses = _train(model, engine, range(SAVE_AT, TOTAL_STEPS))
        results[(save_world, save_setup, setup)] = {
            "losses": losses,
            "final": engine.full_state_dict(),
            "extra": extra,
            "steps": engine.steps_taken,
        }
        engine.unshard()
    return results


FLAT = [(4, 3, 4, 3), (4, 3, 2, 3), (4, 2, 3, 2), (4, 1, 1, 1), (2, 3, 2, 1), (2, 1, 2, 3), (2, 2, 3, 3)]
CASES = [(sw, (ss, None), lw, (ls, None)) for sw, ss, lw, ls in FLAT]
# Hybrid sharding (2 groups of 2) to flat at 2 and 3 ranks, flat back to hybrid, hybrid to hybrid.
CASES += [(4, (3, 2), 2, (3, None)), (4, (2, 2), 3, (1, None)), (2, (3, None), 4, (2, 2)), (4, (3, 2), 4, (1, 2))]


def _save_and_resume_job(
    rank: int, world_size: int, setups: list[Setup], cases: list[tuple[int, Setup, Setup]], directory: str
) -> tuple[dict[Setup, dict], dict[tuple, dict]]:
    """This world size's saves, then the resumes whose checkpoints exist by then."""
    return _save_job(rank, world_size, setups, directory), _resume_job(rank, world_size, cases, directory)


@pytest.fixture(scope="module")
def roundtrips(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, dict]:
    """One spawn per world size (those that save first, smallest first): its saves, then the
    resumes of checkpoints saved so far. Resumes of a checkpoint that a larger world size saved
    after them take one more spawn."""
    directory = tmp_path_factory.mktemp("roundtrip")
    saved: dict[int, dict] = {}
    resumed: dict[int, dict] = {}
    later: list[tuple[int, Setup, int, Setup]] = []
    saving = sorted({c[0] for c in CASES})
    for world in saving + sorted({c[2] for c in CASES} - set(saving)):
        setups = sorted({c[1] for c in CASES if c[0] == world}, key=str)
        now = [c for c in CASES if c[2] == world and (c[0] in saved or c[0] == world)]
        later += [c for c in CASES if c[2] == world and c not in now]
        cases = [(c[0], c[1], c[3]) for c in now]
        saved[world], resumed[world] = run_distributed(_save_and_resume_job, world, setups, cases, str(directory))[0]
    for world in sorted({c[2] for c in later}):
        cases = [(c[0], c[1], c[3]) for c in later if c[2] == world]
        resumed[world].update(run_distributed(_resume_job, world, cases, str(directory))[0])
    return directory, saved, resumed


@pytest.mark.parametrize(
    "save_world, save_setup, load_world, load_setup",
    CASES,
    ids=[f"{_name(sw, ss)}-to-{_name(lw, ls)}" for sw, ss, lw, ls in CASES],
)
def test_resume_at_any_world_size_and_stage(
    roundtrips: tuple, save_world: int, save_setup: Setup, load_world: int, load_setup: Setup
) -> None:
    directory, saved, resumed = roundtrips
    saved_name = _name(save_world, save_setup)
    reloaded = directory / f"reloaded-{saved_name}-to-{_name(load_world, load_setup)}"
    assert_same_checkpoint(directory / f"saved-{saved_name}", reloaded)

    reference = saved[save_world][save_setup]
    ours = resumed[load_world][(save_world, save_setup, load_setup)]
    assert ours["extra"] == {"note": "hello", "step": SAVE_AT}
    assert ours["steps"] == TOTAL_STEPS
    if (save_world, save_setup[1]) == (load_world, load_setup[1]):  # the same reductions, in the same order
        assert ours["losses"] == reference["losses"]
        tolerance = 0.0
    else:
        assert ours["losses"] == pytest.approx(reference["losses"], rel=1e-5)
        tolerance = 1e-5
    assert relative_difference(ours["final"], reference["final"]) <= tolerance


def _save_when_dcp_returns_no_storage_map_job(rank: int, world_size: int, directory: str) -> tuple[list, list]:
    """Saving where the metadata DCP's save returns has no storage map (``storage_data`` None on every rank,
    as torch 2.11 returns it): the checkpoint still covers every file its .metadata names, and resumes."""
    import dataclasses

    from zero_core.checkpoint import saving

    original = saving.write_shards

    def as_torch_2_11(target, state, comm, *options):  # type: ignore[no-untyped-def]
        return dataclasses.replace(original(target, state, comm, *options), storage_data=None)

    model, engine = _engine((3, None))
    _train(model, engine, range(2))
    saving.write_shards = as_torch_2_11
    try:
        engine.save_checkpoint(f"{directory}/ckpt")
    finally:
        saving.write_shards = original
    uninterrupted = _train(model, engine, range(2, 4))
    model, engine = _engine((2, None))
    engine.load_checkpoint(f"{directory}/ckpt")
    return uninterrupted, _train(model, engine, range(2, 4))


def test_save_lists_every_file_whatever_dcp_returns(tmp_path: Path) -> None:
    for uninterrupted, resumed in run_distributed(_save_when_dcp_returns_no_storage_map_job, 2, str(tmp_path)):
        assert resumed == pytest.approx(uninterrupted, rel=1e-5)
