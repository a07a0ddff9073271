"""offload_params (stage 3): each sharded unit's parameter shard rests in host memory ("cpu") or in a file
("nvme") and is staged to the device for each gather. Training equals the in-memory run bit for bit, the
shards really rest where they should (the device's staging buffers are empty between gathers and bounded by
the gathers in flight during forward and backward; with "nvme" the files hold every shard and memory only the
few read ahead or waiting for their writes), the report and the estimate count them, checkpoints cross modes,
a failed read or write is raised alike on every rank, and every setting that cannot mean anything is refused."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import zero_core.offload.shard_files as shard_files
import zero_core.unit.storage as storage
from tests.models import TinyTransformer, batch, lm_loss, make_optimizer
from tests.rank_pool import run_distributed
from tests.workers import config_for, relative_difference, train_accumulated
from zero_core import MixedPrecision, OffloadError, UnitReport, ZeroConfig, ZeroEngine, estimate
from zero_core.memory.estimate import EstimateSettings, UnitCount, estimate_units
from zero_core.passes.gathering import GatherPolicy
from zero_core.stage_plan import StagePlan
from zero_core.unit import StorageState

PRECISIONS = {
    "fp32": None,
    "bf16": MixedPrecision(compute_dtype=torch.bfloat16),
    # A first scale that overflows: the first step is skipped, as the in-memory run skips it.
    "fp16": MixedPrecision(compute_dtype=torch.float16),
}


def _engine(offload_params: str, directory: str, optimizer: str = "adamw", **settings) -> ZeroEngine:
    precision = PRECISIONS[settings.pop("precision", "fp32")]
    prefetch = settings.pop("prefetch", 1)
    torch.manual_seed(0)
    model = TinyTransformer(batchnorm=False)
    config = dataclasses.replace(
        config_for(3, prefetch=prefetch, precision=precision),
        offload_params=offload_params,
        offload_dir=directory,
        **settings,
    )
    return ZeroEngine(model, make_optimizer(optimizer, model), config)


CASES = [
    {},
    {"precision": "bf16"},
    {"precision": "fp16"},
    {"optimizer": "sgd", "accumulate": 2},
    {"prefetch": 2},
    {"offload_optimizer": "cpu"},
    {"offload_optimizer": "nvme", "precision": "bf16"},
    {"offload_optimizer": "cpu", "offload_fraction": 0.3},
    {"shard_group_size": 1},  # hybrid sharding at 2 ranks: groups of one
    {"persistence_threshold": 1500},  # the root unit (1,168 parameters) stays gathered, on the device
]


def _shard_bytes(engine: ZeroEngine, report: UnitReport) -> int:
    """One rank's parameter shard of a unit, in the compute dtype."""
    return report.shard_numel * torch.empty(0, dtype=engine.config.mixed_precision.compute_dtype).element_size()


@contextlib.contextmanager
def _after_each_gather(record: Callable[[], None]) -> Iterator[None]:
    """``record()`` after every start and end of a unit's gather (forward and backward) meanwhile."""
    original_wait, original_start = storage.ParamStorage.wait_gathered, storage.ParamStorage.start_gather

    def recorded(original):  # type: ignore[no-untyped-def]
        def method(self, backward=False):  # type: ignore[no-untyped-def]
            original(self, backward)
            record()

        return method

    storage.ParamStorage.wait_gathered = recorded(original_wait)  # type: ignore[method-assign]
    storage.ParamStorage.start_gather = recorded(original_start)  # type: ignore[method-assign]
    try:
        yield
    finally:
        storage.ParamStorage.wait_gathered = original_wait  # type: ignore[method-assign]
        storage.ParamStorage.start_gather = original_start  # type: ignore[method-assign]


