"""CUDA paths: collectives on their own streams, ordered with events.

Skipped without a GPU. NCCL runs whenever there is a GPU per rank: at world
size 1 the collectives are copies, still issued on the side streams and
ordered with events, so the stream path runs on a single GPU. Two ranks on
one GPU use gloo (its CUDA collectives stage through the host, no side
streams). A missing stream dependency shows up as stages disagreeing with
each other and with plain training (they agree to rounding on the CPU).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from zero_core import MixedPrecision, ZeroEngine

from .distributed import run_distributed
from .models import TinyTransformer, batch, lm_loss, make_optimizer
from .workers import config_for

pytestmark = [pytest.mark.distributed, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


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
            run = []
            for step in range(6):
                ids = batch(step % 2, rank).to(device)
                loss = lm_loss(model(ids), ids)
                engine.backward(loss)
                engine.clip_grad_norm_(1.0)
                engine.step()
                run.append(loss.item())
            losses[f"{stage}-{dtype}"] = run
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
    world_size = 2
    backend = "nccl" if torch.cuda.device_count() >= world_size else "gloo"
    for result in run_distributed(_gpu_model_access, world_size, backend=backend):
        assert result["refused"]
        assert result["mismatched"] == []
        assert result["param_devices"] == {"cpu"}  # full values gathered to the host, unit by unit
        assert result["loss"] == result["loss"]  # finite, not NaN
        assert result["batchnorm"] == torch.bfloat16


def test_cuda_lightning_applies_sync_batchnorm() -> None:
    import lightning.pytorch as pl

    from lightning_zero import ZeroStrategy

    from .lightning_module import TinyLM

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
    """Stage 3 on CUDA saves a sharded checkpoint; stage 2 on CUDA resumes it (and a one-process
    optimizer state loads into the shards): the resumed steps give the uninterrupted run's losses."""
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.backends.cuda.matmul.allow_tf32 = False

    def engine_for(stage: int) -> tuple[torch.nn.Module, ZeroEngine]:
        torch.manual_seed(0)
        model = TinyTransformer().to(device)
        return model, ZeroEngine(model, make_optimizer("adamw", model), config_for(stage))

    def train(model: torch.nn.Module, engine: ZeroEngine, steps: range) -> list[float]:
        losses = []
        for step in steps:
            ids = batch(step % 2, rank).to(device)
            loss = lm_loss(model(ids), ids)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses

    model, engine = engine_for(3)
    train(model, engine, range(2))
    engine.save_checkpoint(f"{directory}/ckpt")
    uninterrupted = train(model, engine, range(2, 4))
    model, engine = engine_for(2)
    engine.load_checkpoint(f"{directory}/ckpt")
    resumed = train(model, engine, range(2, 4))
    return {"uninterrupted": uninterrupted, "resumed": resumed}


def test_cuda_checkpoint_resumes_at_another_stage(tmp_path) -> None:
    world_size = 2
    backend = "nccl" if torch.cuda.device_count() >= world_size else "gloo"
    for result in run_distributed(_gpu_resume, world_size, str(tmp_path), backend=backend):
        assert result["resumed"] == pytest.approx(result["uninterrupted"], rel=1e-5)
