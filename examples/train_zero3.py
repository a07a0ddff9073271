"""ZeRO-3 in a plain PyTorch loop: a small GPT on CPU, one process per rank.

    python -m torch.distributed.run --nproc_per_node 2 examples/train_zero3.py [--stage 3] [--steps 30]

Prints the loss, and each rank's bytes of parameters, gradients and
optimizer state beside what plain data parallelism would hold.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import GPT, GPTBlock, GPTConfig, next_token_loss, synthetic_batch  # noqa: E402

from zero_core import WrapPolicy, ZeroConfig, ZeroEngine, expected_model_state_bytes  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    config = GPTConfig()
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    engine = ZeroEngine(
        model, optimizer, ZeroConfig(stage=args.stage, wrap_policy=WrapPolicy(module_classes=(GPTBlock,)))
    )
    for step in range(args.steps):
        ids = synthetic_batch(config, args.batch_size, step, rank)
        loss = next_token_loss(model(ids), ids)
        engine.backward(loss)
        engine.clip_grad_norm_(1.0)
        engine.step()
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)

    ids = synthetic_batch(config, args.batch_size, args.steps, rank)
    engine.backward(next_token_loss(model(ids), ids))  # gradients live: the steady-state peak
    report = engine.memory_report()
    ddp = expected_model_state_bytes(0, engine.num_parameters, world_size, engine.config.mixed_precision, 8)
    for r in range(world_size):
        if r == rank:
            print(
                f"rank {rank}: {engine.num_parameters:,} parameters, stage {args.stage}: "
                f"params {report.parameter_bytes / 2**20:.2f} MiB, grads {report.gradient_bytes / 2**20:.2f} MiB, "
                f"optimizer {report.optimizer_state_bytes / 2**20:.2f} MiB, "
                f"total {report.model_state_bytes / 2**20:.2f} MiB "
                f"(DDP would hold {ddp.model_state_bytes / 2**20:.2f} MiB)",
                flush=True,
            )
        dist.barrier()
    engine.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
