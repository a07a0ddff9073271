"""The contestants: one training step each, the same model, data and optimizer.

Each wraps a model and AdamW and exposes ``step(ids) -> loss`` (forward,
backward, optimizer step) and ``backward_only(ids)`` (to measure memory with
gradients alive). DeepSpeed is optional: building it raises ``Unavailable``.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from zero_core import WrapPolicy, ZeroConfig, ZeroEngine

LEARNING_RATE = 1e-3
CONTESTANTS = (
    "ddp",
    "ddp_zero_optimizer",
    "fsdp2",
    "fsdp2_no_reshard",
    "deepspeed1",
    "deepspeed2",
    "deepspeed3",
    "zero1",
    "zero2",
    "zero3",
    "zero1_overlap",
    "zero2_overlap",  # ZeroConfig(overlap_param_refresh=True)
)
# Run by benchmarks/offload.py beside their in-memory twins, not by run_all.py (they need a disk).
OFFLOAD_CONTESTANTS = (
    "zero1_cpu",  # ZeroConfig(offload_optimizer="cpu"): the step on the host (here: the same memory), fused
    "zero3_cpu",
    "zero1_nvme",  # ZeroConfig(offload_optimizer="nvme"), under ZERO_BENCH_OFFLOAD_DIR (default: the temp dir)
    "zero3_nvme",
    "zero3_params",  # ZeroConfig(offload_params="cpu"): the parameter shards on the host, staged per gather
    "zero3_cpu_params",  # both offloads
    "zero1_nvme_in_backward",  # ZeroConfig(offload_step_in_backward=True): each unit steps while backward goes on
    "zero3_nvme_in_backward",
    "zero3_infinity",  # ZeRO-Infinity: offload_optimizer="nvme" and offload_params="nvme"
    "zero3_infinity_in_backward",
    "deepspeed3_nvme",  # DeepSpeed ZeRO-3 with offload_optimizer nvme (its async I/O op needs libaio-dev)
    "deepspeed3_infinity",  # and offload_param nvme
)
# Muon for the hidden matrices and AdamW for the rest, split by name as a DeepSpeed config's "Muon" is
# (zero_core.MuonWithAuxAdamW): under DDP, and under ZeRO with each matrix stepped whole at an owner rank.
MUON_CONTESTANTS = ("ddp_muon", "zero1_muon", "zero3_muon")
STAGE_OF = {
    "ddp": 0,
    "ddp_muon": 0,
    "zero1_muon": 1,
    "zero3_muon": 3,
    "ddp_zero_optimizer": 1,
    "fsdp2": 3,
    "fsdp2_no_reshard": 3,
    "deepspeed1": 1,
    "deepspeed2": 2,
    "deepspeed3": 3,
    "zero1": 1,
    "zero2": 2,
    "zero3": 3,
    "zero1_overlap": 1,
    "zero2_overlap": 2,
    "zero1_cpu": 1,
    "zero3_cpu": 3,
    "zero1_nvme": 1,
    "zero3_nvme": 3,
    "zero3_params": 3,
    "zero3_cpu_params": 3,
    "zero1_nvme_in_backward": 1,
    "zero3_nvme_in_backward": 3,
    "zero3_infinity": 3,
    "zero3_infinity_in_backward": 3,
    "deepspeed3_nvme": 3,
    "deepspeed3_infinity": 3,
    # ZeRO++ and hybrid sharding with the ranks as two "nodes" (world size / 2 ranks each).
    "zero3_hybrid": 3,
    "zero3_qwz": 3,
    "zero3_qgz": 3,
    "zero3_zeropp": 3,
}
# Their settings; a node is half the ranks.
WIRE = {
    "zero3_hybrid": lambda node: {"shard_group_size": node},
    "zero3_qwz": lambda node: {"quantize_weights": True},
    "zero3_qgz": lambda node: {"quantize_gradients": True},
    "zero3_zeropp": lambda node: {
        "quantize_weights": True,
        "quantize_gradients": True,
        "secondary_shard_group_size": node,
    },
}


class Unavailable(RuntimeError):
    """The contestant cannot run here (a missing optional package)."""


@dataclass
class Contestant:
    name: str
    model: nn.Module
    loss_of: Callable[[torch.Tensor], torch.Tensor]
    backward: Callable[[torch.Tensor], None]
    optimizer_step: Callable[[], None]
    engine: ZeroEngine | None = None
    comm_counter: dict[str, int] | None = None

    def backward_only(self, ids: torch.Tensor) -> float:
        loss = self.loss_of(ids)
        self.backward(loss)
        return loss.item()

    def step(self, ids: torch.Tensor) -> float:
        loss = self.backward_only(ids)
        self.optimizer_step()
        return loss

    def phases(self, ids: torch.Tensor, losses: list[float]) -> list[Callable[[], None]]:
        """``step`` as forward, backward and optimizer step, to time each (the loss goes to ``losses``)."""
        held: list[torch.Tensor] = []
        return [
            lambda: held.append(self.loss_of(ids)),
            lambda: (self.backward(held[0]), losses.append(held.pop().item())),
            self.optimizer_step,
        ]


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LEARNING_RATE, weight_decay=0.0)


def _optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    """AdamW, or for the Muon contestants MuonWithAuxAdamW as a DeepSpeed config's "Muon" section builds it."""
    if not name.endswith("_muon"):
        return _adamw(model.parameters())
    from zero_core.deepspeed import build_optimizer

    section = {"type": "Muon", "params": {"lr": LEARNING_RATE, "muon_lr": 0.02}}
    return build_optimizer(section, [p for p in model.parameters() if p.requires_grad], model=model)


