"""The Lightning strategy end to end: real processes started by Lightning's
launcher (devices=2 on CPU), against DDP, with checkpoints resumed at another
device count and stage, and consolidated files loaded by Lightning."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry

import lightning_zero
from lightning_zero import ZeroStrategy, consolidated
from tests.checkpoint_files import assert_same_checkpoint
from tests.in_process import run_module
from tests.lightning_module import TinyLM
from tests.paths import TESTS
from tests.workers import relative_difference
from zero_core.checkpoint import consolidate_checkpoint

SCRIPT = TESTS / "scripts" / "lightning_runs.py"
PARITY = dict(max_steps=4, accumulate=2, clip=0.5)
# One step per epoch (a global batch of 8 is the whole data set), so every epoch
# sees the same samples and the comparison does not depend on how Lightning
# counts a resumed epoch.
RESUMABLE = dict(batchnorm=False, dataset_size=8, max_steps=6)
# Lightning's BackboneFinetuning unfreezes the first block (the shapes of the others)
# at epoch 2 and adds it to the optimizer as a third param group.
FINETUNING = dict(RESUMABLE, unfreeze_backbone_at=2)
# configure_optimizers returns an optimizer that steps whole tensors (tests.lightning_module.WholeTensorTinyLM):
# torch's Muon over the matrices, MuonWithAuxAdamW, torch's Adafactor.
WHOLE_TENSOR = ("muon", "muon+adamw", "adafactor")
# Offloaded units step on the host while backward goes on (zero_core/passes/step_in_backward.py).
IN_BACKWARD = {"offload_optimizer": "cpu", "offload_step_in_backward": True}
# Manual optimization that skips a step on a NaN norm (and one more), zeroing the gradients every batch.
SKIP_ON_NAN = dict(skip_on_nan=True, batchnorm=False, max_steps=4)
TWO_DEVICE_RUNS = [
    {"name": "ddp-skip-on-nan", "strategy": "ddp", **SKIP_ON_NAN},
    *({"name": f"zero{stage}-skip-on-nan", "strategy": f"zero{stage}", **SKIP_ON_NAN} for stage in (1, 2, 3)),
    {"name": "ddp", "strategy": "ddp_find_unused_parameters_true", **PARITY},
    *(
        {"name": f"ddp-{name}", "strategy": "ddp_find_unused_parameters_true", "max_steps": 4, "whole_tensor": name}
        for name in WHOLE_TENSOR
    ),
    *(
        {"name": f"zero{stage}-{name}", "strategy": f"zero{stage}", "max_steps": 4, "whole_tensor": name}
        for stage, name in ((1, "muon"), (3, "muon"), (3, "muon+adamw"), (2, "adafactor"))
    ),
    {"name": "zero1", "strategy": "zero1", **PARITY},
    # Settings chosen for this host's memory at setup, from the module's example_input_array.
    {"name": "zero-auto", "strategy": "zero_auto", **PARITY, "example_input": True},
    {"name": "zero-auto-no-example", "strategy": "zero_auto", "max_steps": 1, "expect_error": True},
    {"name": "zero2", "strategy": "zero2", **PARITY},
    {
        "name": "zero3",
        "strategy": "zero3",
        **PARITY,
        "summary": True,
        "evaluate": True,
        "limit_val_batches": 2,
        "val_check_interval": 2,
    },
    {
        "name": "ddp-value",
        "strategy": "ddp_find_unused_parameters_true",
        "max_steps": 3,
        "clip": 0.01,
        "clip_algorithm": "value",
    },
    {"name": "zero2-value", "strategy": "zero2", "max_steps": 3, "clip": 0.01, "clip_algorithm": "value"},
    {"name": "ddp-manual", "strategy": "ddp_find_unused_parameters_true", "max_steps": 3, "manual": True},
    {"name": "zero2-manual", "strategy": "zero2", "max_steps": 3, "manual": True},
    # Stage 3: the backward runs inside the training step's forward, with the root unit still running.
    {"name": "zero3-manual", "strategy": "zero3", "max_steps": 3, "manual": True},
    # Two steps inside one training step: its second half runs after the first step, on the new weights.
    {"name": "ddp-two-steps", "strategy": "ddp", "max_steps": 4, "two_steps": True, "batchnorm": False},
    {"name": "zero3-two-steps", "strategy": "zero3", "max_steps": 4, "two_steps": True, "batchnorm": False},
    {"name": "zero3-bf16-mixed", "strategy": "zero3", "max_steps": 4, "precision": "bf16-mixed"},
    {"name": "zero3-bf16-true", "strategy": "zero3", "max_steps": 4, "precision": "bf16-true"},
    {
        "name": "zero3-16-mixed",
        "strategy": "zero3",
        "max_steps": 4,
        "plugin_precision": "16-mixed",
        "settings": {"initial_loss_scale": 2.0**10},
    },
    {"name": "zero3-fp32", "strategy": "zero3", "max_steps": 4},
    {"name": "zero3-in-backward", "strategy": "zero3", "max_steps": 4, "settings": IN_BACKWARD},
    {
        "name": "zero3-in-backward-clip",
        **{"strategy": "zero3", "max_steps": 1, "settings": IN_BACKWARD, "clip": 1.0, "expect_error": True},
    },
    {"name": "zero3-resumable", "strategy": "zero3", **RESUMABLE, "checkpoint_epochs": True},
    # The same run, its checkpoints saved in the background (the setting); and top-k pruning under AsyncCheckpointIO.
    {
        "name": "zero3-async",
        **{"strategy": "zero3", **RESUMABLE, "checkpoint_epochs": True},
        "settings": {"asynchronous_checkpoints": True},
    },
    {"name": "zero2-topk-async", "strategy": "zero2", "max_steps": 4, "top_k": 1, "async_io": True},
    {"name": "ddp-resumable", "strategy": "ddp_find_unused_parameters_true", **RESUMABLE, "checkpoint_epochs": True},
    {"name": "zero2-topk", "strategy": "zero2", "max_steps": 4, "top_k": 1},
    {"name": "zero2-syncbn", "strategy": "zero2", "max_steps": 1, "sync_batchnorm": True, "expect_error": True},
    *(
        {"name": f"{strategy}-{name}", "strategy": strategy, "max_steps": 1, "callback": name, "expect_error": True}
        for strategy, name in (("zero3", "swa"), ("zero1", "ema"), ("zero2", "pruning"))
    ),
    *(
        {"name": f"zero{stage}-finetuning", "strategy": f"zero{stage}", **FINETUNING, "checkpoint_epochs": stage == 3}
        for stage in (1, 2, 3)
    ),
]
ONE_DEVICE_RUNS = [
    {
        "name": "resumed-zero1",
        "strategy": "zero1",
        **RESUMABLE,
        "batch_size": 8,
        "ckpt_path": "zero3-resumable/epoch=2-step=3.ckpt",
    },
    {
        "name": "resumed-zero1-from-async",
        "strategy": "zero1",
        **RESUMABLE,
        "batch_size": 8,
        "ckpt_path": "zero3-async/epoch=2-step=3.ckpt",
    },
    # Files, not directories: DDP's own (users move a run to ZeRO this way), and zero-consolidate's.
    *(
        {"name": name, "strategy": strategy, **RESUMABLE, "batch_size": 8, "ckpt_path": ckpt_path}
        for name, strategy, ckpt_path in (
            ("resumed-ddp", "ddp_find_unused_parameters_true", "ddp-resumable/epoch=2-step=3.ckpt"),
            ("resumed-zero3-from-ddp", "zero3", "ddp-resumable/epoch=2-step=3.ckpt"),
            ("resumed-zero2-from-consolidated", "zero2", "resumable-consolidated.ckpt"),
        )
    ),
    # DDP reduces no gradient of a parameter frozen when it was built, so one process on
    # the global batch is the reference for unfreezing (and its resume, for Lightning's own).
    {"name": "one-process-finetuning", "strategy": "auto", **FINETUNING, "batch_size": 8, "checkpoint_epochs": True},
    {
        "name": "resumed-one-process-finetuning",
        "strategy": "auto",
        **FINETUNING,
        "batch_size": 8,
        "ckpt_path": "one-process-finetuning/epoch=3-step=4.ckpt",
    },
    {
        "name": "resumed-zero1-finetuning",
        "strategy": "zero1",
        **FINETUNING,
        "batch_size": 8,
        "ckpt_path": "zero3-finetuning/epoch=3-step=4.ckpt",
    },
    {
        "name": "consolidated-zero3-finetuning",
        "strategy": "zero3",
        **FINETUNING,
        "batch_size": 8,
        "ckpt_path": "finetuning-consolidated.ckpt",
    },
]


def _launch(runs: list[dict], out: Path, devices: int) -> None:
    """Why a process of its own: Lightning's own launcher is the subject: it starts the processes for `devices`, as
    a user's `python train.py` does."""
    spec = out / f"runs-{devices}.json"
    spec.write_text(json.dumps(runs))
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(spec), str(out), str(devices)], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]