def _parity(rank: int, world_size: int, directory: str) -> list[dict]:
    """Each case beside the in-memory run; the parameter bytes really alive (``memory_report``: every
    storage the units keep, staging buffers included) recorded in both, in forward and backward: the
    gathers follow the same schedule, so the difference is what the staging buffers hold."""
    results = []
    for case in CASES:
        case = dict(case)
        accumulate = case.pop("accumulate", 1)
        # An offloaded optimizer steps with torch's fused CPU kernel: the reference uses it too.
        fused = {"optimizer": "adamw-fused"} if "offload_optimizer" in case else {}
        alive: dict[str, list[int]] = {"reference": [], "ours": []}
        engines: dict[str, ZeroEngine] = {}
        training: list[str] = []  # the engine training now

        def record() -> None:
            if training:  # not while an engine is being built
                alive[training[-1]].append(engines[training[-1]].memory_report().parameter_bytes)

        with _after_each_gather(record):
            engines["reference"] = reference = _engine("none", directory, **dict(case, **fused))
            training.append("reference")
            expected = train_accumulated(reference, rank, range(4), accumulate)
            training.clear()
            engines["ours"] = ours = _engine("cpu", directory, **case)
            training.append("ours")
            losses = train_accumulated(ours, rank, range(4), accumulate)
        reports = ours.unit_reports()
        offloaded = [r for r in reports if r.params_offloaded]
        fp32 = ours.config.mixed_precision.compute_dtype == torch.float32
        report, reference_report = ours.memory_report(), reference.memory_report()
        staged = [a - b for a, b in zip(alive["ours"], alive["reference"])]
        results.append(
            {
                "case": {"accumulate": accumulate, **case},
                "same losses": losses == expected,
                "weights difference": relative_difference(ours.full_state_dict(), reference.full_state_dict()),
                "units": len(reports),
                "persistent": sum(r.persistent for r in reports),
                "offloaded": len(offloaded),
                "same gathers": len(alive["ours"]) == len(alive["reference"]) > 0,
                "most staged in a pass": max(staged),
                "least staged in a pass": min(staged),
                "largest shard bytes": max(_shard_bytes(ours, r) for r in offloaded),
                "prefetch": case.get("prefetch", 1),
                "parameter bytes": report.parameter_bytes,
                "reference parameter bytes": reference_report.parameter_bytes,
                "host bytes": report.host_bytes,
                "reference host bytes": reference_report.host_bytes,
                # In fp32 an offloaded master (offload_optimizer) is the host shard itself: counted once.
                "shard bytes moved": sum(_shard_bytes(ours, r) for r in offloaded if not (fp32 and r.offloaded)),
            }
        )
    return results


def test_parameter_shards_rest_on_the_host_and_training_is_bit_for_bit_the_same(tmp_path: Path) -> None:
    for rank_results in run_distributed(_parity, 2, str(tmp_path)):
        for result in rank_results:
            case = result["case"]
            assert result["same losses"] and result["weights difference"] == 0.0, case
            assert result["offloaded"] == result["units"] - result["persistent"] > 0, case
            assert (result["persistent"] > 0) == ("persistence_threshold" in case), case
            # Between gathers the device holds no parameter shard (the same parameter bytes as in memory, now on
            # the host); during forward and backward only the gathers in flight (prefetched) hold a staged copy.
            assert result["parameter bytes"] == result["reference parameter bytes"], case
            assert result["host bytes"] == result["reference host bytes"] + result["shard bytes moved"], case
            assert result["same gathers"], case
            assert 0 <= result["least staged in a pass"], case
            assert 0 < result["most staged in a pass"] <= result["prefetch"] * result["largest shard bytes"], case


DISK_CASES = [
    {},
    {"precision": "bf16", "offload_optimizer": "nvme", "offload_units_in_memory": 1},
    {"precision": "fp16"},
    {"optimizer": "sgd", "accumulate": 2, "prefetch": 2},
    {"offload_optimizer": "cpu", "offload_fraction": 0.3, "shard_group_size": 1},
    # The worker thread steps the masters while backward reads the shards' files: no clipping here.
    {"offload_optimizer": "nvme", "precision": "bf16", "offload_step_in_backward": True, "unclipped": True},
]