def _counting_allreduce_hook(counter: dict[str, int]) -> Callable:
    """DDP's default all-reduce, counting what it sends (a public comm-hook API)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(state, bucket):  # noqa: ANN001, ANN202 - DDP checks these annotations literally
        buffer = bucket.buffer()
        counter["all_reduce_calls"] = counter.get("all_reduce_calls", 0) + 1
        counter["all_reduce_bytes"] = counter.get("all_reduce_bytes", 0) + buffer.numel() * buffer.element_size()
        return allreduce_hook(state, bucket)

    return hook


def build(name: str, model: nn.Module, block: type[nn.Module], loss_fn: Callable) -> Contestant:
    if name in ("ddp", "ddp_zero_optimizer", "ddp_muon"):
        ddp = nn.parallel.DistributedDataParallel(model)
        counter: dict[str, int] = {}
        ddp.register_comm_hook(None, _counting_allreduce_hook(counter))
        if name != "ddp_zero_optimizer":
            optimizer = _optimizer(name, ddp)
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            optimizer = ZeroRedundancyOptimizer(
                ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=LEARNING_RATE, weight_decay=0.0
            )
        return Contestant(
            name,
            ddp,
            lambda ids: loss_fn(ddp(ids), ids),
            lambda loss: loss.backward(),
            lambda: (optimizer.step(), optimizer.zero_grad(set_to_none=True)),
            comm_counter=counter,
        )
    if name.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard

        reshard = name == "fsdp2"
        for module in model.modules():
            if isinstance(module, block):
                fully_shard(module, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
        optimizer = _adamw(model.parameters())
        return Contestant(
            name,
            model,
            lambda ids: loss_fn(model(ids), ids),
            lambda loss: loss.backward(),
            lambda: (optimizer.step(), optimizer.zero_grad(set_to_none=True)),
        )
    directory = os.environ.get("ZERO_BENCH_OFFLOAD_DIR", tempfile.gettempdir())
    if name.startswith("deepspeed"):
        nvme_path = directory if name.endswith(("_nvme", "_infinity")) else None
        return _deepspeed(STAGE_OF[name], model, loss_fn, nvme_path, params_too=name.endswith("_infinity"))
    stage = STAGE_OF[name]
    offload: dict[str, Any] = {}
    kind = name.removesuffix("_muon")
    if kind.endswith("_in_backward"):
        kind, offload = kind.removesuffix("_in_backward"), {"offload_step_in_backward": True}
    if kind.endswith("_infinity"):
        offload.update(offload_optimizer="nvme", offload_params="nvme", offload_dir=directory)
    elif kind.endswith("_nvme"):
        offload.update(offload_optimizer="nvme", offload_dir=directory)
    elif "_cpu" in kind:
        offload.update(offload_optimizer="cpu")
    if kind.endswith("_params"):
        offload["offload_params"] = "cpu"
    if kind in WIRE:
        offload.update(WIRE[kind](max(1, dist.get_world_size() // 2)))
    config = ZeroConfig(
        stage=stage, wrap_policy=WrapPolicy((block,)), overlap_param_refresh=kind.endswith("_overlap"), **offload
    )
    engine = ZeroEngine(model, _optimizer(name, model), config)
    return Contestant(name, model, lambda ids: loss_fn(model(ids), ids), engine.backward, engine.step, engine=engine)


def _deepspeed(
    stage: int, model: nn.Module, loss_fn: Callable, nvme_path: str | None = None, params_too: bool = False
) -> Contestant:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError as error:
        raise Unavailable(f"deepspeed is not installed ({error}); pip install deepspeed") from error
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 0.0,  # DeepSpeed would clip at 1.0 otherwise; nobody else clips here
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
    }
    name = f"deepspeed{stage}"
    if nvme_path is not None:  # ZeRO-Infinity: the optimizer state through DeepSpeed's async I/O swapper
        name += "_nvme"
        config["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path}
        config["aio"] = {"block_size": 1048576, "queue_depth": 8, "single_submit": False, "overlap_events": True}
    if params_too:  # and the fp32 parameter partitions through its parameter swapper
        name = f"deepspeed{stage}_infinity"
        config["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": nvme_path}
    optimizer = _adamw(model.parameters())
    if nvme_path is not None:  # DeepSpeed's own fast path for an offloaded step: its SIMD CPU Adam(W)
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        optimizer = DeepSpeedCPUAdam(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0, adamw_mode=True)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return Contestant(name, engine, lambda ids: loss_fn(engine(ids), ids), engine.backward, engine.step)