@pytest.fixture(scope="module")
def fabric_launch(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Path, Future[subprocess.CompletedProcess]] | None]:
    """The run of ``test_fabric_trains_saves_and_resumes_exactly`` (where that test is selected), started in the
    background beside the Trainer's launches of ``results``: each keeps about one of two cores busy."""
    selected = {getattr(item, "originalname", None) for item in request.session.items if item.module is request.module}
    if "test_fabric_trains_saves_and_resumes_exactly" not in selected:
        yield None
        return
    out = tmp_path_factory.mktemp("fabric")
    command = [sys.executable, str(TESTS / "scripts" / "fabric_run.py"), str(out)]
    with ThreadPoolExecutor(max_workers=1) as background:
        yield out, background.submit(subprocess.run, command, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, fabric_launch: tuple | None) -> tuple[Path, dict[str, dict]]:
    out = tmp_path_factory.mktemp("lightning")  # the Fabric run (fabric_launch) goes on beside these launches
    _launch(TWO_DEVICE_RUNS, out, 2)
    for run, checkpoint in (("zero3-finetuning", "epoch=3-step=4.ckpt"), ("zero3-resumable", "epoch=2-step=3.ckpt")):
        consolidated_file = out / f"{run.removeprefix('zero3-')}-consolidated.ckpt"
        consolidate_checkpoint(out / run / checkpoint, consolidated_file, "lightning")
    _launch(ONE_DEVICE_RUNS, out, 1)
    loaded = {
        run["name"]: torch.load(out / f"{run['name']}.pt", weights_only=False)
        for run in TWO_DEVICE_RUNS + ONE_DEVICE_RUNS
    }
    return out, loaded


