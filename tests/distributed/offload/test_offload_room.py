"""offload_dir's room, as a user meets it: the figures of a refusal never round to zero, setup says what a
checkpoint load will stage beside the NVMe tier's state, and a load that would not fit is refused before it
reads anything, with the numbers, alike on every rank, changing nothing (its ranks counted together where they
share a disk)."""

from __future__ import annotations

import dataclasses
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import zero_core.offload.nvme_load as nvme_load
from tests.models import TinyTransformer, make_optimizer
from tests.rank_pool import run_distributed
from tests.workers import config_for, relative_difference, train_accumulated
from zero_core import ZeroEngine, setup_summary
from zero_core.checkpoint import CheckpointError
from zero_core.sizes import human_bytes

MIB = 2**20
WIDE = 192  # a few MiB of offloaded state per rank, as in the report of a 1 MiB offload_dir


def _engine(directory: str, width: int = 16) -> ZeroEngine:
    """Stage 3, fp32 on the CPU: the masters stay in memory, so a load stages them in files of their own too."""
    torch.manual_seed(0)
    model = TinyTransformer(width=width, batchnorm=False)
    config = dataclasses.replace(config_for(3), offload_optimizer="nvme", offload_dir=directory)
    return ZeroEngine(model, make_optimizer("adamw-fused", model), config)


def _offloaded_elements(engine: ZeroEngine) -> int:
    return sum(report.shard_numel for report in engine.unit_reports() if report.offloaded)


def _free(free: int, staged: list[Path] | None = None):  # type: ignore[no-untyped-def]
    """shutil.disk_usage with ``free`` bytes free (a small disk: no tmpfs of that size here); ``staged``: the
    directories whose staged files take from it (the ranks that share the disk)."""
    original = shutil.disk_usage

    def usage(path):  # type: ignore[no-untyped-def]
        used = sum(p.stat().st_size for directory in staged or [] for p in directory.glob("*.loaded"))
        return original(path)._replace(free=free - used)

    return usage


