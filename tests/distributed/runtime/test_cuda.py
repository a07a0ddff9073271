"""CUDA paths: collectives on their own streams, ordered with events.

Skipped without a GPU. NCCL runs whenever there is a GPU per rank: at world
size 1 the collectives are copies, still issued on the side streams and
ordered with events, so the stream path runs on a single GPU. Two ranks on
one GPU use gloo (its CUDA collectives stage through the host, no side
streams). A missing stream dependency shows up as stages disagreeing with
each other and with plain training (they agree to rounding on the CPU).
"""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
import torch.distributed as dist

from tests.models import TinyTransformer, batch, lm_loss, make_optimizer
from tests.rank_pool import run_distributed
from tests.workers import config_for, relative_difference, train_clipped
from zero_core import MixedPrecision, ZeroConfig, ZeroEngine

pytestmark = [pytest.mark.distributed, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _on_two_gpus(fn, *args: object) -> list:  # type: ignore[no-untyped-def]
    """``fn`` on two ranks: NCCL with a GPU each, gloo where they share one."""
    return run_distributed(fn, 2, *args, backend="nccl" if torch.cuda.device_count() >= 2 else "gloo")


def _plain_losses(device: torch.device, rank: int, world_size: int) -> list[float]:
    """The same training without ZeRO: every rank's micro-batch, gradients averaged by hand."""
    torch.manual_seed(0)
    model = TinyTransformer().to(device)
    optimizer = make_optimizer("adamw", model)
    run = []
    for step in range(6):
        optimizer.zero_grad()
        for other in range(world_size):
            ids = batch(step % 2, other).to(device)
            loss = lm_loss(model(ids), ids)
            (loss / world_size).backward()
            if other == rank:
                run.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return run


def _gpu_losses(rank: int, world_size: int) -> dict[str, list[float]]:
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    losses = {"plain": _plain_losses(device, rank, world_size)}
    for stage in (1, 2, 3):
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            model = TinyTransformer().to(device)
            config = config_for(stage, precision=MixedPrecision(compute_dtype=dtype))
            engine = ZeroEngine(model, make_optimizer("adamw", model), config)
            side_streams = dist.get_backend() == "nccl"
            assert (engine.comm.all_gather_stream is not None) == side_streams
            assert (engine.comm.reduce_scatter_stream is not None) == side_streams
            losses[f"{stage}-{dtype}"] = train_clipped(model, engine, rank, range(6), device)
    return losses


@pytest.mark.parametrize("world_size", [1, 2])
def test_cuda_stages_agree_and_train(world_size: int) -> None:
    backend = "nccl" if torch.cuda.device_count() >= world_size else "gloo"
    for losses in run_distributed(_gpu_losses, world_size, backend=backend):
        for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
            stage1 = losses[f"1-{dtype}"]
            assert stage1[-1] < stage1[0]
            for stage in (2, 3):
                for a, b in zip(losses[f"{stage}-{dtype}"], stage1):
                    assert a == pytest.approx(b, rel=tolerance)
        for stage in (1, 2, 3):  # fp32: the same numbers as training without ZeRO
            assert losses[f"{stage}-{torch.float32}"] == pytest.approx(losses["plain"], rel=1e-5)


def _gpu_model_access(rank: int, world_size: int) -> dict:
    """Stage 3 on CUDA: parameters at rest refuse reads, state dicts round-trip, no-op moves pass."""
    from zero_core import ParameterAtRestError

    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.manual_seed(0)
    model = TinyTransformer().to(device)
    config = config_for(3, precision=MixedPrecision(compute_dtype=torch.bfloat16))
    engine = ZeroEngine(model, make_optimizer("adamw", model), config)
    ids = batch(0, rank).to(device)
    engine.backward(lm_loss(model(ids), ids))
    engine.step()
    model.to(device)
    model.cuda()
    try:
        model.blocks[0].up.weight.sum()
        refused = False
    except ParameterAtRestError:
        refused = True
    state = {k: v.clone() for k, v in model.state_dict().items()}  # buffers are live views
    full = engine.full_state_dict()
    model.load_state_dict(full)
    loss = lm_loss(model(ids), ids).item()
    return {
        "refused": refused,
        "mismatched": [
            (
                k,
                str(state[k].dtype),
                str(full[k].dtype),
                (state[k].cpu().float() - full[k].cpu().float()).abs().max().item(),
            )
            for k in full
            if not torch.equal(state[k].cpu(), full[k].cpu())
        ],
        "param_devices": {str(state[k].device) for k in ("embed.weight", "blocks.0.up.weight")},
        "loss": loss,
        "batchnorm": model.norm.running_mean.dtype,
    }


def test_cuda_stage3_model_access() -> None:
    for result in _on_two_gpus(_gpu_model_access):
        assert result["refused"]
        assert result["mismatched"] == []
        assert result["param_devices"] == {"cpu"}  # full values gathered to the host, unit by unit
        assert result["loss"] == result["loss"]  # finite, not NaN
        assert result["batchnorm"] == torch.bfloat16


def test_cuda_lightning_applies_sync_batchnorm() -> None:
    import lightning.pytorch as pl

    from lightning_zero import ZeroStrategy
    from tests.lightning_module import TinyLM

    module = TinyLM(batchnorm=True, batch_size=4, dataset_size=16)
    trainer = pl.Trainer(
        accelerator="gpu", devices=1, strategy=ZeroStrategy(stage=2), sync_batchnorm=True, max_steps=2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module)
    converted = [m for m in module.modules() if isinstance(m, torch.nn.SyncBatchNorm)]
    assert converted and not any(type(m) is torch.nn.BatchNorm1d for m in module.modules())
    assert trainer.global_step == 2


def _gpu_resume(rank: int, world_size: int, directory: str) -> dict:
    """Stage 3 on CUDA saves a sharded checkpoint; stage 2 on CUDA resumes it: the resumed steps give
    the uninterrupted run's losses."""
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.backends.cuda.matmul.allow_tf32 = False

    def engine_for(stage: int) -> tuple[torch.nn.Module, ZeroEngine]:
        torch.manual_seed(0)
        model = TinyTransformer().to(device)
        return model, ZeroEngine(model, make_optimizer("adamw", model), config_for(stage))

    model, engine = engine_for(3)
    train_clipped(model, engine, rank, range(2), device)
    engine.save_checkpoint(f"{directory}/ckpt")
    uninterrupted = train_clipped(model, engine, rank, range(2, 4), device)
    model, engine = engine_for(2)
    engine.load_checkpoint(f"{directory}/ckpt")
    resumed = train_clipped(model, engine, rank, range(2, 4), device)
    return {"uninterrupted": uninterrupted, "resumed": resumed}


def test_cuda_checkpoint_resumes_at_another_stage(tmp_path) -> None:
    for result in _on_two_gpus(_gpu_resume, str(tmp_path)):
        assert result["resumed"] == pytest.approx(result["uninterrupted"], rel=1e-5)


def _gpu_offload(rank: int, world_size: int, directory: str) -> dict:
    """offload_optimizer on a GPU: the offloaded units' master shards (pinned) and optimizer state in host
    memory, their gradient shards copied there, stepped on the host; losses as the in-memory run's (the
    host's fused kernel against the GPU's: rounding apart), the device holding less."""
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.backends.cuda.matmul.allow_tf32 = False
    results = {}
    for mode, stage, precision in [
        ("none", 3, None), ("cpu", 3, None), ("none", 2, "bf16"), ("cpu", 2, "bf16"), ("cpu", 1, None),
        ("nvme", 3, None),
    ]:  # fmt: skip
        engine, losses, before = _offloaded_run(
            device, rank, config_for(stage), precision, offload_optimizer=mode, offload_dir=directory
        )
        report = engine.memory_report()
        results[f"{mode}-{stage}-{precision}"] = {
            "losses": losses,
            "offloaded units": sum(unit.offloaded for unit in engine.unit_reports()),
            "state on the host": all(
                v.device.type == "cpu"
                for state in engine.optimizer.state.values()
                for v in state.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0
            ),
            "host bytes": report.host_bytes,
            "device bytes": report.device_bytes,
            "allocated on the device": torch.cuda.memory_allocated(device) - before,  # what is really alive there
            "optimizer state bytes": sum(
                v.untyped_storage().nbytes()
                for state in engine.optimizer.state.values()
                for v in state.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0
            ),
        }
        del engine
    return results


def _offloaded_run(
    device: torch.device, rank: int, config: ZeroConfig, precision: str | None, **offload: object
) -> tuple[ZeroEngine, list[float], int]:
    """Four clipped steps of the small model with ``config`` and the offload settings on ``device``: the engine,
    its losses, and what was allocated on the device before (what earlier runs left: nothing of theirs)."""
    gc.collect()
    before = torch.cuda.memory_allocated(device)
    torch.manual_seed(0)
    model = TinyTransformer(width=64).to(device)  # Adam's moments well above the allocator's rounding
    mixed = MixedPrecision(compute_dtype=torch.bfloat16) if precision else MixedPrecision()
    config = dataclasses.replace(config, mixed_precision=mixed, **offload)
    engine = ZeroEngine(model, make_optimizer("adamw", model), config)
    losses = train_clipped(model, engine, rank, range(4), device)
    torch.cuda.synchronize()
    return engine, losses, before


def test_cuda_offload_steps_on_the_host_and_trains_like_the_device(tmp_path) -> None:
    for results in _on_two_gpus(_gpu_offload, str(tmp_path)):
        for name in ("cpu-3-None", "nvme-3-None"):
            assert results[name]["losses"] == pytest.approx(results["none-3-None"]["losses"], rel=1e-4), name
        assert results["cpu-2-bf16"]["losses"] == pytest.approx(results["none-2-bf16"]["losses"], rel=1e-2)
        for name, result in results.items():
            assert (result["offloaded units"] > 0) == (not name.startswith("none")), name
            if not name.startswith("none"):
                assert result["state on the host"] and result["host bytes"] > 0, name
        assert results["cpu-3-None"]["device bytes"] < results["none-3-None"]["device bytes"] / 2
        saved = results["none-3-None"]["allocated on the device"] - results["cpu-3-None"]["allocated on the device"]
        # fp32 stage 3 in memory: the master shard is the compute shard; offloaded, the compute shard stays
        # on the device and the optimizer's moments leave it.
        assert saved >= results["cpu-3-None"]["optimizer state bytes"] * 0.9


def _gpu_step_in_backward(rank: int, world_size: int, directory: str) -> dict:
    """offload_step_in_backward on a GPU: each unit's gradient shard copied to the host right after its
    reduce-scatter, the worker waiting for it by an event; the same numbers as stepping in optimizer.step()."""
    device = torch.device("cuda", rank % torch.cuda.device_count())
    results = {}
    for mode, stage, early in [(m, s, e) for m in ("cpu", "nvme") for s in (1, 3) for e in (False, True)]:
        torch.manual_seed(0)
        model = TinyTransformer(width=64).to(device)
        config = dataclasses.replace(
            config_for(stage), offload_optimizer=mode, offload_dir=directory, offload_step_in_backward=early
        )
        engine = ZeroEngine(model, make_optimizer("adamw", model), config)
        losses = []
        for step in range(4):
            ids = batch(step, rank).to(device)
            loss = lm_loss(model(ids), ids)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        results[f"{mode}-{stage}-{early}"] = {"losses": losses, "weights": engine.full_state_dict()}
        del engine
    return results


def test_cuda_units_stepped_during_backward_train_exactly_as_in_the_step(tmp_path) -> None:
    for results in _on_two_gpus(_gpu_step_in_backward, str(tmp_path)):
        for mode in ("cpu", "nvme"):
            for stage in (1, 3):
                early, late = results[f"{mode}-{stage}-True"], results[f"{mode}-{stage}-False"]
                assert early["losses"] == late["losses"], (mode, stage)
                assert relative_difference(early["weights"], late["weights"]) == 0.0, (mode, stage)


def _gpu_param_offload(rank: int, world_size: int, directory: str) -> dict:
    """offload_params="cpu" on a GPU: the parameter shards rest in pinned host memory and are staged to the
    device on the all-gather's stream for each gather; with offload_optimizer="cpu" too, the device keeps no
    model state between steps. "nvme": the same through the shards' files."""
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.backends.cuda.matmul.allow_tf32 = False
    results = {}
    for optimizer_mode, params_mode, precision in [
        ("none", "none", None), ("none", "cpu", None), ("cpu", "cpu", None), ("none", "none", "bf16"),
        ("none", "cpu", "bf16"), ("none", "nvme", "bf16"), ("nvme", "nvme", None),
    ]:  # fmt: skip
        engine, losses, before = _offloaded_run(
            device, rank, config_for(3, prefetch=2), precision, offload_optimizer=optimizer_mode,
            offload_params=params_mode, offload_dir=directory,
        )  # fmt: skip
        report = engine.memory_report()
        reports = engine.unit_reports()
        results[f"{optimizer_mode}-{params_mode}-{precision}"] = {
            "losses": losses,
            "units offloaded": sum(r.params_offloaded for r in reports)
            == (len(reports) if params_mode != "none" else 0),
            "shard bytes": sum(r.shard_numel for r in reports) * (2 if precision else 4),
            "allocated on the device": torch.cuda.memory_allocated(device) - before,  # what is really alive there
            "pinned on the host": torch.cuda.host_memory_stats().get("active_bytes.current", 0),  # in use now
            "host bytes": report.host_bytes,
            "device bytes": report.device_bytes,
        }
        del engine
    return results


def test_cuda_parameter_shards_rest_pinned_on_the_host_and_train_like_the_device(tmp_path) -> None:
    for results in _on_two_gpus(_gpu_param_offload, str(tmp_path)):
        # The same arithmetic on the device (the staged copy is exact): equal losses; the host step rounds apart.
        assert results["none-cpu-None"]["losses"] == results["none-none-None"]["losses"]
        assert results["none-cpu-bf16"]["losses"] == results["none-none-bf16"]["losses"]
        assert results["cpu-cpu-None"]["losses"] == pytest.approx(results["none-none-None"]["losses"], rel=1e-4)
        # offload_params="nvme": the shards go through their files exactly.
        assert results["none-nvme-bf16"]["losses"] == results["none-none-bf16"]["losses"]
        assert results["nvme-nvme-None"]["losses"] == pytest.approx(results["none-none-None"]["losses"], rel=1e-4)
        for name, result in results.items():
            assert result["units offloaded"], name
            if "-cpu-" in name:
                assert result["host bytes"] >= result["shard bytes"], name
                assert result["pinned on the host"] >= result["shard bytes"], name  # the host shards are pinned
        # bf16: the device keeps the fp32 master and no longer the bf16 shard.
        saved = (
            results["none-none-bf16"]["allocated on the device"] - results["none-cpu-bf16"]["allocated on the device"]
        )
        assert saved >= 0.9 * results["none-cpu-bf16"]["shard bytes"]
        on_disk = (
            results["none-none-bf16"]["allocated on the device"] - results["none-nvme-bf16"]["allocated on the device"]
        )
        assert on_disk >= 0.9 * results["none-nvme-bf16"]["shard bytes"]
        # Both offloads: between steps no parameter shard, master or optimizer state is on the device (no staging
        # buffer left alive either: the allocation is what is really there).
        for both in ("cpu-cpu-None", "nvme-nvme-None"):
            assert results[both]["allocated on the device"] < 0.1 * results["none-none-None"]["allocated on the device"]


def _gpu_activation_offload(rank: int, world_size: int) -> dict:
    """offload_activations on a GPU: what the forward saves for backward waits in pinned host memory, so the
    device holds less after the forward; the backward brings it back exactly."""
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.backends.cuda.matmul.allow_tf32 = False
    results = {}
    for offload in (False, True):
        gc.collect()
        torch.manual_seed(0)
        model = TinyTransformer(width=256, blocks=4).to(device)
        config = dataclasses.replace(config_for(3), offload_activations=offload)
        engine = ZeroEngine(model, make_optimizer("adamw", model), config)
        losses, after_forward = [], []
        for step in range(3):
            ids = batch(step, rank, batch_size=64).to(device)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated(device)
            loss = lm_loss(model(ids), ids)
            torch.cuda.synchronize()
            after_forward.append(torch.cuda.memory_allocated(device) - before)  # what the forward left alive
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        results[offload] = {"losses": losses, "saved on the device": max(after_forward)}
        del engine, model
    return results


def test_cuda_activation_offload_keeps_saved_tensors_on_the_host() -> None:
    for results in _on_two_gpus(_gpu_activation_offload):
        assert results[True]["losses"] == results[False]["losses"]  # exact copies out and back
        assert results[True]["saved on the device"] < 0.5 * results[False]["saved on the device"], results