def test_strategies_are_registered_and_validated() -> None:
    assert {"zero1", "zero2", "zero3", "zero_auto"} <= set(StrategyRegistry.available_strategies())
    with pytest.raises(ValueError, match="use 1 \\(optimizer state\\)"):
        ZeroStrategy(stage=5)
    with pytest.raises(ValueError, match="precision='64-true' is not supported"):
        lightning_zero.ZeroPrecision("64-true")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_stage_matches_ddp_with_clipping_and_accumulation(results: tuple, stage: int) -> None:
    _, runs = results
    reference, ours = runs["ddp"], runs[f"zero{stage}"]
    assert len(ours["losses"]) == 8 and ours["global_step"] == 4  # 4 steps of 2 micro-batches
    assert ours["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert relative_difference(ours["weights"], reference["weights"]) <= 1e-5


def test_zero_auto_chooses_for_the_hosts_memory_and_matches_ddp(results: tuple) -> None:
    _, runs = results
    reference, ours = runs["ddp"], runs["zero-auto"]
    assert ours["fit"] is not None and ours["fit"]["summary"].startswith("zero fit for device ")
    assert ours["fit"]["config"].stage == 1  # a tiny model in a host's memory: the cheapest settings
    assert ours["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert relative_difference(ours["weights"], reference["weights"]) <= 1e-5
    refused = runs["zero-auto-no-example"]["error"]
    assert refused.startswith("ValueError: memory_budget: the settings are chosen from one measured batch")
    assert "set model.example_input_array to one batch" in refused


@pytest.mark.parametrize("run", ["zero1-muon", "zero3-muon", "zero3-muon+adamw", "zero2-adafactor"])
def test_whole_tensor_optimizers_from_configure_optimizers_match_ddp_with_them(results: tuple, run: str) -> None:
    """Each tensor stepped whole at its owner by the optimizer's own step (Muon, MuonWithAuxAdamW's Muon groups,
    Adafactor; MuonWithAuxAdamW's AdamW groups on the pieces): DDP's numbers with the same optimizer, bit for
    bit."""
    _, runs = results
    reference, ours = runs[f"ddp-{run.split('-', 1)[1]}"], runs[run]
    assert ours["global_step"] == 4 and len(set(ours["losses"])) > 1
    assert ours["losses"] == reference["losses"]
    assert relative_difference(ours["weights"], reference["weights"]) == 0.0


@pytest.mark.parametrize("variant", ["zero2-value", "zero2-manual", "zero3-manual", "zero3-two-steps"])
def test_value_clipping_and_manual_optimization_match_ddp(results: tuple, variant: str) -> None:
    _, runs = results
    reference, ours = runs[f"ddp-{variant.split('-', 1)[1]}"], runs[variant]
    assert ours["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert relative_difference(ours["weights"], reference["weights"]) <= 1e-5


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_manual_optimization_skipping_a_nan_step_trains_on_as_ddp(results: tuple, stage: int) -> None:
    """optimizer.zero_grad() on Lightning's wrapper drops the NaN gradients and the skipped step's."""
    _, runs = results
    reference, ours = runs["ddp-skip-on-nan"], runs[f"zero{stage}-skip-on-nan"]
    assert len(ours["norms"]) == 6 and ours["global_step"] == 4  # batches 1 (NaN) and 3 skipped
    assert ours["norms"] == pytest.approx(reference["norms"], rel=1e-5, nan_ok=True)
    assert math.isnan(ours["norms"][1]) and all(math.isfinite(n) for i, n in enumerate(ours["norms"]) if i != 1)
    assert relative_difference(ours["weights"], reference["weights"]) <= 1e-5


def test_stage3_summary_and_evaluation_loops(results: tuple) -> None:
    _, runs = results
    zero3 = runs["zero3"]
    model = TinyLM()
    assert zero3["summary_total"] == sum(p.numel() for p in model.parameters())
    assert zero3["summary_trainable"] == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert zero3["test"][0]["test_loss"] == pytest.approx(zero3["validate"][0]["val_loss"])
    assert zero3["predictions"].shape == (8, 6)


def test_offloaded_units_stepping_in_backward_train_as_the_in_memory_step(results: tuple) -> None:
    """Lightning's loop (closure, then step) with the host step during backward: the in-memory run's losses
    and weights up to the fused host kernel's rounding; gradient_clip_val is refused before any step."""
    _, runs = results
    ours, reference = runs["zero3-in-backward"], runs["zero3-fp32"]
    # The host step takes torch's fused AdamW, the reference its default loop: one rounding apart per step,
    # which AdamW turns into lr-sized steps where a gradient is near zero (hence the weights' tolerance).
    assert ours["losses"] == pytest.approx(reference["losses"], rel=1e-4)
    assert relative_difference(ours["weights"], reference["weights"]) < 2e-3
    error = runs["zero3-in-backward-clip"]["error"]
    assert error is not None and "cannot clip under offload_step_in_backward=True" in error


@pytest.mark.parametrize("precision, tolerance", [("bf16-mixed", 0.02), ("bf16-true", 0.05), ("16-mixed", 0.01)])
def test_every_precision_trains(results: tuple, precision: str, tolerance: float) -> None:
    _, runs = results
    ours, fp32 = runs[f"zero3-{precision}"]["losses"], runs["zero3-fp32"]["losses"]
    assert ours[-1] < ours[0]
    assert ours != fp32
    assert ours == pytest.approx(fp32, rel=tolerance)


def test_resume_with_other_device_count_and_stage(results: tuple) -> None:
    out, runs = results
    uninterrupted, resumed = runs["zero3-resumable"], runs["resumed-zero1"]
    assert resumed["global_step"] == 6 and len(resumed["losses"]) == 3  # only the steps after the checkpoint
    assert relative_difference(resumed["weights"], uninterrupted["weights"]) <= 1e-5


def test_checkpoints_saved_in_the_background_hold_the_same_and_resume_the_same(results: tuple) -> None:
    """asynchronous_checkpoints=True: the run trains as the synchronous one, each epoch's directory holds the
    same bits, a resume from it at another stage and device count ends where the one from the synchronous
    checkpoint does; ModelCheckpoint's pruning under Lightning's AsyncCheckpointIO keeps one complete directory."""
    out, runs = results
    assert runs["zero3-async"]["losses"] == runs["zero3-resumable"]["losses"]
    for epoch in ("epoch=0-step=1.ckpt", "epoch=2-step=3.ckpt", "last.ckpt"):
        assert_same_checkpoint(out / "zero3-resumable" / epoch, out / "zero3-async" / epoch)
    resumed, reference = runs["resumed-zero1-from-async"], runs["resumed-zero1"]
    assert resumed["losses"] == reference["losses"]
    assert relative_difference(resumed["weights"], reference["weights"]) == 0.0
    kept = sorted((out / "zero2-topk-async-topk").iterdir())
    assert len(kept) == 1 and (kept[0] / "zero-manifest.json").is_file()


@pytest.mark.parametrize("run", ["resumed-zero3-from-ddp", "resumed-zero2-from-consolidated"])
def test_resume_from_a_file_restores_the_optimizer_as_ddp_does(results: tuple, run: str) -> None:
    """Trainer.fit(ckpt_path=<file>): DDP's own file, or a consolidated one, resumes weights and Adam's
    state, at another stage and device count, as DDP resumes from its file (a fresh Adam would be far off)."""
    _, runs = results
    reference, ours = runs["resumed-ddp"], runs[run]
    assert ours["global_step"] == reference["global_step"] == 6 and len(ours["losses"]) == 3
    assert ours["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert relative_difference(ours["weights"], reference["weights"]) <= 1e-5


def test_model_checkpoint_writes_directories_and_prunes(results: tuple) -> None:
    out, _ = results
    kept = sorted((out / "zero2-topk-topk").iterdir())
    assert len(kept) == 1 and (kept[0] / ".metadata").is_file()
    assert (out / "zero3-resumable" / "last.ckpt" / ".metadata").is_file()


def test_consolidated_checkpoints_load_with_load_from_checkpoint(results: tuple, tmp_path: Path) -> None:
    out, runs = results
    checkpoint = out / "zero3-resumable" / "epoch=5-step=6.ckpt"
    ours = consolidate_checkpoint(checkpoint, tmp_path / "ours.ckpt", "lightning")
    theirs = tmp_path / "lightning.ckpt"
    run_module("lightning.pytorch.utilities.consolidate_checkpoint", str(checkpoint), "--output_file", str(theirs))
    expected = runs["zero3-resumable"]["weights"]
    # The directory itself, in one line (a plain load_from_checkpoint on it is an IsADirectoryError),
    # and a file through the same line.
    for file in (ours, theirs, consolidated(checkpoint), consolidated(ours)):
        model = TinyLM.load_from_checkpoint(file, weights_only=False)
        assert model.hparams.batchnorm is False  # hyperparameters come back too
        assert relative_difference(model.state_dict(), expected) == 0.0


def test_fabric_trains_saves_and_resumes_exactly(fabric_launch: tuple | None) -> None:
    assert fabric_launch is not None
    tmp_path, launch = fabric_launch
    result = launch.result()
    assert result.returncode == 0, result.stderr[-6000:]
    run = torch.load(tmp_path / "fabric.pt", weights_only=False)
    assert run["strategy"] == "ZeroFabricStrategy"
    assert run["first"][-1] < run["first"][0]
    assert run["step"] == 3 and run["remainder"] == {}
    assert run["resumed"] == run["continued"]  # the scheduler's state came back too
    assert relative_difference(run["final"], run["uninterrupted"]) == 0.0
    assert "holds no entries ['epoch']" in run["refused"] and run["refused_changed_nothing"]
    # A one-process (as a DDP) run's file: its optimizer state comes back too (a fresh Adam would be far off).
    assert run["from_file_remainder"] == {}
    assert run["from_file"] == pytest.approx(run["continued"], rel=1e-5)  # rank 0's losses, as it logged them
    assert relative_difference(run["from_file_final"], run["one_process_final"]) <= 1e-5
    # torch's Muon through fabric.setup: each matrix stepped whole at its owner, DDP's numbers bit for bit.
    muon = run["muon"]
    assert muon["losses"] == muon["reference_losses"] and len(set(muon["losses"])) > 1
    assert relative_difference(muon["final"], muon["ddp"]) == 0.0


def test_lightning_cli_config_builds_the_strategy(tmp_path: Path) -> None:
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 1\n  logger: false\n  strategy:\n"
        "    class_path: lightning_zero.ZeroStrategy\n"
        "    init_args: {stage: 2, prefetch: 2, wrap_policy: tests.models.Block}\n"
    )
    cli = LightningCLI(TinyLM, run=False, save_config_callback=None, args=["--config", str(config)])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, ZeroStrategy)
    assert (strategy.zero_config.stage, strategy.zero_config.prefetch) == (2, 2)
    assert strategy.zero_config.wrap_policy.module_classes[0].__name__ == "Block"


@pytest.mark.parametrize(
    "run, callback",
    [
        ("zero3-swa", "StochasticWeightAveraging"),
        ("zero1-ema", "EMAWeightAveraging"),
        ("zero2-pruning", "ModelPruning"),
    ],
)
def test_callbacks_that_rewrite_parameters_are_refused_before_training(results: tuple, run: str, callback: str) -> None:
    """Otherwise SWA fails with ParameterAtRestError after swa_epoch_start epochs (stage 3), or the averaged
    or pruned weights silently miss the optimizer's shards (stages 1/2)."""
    error = results[1][run]["error"]
    assert error is not None and f"{callback} does not work with ZeroStrategy" in error
    assert "Remove it from the Trainer's callbacks" in error


def test_sync_batchnorm_is_refused_on_cpu_before_training(results: tuple) -> None:
    # torch's SyncBatchNorm trains on accelerators only; on GPUs it is applied (tests/distributed/runtime/test_cuda.py).
    error = results[1]["zero2-syncbn"]["error"]
    assert error is not None and "sync_batchnorm=True) needs GPUs" in error


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_backbone_finetuning_trains_like_one_process_at_every_stage(results: tuple, stage: int) -> None:
    _, runs = results
    reference, ours = runs["one-process-finetuning"], runs[f"zero{stage}-finetuning"]
    assert ours["global_step"] == 6 and len(ours["lrs"]) == 3  # the backbone's group was added
    assert ours["lrs"] == pytest.approx(reference["lrs"])
    assert relative_difference(ours["weights"], reference["weights"]) <= 1e-5
    start = TinyLM(batchnorm=False).state_dict()  # the backbone did train: it moved away from its start
    backbone = [key for key in start if key.startswith("net.blocks.0.")]
    assert relative_difference({k: ours["weights"][k] for k in backbone}, {k: start[k] for k in backbone}) > 1e-3


def test_backbone_finetuning_resumes_as_lightning_does_in_one_process(results: tuple) -> None:
    """From a stage-3 checkpoint saved after the unfreeze, at one device and stage 1: the
    callback's param groups come back before the optimizer state, as Lightning restores them."""
    _, runs = results
    reference, ours = runs["resumed-one-process-finetuning"], runs["resumed-zero1-finetuning"]
    assert ours["global_step"] == 6 and len(ours["losses"]) == 2
    assert ours["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert ours["lrs"] == pytest.approx(reference["lrs"])
    assert relative_difference(ours["weights"], reference["weights"]) <= 1e-5
    assert ours["restarting"] == reference["restarting"] == [False]  # the next fit starts afresh


def test_backbone_finetuning_resumes_from_a_consolidated_file_with_its_group(results: tuple) -> None:
    """A consolidated file resumes like the one-process checkpoint: the callback's backbone group comes
    back first, then the optimizer state of all three groups. Lightning re-creates the group on resume,
    not ``requires_grad``, so in one process too the backbone stays frozen after any resume."""
    out, runs = results
    ours, one_process = runs["consolidated-zero3-finetuning"], runs["resumed-one-process-finetuning"]
    assert ours["global_step"] == 6 and len(ours["lrs"]) == 3 and ours["restarting"] == [False]
    assert ours["lrs"] == pytest.approx(one_process["lrs"])
    assert ours["losses"] == pytest.approx(one_process["losses"], rel=1e-5)
    assert relative_difference(ours["weights"], one_process["weights"]) <= 1e-5
    resumed_from = torch.load(out / "finetuning-consolidated.ckpt", weights_only=True)["state_dict"]
    backbone = [key for key in resumed_from if key.startswith("net.blocks.0.")]
    assert relative_difference({k: ours["weights"][k] for k in backbone}, {k: resumed_from[k] for k in backbone}) == 0.0
