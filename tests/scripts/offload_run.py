"""A torchrun job with offload_optimizer="nvme", for what only a real process exit shows.

    python -m torch.distributed.run --nproc_per_node 2 tests/scripts/offload_run.py OFFLOAD_DIR OUT [--crash]

Trains 3 steps in memory (with torch's fused AdamW, the kernel the offloaded step takes on the host, and
with torch's default per-tensor AdamW) and 3 with the NVMe tier from the same start; rank 0 writes the
runs' losses to OUT. With --crash every rank kills itself after one offloaded step (SIGKILL: no clean-up
runs), leaving its scratch directory for the next run to recognise and remove.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.models import Block, TinyTransformer, batch, lm_loss, make_optimizer  # noqa: E402
from zero_core import WrapPolicy, ZeroConfig, ZeroEngine  # noqa: E402


def train(offload: str, directory: str, crash: bool, optimizer: str = "adamw") -> list[float]:
    torch.manual_seed(0)
    model = TinyTransformer(batchnorm=False)
    config = ZeroConfig(
        stage=3, wrap_policy=WrapPolicy(module_classes=(Block,)), offload_optimizer=offload, offload_dir=directory
    )
    engine = ZeroEngine(model, make_optimizer(optimizer, model), config)
    losses = []
    for step in range(3):
        ids = batch(step, dist.get_rank())
        loss = lm_loss(model(ids), ids)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if crash:
            os.kill(os.getpid(), signal.SIGKILL)
    return losses


def main() -> None:
    directory, out, crash = sys.argv[1], Path(sys.argv[2]), "--crash" in sys.argv
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    fused = train("none", directory, crash=False, optimizer="adamw-fused")
    per_tensor = train("none", directory, crash=False)
    offloaded = train("nvme", directory, crash)
    if dist.get_rank() == 0:
        runs = {"in memory, fused": fused, "in memory, per-tensor": per_tensor, "offloaded": offloaded}
        out.write_text(json.dumps(runs))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