def _setup_room(rank: int, world_size: int, directory: str) -> dict:
    results: dict = {}
    engine = _engine(directory, WIDE)
    elements = _offloaded_elements(engine)
    results["state"], results["load"] = 8 * elements, 12 * elements  # two fp32 moments; and the fp32 master
    results["summary"] = setup_summary(engine)
    del engine
    original = shutil.disk_usage
    try:
        if rank == 1:  # a 1 MiB offload_dir: too small for ~3.9 MB of state
            shutil.disk_usage = _free(MIB)
        try:
            _engine(directory, WIDE)
            results["too small"] = "built"
        except ValueError as error:
            results["too small"] = str(error)
        shutil.disk_usage = original
        if rank == 1:  # room for the state, not for a load beside it
            shutil.disk_usage = _free(results["state"] + results["load"] // 2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _engine(directory, WIDE)
        results["warned"] = [str(w.message) for w in caught if "offload_dir" in str(w.message)]
    finally:
        shutil.disk_usage = original
    return results


def test_setup_says_what_a_load_needs_and_a_small_offload_dir_is_refused_in_readable_units(tmp_path: Path) -> None:
    first, second = run_distributed(_setup_room, 2, str(tmp_path))
    state, load = first["state"], first["load"]
    assert 3 * MIB < state < 5 * MIB, first  # the case: a 1 MiB directory, ~3.9 MB of state
    assert f"; a checkpoint load stages up to {human_bytes(load)} more there)" in first["summary"], first["summary"]
    assert first["too small"] == second["too small"], (first, second)
    assert (
        f"rank 1: {tmp_path} has 1.00 MiB free; this rank's offloaded state needs {human_bytes(state)} "
        f"(and a checkpoint load stages up to {human_bytes(load)} more beside it)." in first["too small"]
    ), first["too small"]
    assert "rank 0" not in first["too small"] and "0.00" not in first["too small"], first["too small"]
    assert first["warned"] == [], first["warned"]  # rank 0's disk has room for both
    assert second["warned"] == [
        f"offload_dir {tmp_path} on rank 1 has room for the offloaded state ({human_bytes(state)}) but not for "
        f"loading a checkpoint, which stages up to {human_bytes(load)} more beside it until every rank has read it: "
        f"a load will be refused unless {human_bytes(load - load // 2)} more is free by then."
    ], second["warned"]


def _refused_load(engine: ZeroEngine, rank: int, free: int, own_disk: bool, checkpoint: Path, **apart) -> dict:
    """A load with ``free`` bytes free in this rank's offload_dir before it, less what it stages (``own_disk``: a
    filesystem no other rank shares): its error, what it staged (every staged file, before any is put in place),
    what it left in the tier's directory, and whether the weights stayed."""
    before = engine.full_state_dict()
    original_usage, original_filesystem = shutil.disk_usage, nvme_load._filesystem
    original_install, staged = nvme_load.NvmeLoad.install, []

    def install(self, optimizer):  # type: ignore[no-untyped-def]
        staged.append(sum(p.stat().st_size for p in self.tier.directory.glob("*.loaded")))
        return original_install(self, optimizer)

    sharing = checkpoint.parent.glob(f"lightning-zero-*/rank{rank if own_disk else '*'}")
    shutil.disk_usage = _free(free, list(sharing))
    nvme_load.NvmeLoad.install = install  # type: ignore[method-assign]
    if own_disk:
        nvme_load._filesystem = lambda path: ("another host", rank)
    try:
        engine.load_checkpoint(checkpoint, **apart)
        outcome = "loaded"
    except CheckpointError as error:
        outcome = str(error)
    finally:
        shutil.disk_usage, nvme_load._filesystem = original_usage, original_filesystem
        nvme_load.NvmeLoad.install = original_install  # type: ignore[method-assign]
    left = sorted(p.name for p in checkpoint.parent.glob(f"lightning-zero-*/rank{rank}/*.loaded"))
    changed = relative_difference(engine.full_state_dict(), before)
    return {"error": outcome, "staged": staged, "left behind": left, "changed": changed}


def _load_room(rank: int, world_size: int, directory: str) -> dict:
    """Refused loads (one rank's small disk; a disk the ranks share, where each alone would fit), then training
    goes on exactly; the checkpoint loads (whole, or its optimizer from a directory of its own) on a disk with
    just what the check counted free, and training goes on exactly from it."""
    root = Path(directory)
    engine = _engine(directory)
    loads: list[int] = [0] * world_size
    dist.all_gather_object(loads, 12 * _offloaded_elements(engine))  # each rank's staged copy: moments, master
    results: dict = {"loads": loads}
    train_accumulated(engine, rank, range(1))
    engine.save_checkpoint(root / "ckpt")
    engine.save_checkpoint(root / "model", include_optimizer=False)
    engine.save_checkpoint(root / "optimizer", include_model=False)
    train_accumulated(engine, rank, range(1, 2))  # the state on disk again, newer than the checkpoint
    small = 16 * 2**10 if rank == 1 else 1 << 40  # rank 1: a 16 KiB disk of its own, for ~40 KiB
    results["one rank short"] = _refused_load(engine, rank, small, True, root / "ckpt")
    results["shared disk"] = _refused_load(engine, rank, sum(loads) - 1, False, root / "ckpt")
    train_accumulated(engine, rank, range(2, 3))
    reference = _engine(directory)
    train_accumulated(reference, rank, range(3))
    results["trained on"] = relative_difference(engine.full_state_dict(), reference.full_state_dict())
    for case, paths in {"fits": {}, "optimizer apart fits": {"optimizer_path": root / "optimizer"}}.items():
        results[case] = _refused_load(engine, rank, sum(loads), False, root / ("model" if paths else "ckpt"), **paths)
        train_accumulated(engine, rank, range(1, 3))
        results[f"resumed, {case}"] = relative_difference(engine.full_state_dict(), reference.full_state_dict())
    return results


def test_a_load_that_would_not_fit_in_offload_dir_is_refused_alike_on_every_rank_and_changes_nothing(
    tmp_path: Path,
) -> None:
    outcomes = run_distributed(_load_room, 2, str(tmp_path))
    first, second = outcomes
    loads = first["loads"]
    operation = f"loading checkpoint {tmp_path / 'ckpt'} refused before reading the shards; nothing was changed"
    start = (
        "ZeRO: loading this checkpoint stages a copy of the offloaded optimizer state in offload_dir, beside the "
        "state, until every rank has read it, and it does not fit: "
    )
    expected = {
        "one rank short": f"rank 1's offload_dir {tmp_path} has 16.00 KiB free and the load stages "
        f"{human_bytes(loads[1])} there",
        "shared disk": f"the offload_dir {tmp_path} of ranks 0, 1 (one disk: rank 0 {human_bytes(loads[0])}, rank 1 "
        f"{human_bytes(loads[1])}) has {human_bytes(sum(loads) - 1)} free and the load stages "
        f"{human_bytes(sum(loads))} there",
    }
    for case, problem in expected.items():
        for results in outcomes:
            refused = results[case]
            assert refused["error"] == f"{start}{problem}. Free space there and load again ({operation}).", refused
            assert refused["left behind"] == [] and refused["changed"] == 0.0, refused
    for rank, results in enumerate(outcomes):
        assert results["trained on"] == 0.0, results
        for case in ("fits", "optimizer apart fits"):
            # What the check counted is what the load staged: a disk with just that much free takes it.
            fits = results[case]
            assert fits["error"] == "loaded" and fits["staged"] == [loads[rank]], (case, fits)
            assert fits["left behind"] == [] and results[f"resumed, {case}"] == 0.0, (case, results)