def _train_unclipped(engine: ZeroEngine, rank: int, steps: range) -> list[float]:
    losses = []
    for step in steps:
        ids = batch(10 * step, rank)
        loss = lm_loss(engine.model(ids), ids)
        engine.backward(loss)
        losses.append(loss.item())
        engine.step()
    return losses


@contextlib.contextmanager
def _tiers_made() -> Iterator[list[shard_files.ShardFiles]]:
    """The parameter-file tiers engines make meanwhile."""
    made: list[shard_files.ShardFiles] = []
    original = shard_files.ShardFiles.__init__

    def init(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        original(self, *args, **kwargs)
        made.append(self)

    shard_files.ShardFiles.__init__ = init  # type: ignore[method-assign]
    try:
        yield made
    finally:
        shard_files.ShardFiles.__init__ = original  # type: ignore[method-assign]


def _in_memory(tier: shard_files.ShardFiles) -> int:
    """The shards' bytes really in memory now: their storages' sizes."""
    return sum(file.shard.untyped_storage().nbytes() for file in tier.files)


def _on_disk(rank: int, world_size: int, directory: str) -> list[dict]:
    """Each case beside the in-memory run, the shards' bytes in memory recorded at every gather of forward
    and backward, and the files' real sizes after training."""
    results = []
    for case in DISK_CASES:
        case = dict(case)
        accumulate, unclipped = case.pop("accumulate", 1), case.pop("unclipped", False)
        fused = {"optimizer": "adamw-fused"} if "offload_optimizer" in case else {}
        reference = _engine("none", directory, **dict(case, **fused, offload_step_in_backward=False))
        train = (
            (lambda e, r, s: _train_unclipped(e, r, s))
            if unclipped
            else (lambda e, r, s: train_accumulated(e, r, s, accumulate))
        )
        expected = train(reference, rank, range(4))
        in_memory: list[int] = []
        with _tiers_made() as tiers:
            ours = _engine("nvme", directory, **case)
        (tier,) = tiers

        with _after_each_gather(lambda: in_memory.append(_in_memory(tier))):
            losses = train(ours, rank, range(4))
        tier.drain(keep=0)  # the last writes, still going on behind the step
        files = sorted(tier.directory.glob("params*.bin"))
        shards = [_shard_bytes(ours, r) for r in ours.unit_reports() if r.params_offloaded]
        results.append(
            {
                "case": {"accumulate": accumulate, **case},
                "same losses": losses == expected,
                "weights difference": relative_difference(ours.full_state_dict(), reference.full_state_dict()),
                "file sizes": sorted(os.path.getsize(f) for f in files),
                "shard bytes": sorted(shards),
                "most in memory in a pass": max(in_memory),
                "bound": (ours.config.offload_units_in_memory + 1) * max(shards),  # writes waiting, one read ahead
                "in memory at rest": _in_memory(tier),
                "reported on disk": ours.memory_report().nvme_bytes,
            }
        )
        del ours
    return results


def test_nvme_parameter_shards_rest_in_files_and_training_is_bit_for_bit_the_same(tmp_path: Path) -> None:
    for rank_results in run_distributed(_on_disk, 2, str(tmp_path)):
        for result in rank_results:
            case = result["case"]
            assert result["same losses"] and result["weights difference"] == 0.0, case
            # One file per sharded unit, holding exactly its shard; nothing of it in memory once written.
            assert result["file sizes"] == result["shard bytes"], case
            assert result["in memory at rest"] == 0, case
            if case.get("offload_optimizer") != "nvme":  # else the optimizer's files are in it too
                assert result["reported on disk"] == sum(result["file sizes"]), case
            # During forward and backward: the shards read ahead and those waiting for their writes, no more.
            assert 0 < result["most in memory in a pass"] <= result["bound"], case


def _disk_failures(rank: int, world_size: int, directory: str) -> dict:
    """On rank 1 only: a shard's file lost (its read fails), then a full disk (its writes fail). Both are
    raised alike on every rank, before a step uses what they computed; the last checkpoint then loads and
    training goes on exactly as without them."""
    results = {}
    with _tiers_made() as tiers:
        engine = _engine("nvme", directory)
    (tier,) = tiers

    def outcome(steps: range) -> str:
        try:
            train_accumulated(engine, rank, steps)
            return "trained"
        except OffloadError as error:
            return str(error)

    train_accumulated(engine, rank, range(1))
    with engine.gathered_parameters(writeback=False), torch.no_grad():
        if rank == 0:  # a forward on one rank alone reads no file and must not wait for the other
            engine.model(batch(0, rank))
    checkpoint = Path(directory) / "ckpt-disk-failures"
    engine.save_checkpoint(checkpoint)
    tier.drain(keep=0)
    if rank == 1:
        (tier.directory / "params1.bin").unlink()
    results["lost file"] = outcome(range(1, 2))
    engine.load_checkpoint(checkpoint)  # writes every shard again
    original_write = shard_files.write_tensors

    def disk_full(path: Path, tensors: list[torch.Tensor]) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    if rank == 1:
        shard_files.write_tensors = disk_full
    try:
        results["disk full"] = outcome(range(1, 3))
    finally:
        shard_files.write_tensors = original_write
    engine.load_checkpoint(checkpoint)
    train_accumulated(engine, rank, range(1, 3))
    results["after the failures"] = engine.full_state_dict()
    reference = _engine("none", directory)
    train_accumulated(reference, rank, range(3))
    results["reference"] = reference.full_state_dict()
    return results


def test_a_lost_file_or_a_full_disk_fails_alike_on_every_rank_and_the_last_checkpoint_resumes(tmp_path: Path) -> None:
    first, second = run_distributed(_disk_failures, 2, str(tmp_path))
    assert first["lost file"] == second["lost file"]
    assert (
        "No such file or directory" in first["lost file"]
        and "on ranks [1]); found at the end of a forward" in (first["lost file"])
    )
    assert first["disk full"] == second["disk full"]
    assert "No space left on device" in first["disk full"] and "on ranks [1]" in first["disk full"]
    assert "the last checkpoint is untouched" in first["disk full"]
    for result in (first, second):
        assert relative_difference(result["after the failures"], result["reference"]) == 0.0


def _round_trips(rank: int, world_size: int, directory: str) -> dict:
    results = {}
    uninterrupted = _engine("none", directory)
    train_accumulated(uninterrupted, rank, range(4))
    expected = uninterrupted.full_state_dict()
    crossings = (("cpu", "none", 3), ("none", "cpu", 3), ("cpu", "none", 2), ("nvme", "cpu", 3), ("none", "nvme", 3))
    for saved_with, loaded_with, stage in crossings:
        first = _engine(saved_with, directory)
        train_accumulated(first, rank, range(2))
        path = Path(directory) / f"ckpt-{saved_with}-{loaded_with}-{stage}"
        first.save_checkpoint(path)
        second = _engine(loaded_with, directory, stage=stage)
        second.load_checkpoint(path)
        train_accumulated(second, rank, range(2, 4))
        results[f"{saved_with} -> {loaded_with} at stage {stage}"] = relative_difference(
            second.full_state_dict(), expected
        )
    # Writing a full parameter value (load_state_dict) reaches the host shard (or its file) the next gather stages.
    for mode in ("cpu", "nvme"):
        engine = _engine(mode, directory)
        new_values = {k: torch.full_like(v, 0.25) for k, v in engine.full_state_dict().items()}
        engine.model.load_state_dict(new_values)
        ids = batch(0, rank)
        with torch.no_grad():
            results[f"forward after a load, {mode}"] = engine.model(ids).tolist() == _forward_with(new_values, ids)
    return results


def _forward_with(values: dict[str, torch.Tensor], ids: torch.Tensor) -> list:
    torch.manual_seed(0)
    model = TinyTransformer(batchnorm=False)
    model.load_state_dict(values)
    with torch.no_grad():
        return model(ids).tolist()


def test_checkpoints_cross_parameter_offload_modes_and_stages(tmp_path: Path) -> None:
    for results in run_distributed(_round_trips, 2, str(tmp_path)):
        assert results.pop("forward after a load, cpu") and results.pop("forward after a load, nvme")
        assert all(difference == 0.0 for difference in results.values()), results


def test_what_cannot_mean_anything_is_refused_with_what_to_do() -> None:
    with pytest.raises(ValueError, match="offload_params='cpu' needs stage=3: at stage 1 every rank keeps"):
        ZeroConfig(stage=1, offload_params="cpu")
    with pytest.raises(ValueError, match="offload_params='nvme' needs stage=3: at stage 2 every rank keeps"):
        ZeroConfig(stage=2, offload_params="nvme")
    with pytest.raises(ValueError, match="offload_params='gpu' is invalid: use 'none' or 'cpu' or 'nvme'"):
        ZeroConfig(stage=3, offload_params="gpu")


def test_the_estimate_moves_the_shards_to_the_host() -> None:
    """Stage 3 with offload_params: the parameter shards' bytes move from the device to the host; in fp32 on
    a GPU the master then stays on the device as a tensor of its own (it was the shard)."""
    numel, world = 1_000_000, 4
    shard = numel / world
    for precision, compute in ((MixedPrecision(compute_dtype=torch.bfloat16), 2), (MixedPrecision(), 4)):
        plain = estimate(numel, world, precision=precision)[3]
        moved = estimate(numel, world, precision=precision, offload_params="cpu")[3]
        assert moved.parameter_bytes == plain.parameter_bytes == shard * compute
        assert moved.host_bytes == shard * compute
        master_of_its_own = 4 * shard if compute == 4 else 0
        assert moved.device_bytes == plain.device_bytes - shard * compute + master_of_its_own
    # Both offloads, fp32: the host master is the shard itself, and the device holds the gradient shard only.
    both = estimate(numel, world, offload_params="cpu", offload_optimizer="cpu")[3]
    assert both.device_bytes == 4 * shard
    # With the optimizer on NVMe only the moments go to the files: that master is the host shard, it stays.
    state_on_disk = estimate(numel, world, offload_params="cpu", offload_optimizer="nvme")[3]
    assert state_on_disk.nvme_bytes == 8 * shard and state_on_disk.host_bytes == both.host_bytes - 8 * shard
    assert state_on_disk.optimizer_state_bytes == 0 and state_on_disk.device_bytes == 4 * shard
    units = [UnitCount(numel, numel)]
    on_cpu = estimate_units(units, EstimateSettings(world, offload_params="cpu", host_is_device=True))[3]
    assert on_cpu.host_bytes == 4 * shard and on_cpu.optimizer_state_bytes == 8 * shard  # the master is the shard


def test_the_estimate_moves_nvme_shards_to_the_files() -> None:
    """offload_params="nvme": the shards' bytes leave memory for the files; the master stays where it was (in
    fp32 a tensor of its own: the shard on disk is a copy). With both offloads on NVMe (bf16), the device holds
    the gradient shard only, the host the gradient copy, the files the shard, the master and the moments."""
    numel, world = 1_000_000, 4
    shard = numel / world
    for precision, compute in ((MixedPrecision(compute_dtype=torch.bfloat16), 2), (MixedPrecision(), 4)):
        plain = estimate(numel, world, precision=precision)[3]
        on_disk = estimate(numel, world, precision=precision, offload_params="nvme")[3]
        assert (on_disk.parameter_bytes, on_disk.host_bytes, on_disk.nvme_bytes) == (0, 0, shard * compute)
        master_of_its_own = 4 * shard if compute == 4 else 0
        assert on_disk.device_bytes == plain.device_bytes - shard * compute + master_of_its_own
    bf16 = MixedPrecision(compute_dtype=torch.bfloat16)
    both = estimate(numel, world, precision=bf16, offload_params="nvme", offload_optimizer="nvme")[3]
    assert both.device_bytes == 4 * shard and both.host_bytes == 4 * shard
    assert both.nvme_bytes == (2 + 4 + 8) * shard


def test_a_part_written_over_a_failed_read_leaves_the_file_as_it_was(tmp_path: Path) -> None:
    """write_param into a shard whose read failed: storing zeros and that part would destroy the file's other
    values; nothing is written, and the failure waits for the next agreement."""
    tier = shard_files.ShardFiles(tmp_path, units_in_memory=1)
    file = tier.file_for(torch.arange(8, dtype=torch.float32))
    tier.drain(keep=0)
    assert file.shard.untyped_storage().nbytes() == 0  # on disk, not in memory
    good = (tmp_path / "params0.bin").read_bytes()
    original_read = shard_files.read_tensors
    shard_files.read_tensors = lambda path, tensors: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error", str(path)))
    try:
        file.for_writing(keep_values=True)[:2] = -1.0
    finally:
        shard_files.read_tensors = original_read
    file.store()
    tier.drain(keep=0)
    assert (tmp_path / "params0.bin").read_bytes() == good
    assert tier.read_failures == [f"I/O error: {tmp_path / 'params0.bin'}"]
    assert file.values().tolist() == list(range(8))  # read again: the file's values


def test_a_shard_handed_out_for_writing_is_not_freed_before_it_is_stored(tmp_path: Path) -> None:
    """With offload_step_in_backward the worker writes a unit's new shard (the master's values, right after its
    step) while backward releases shards: between for_writing and store, a release must not free it."""
    tier = shard_files.ShardFiles(tmp_path, units_in_memory=1)
    file = tier.file_for(torch.arange(8, dtype=torch.float32))
    tier.drain(keep=0)
    shard = file.for_writing(keep_values=False)
    file.free_if_on_disk()  # what backward's end of a unit, or a drain of other writes, calls meanwhile
    shard.copy_(torch.full((8,), 7.0))  # freed memory here would crash, or write nowhere
    file.store()
    tier.drain(keep=0)
    assert file.values().tolist() == [7.0] * 8


class _UnitOnDisk:
    """What GatherPolicy sees of a unit whose shard rests in a file: whether it is in memory for a read ahead."""

    params_on_disk = True

    def __init__(self, index: int):
        self.index, self.state, self.read_into_memory = index, StorageState.SHARDED, False
        self.storage = self  # the gather policy drives the unit's storage part: here the unit itself

    def read_ahead(self) -> None:
        self.read_into_memory = self.state is StorageState.SHARDED

    def start_gather(self, backward: bool = False) -> None:
        if self.state is StorageState.SHARDED:
            self.state, self.read_into_memory = StorageState.PREFETCHING, False  # copied to the device, freed

    def wait_gathered(self, backward: bool = False) -> None:
        self.start_gather()
        self.state = StorageState.GATHERED

    def reshard(self, keep_secondary: bool = False) -> None:
        self.state, self.read_into_memory = StorageState.SHARDED, False


def test_shards_read_ahead_for_an_order_that_did_not_happen_are_freed() -> None:
    """A forward that skips the units the last one predicted (every third unit runs): each shard read ahead
    for nothing is freed at the next gather, so one at most is in memory for a read ahead."""
    units = [_UnitOnDisk(index) for index in range(10)]
    policy = GatherPolicy(units, StagePlan.for_stage(3), prefetch=1, auto_prefetch=None)  # type: ignore[arg-type]
    most = 0
    for order in (range(10), range(0, 10, 3)):
        for index in order:
            policy.for_forward(units[index], keep=set(), timed=False)  # type: ignore[arg-type]
            most = max(most, sum(unit.read_into_memory for unit in units))
        policy.forward_ended()
    assert most == 1
