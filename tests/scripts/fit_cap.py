"""One rank of a 2-rank job that trains the settings ``fit()`` chose, inside a memory cap the test set.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... python tests/scripts/fit_cap.py SPEC.json OUT

SPEC: {"settings": ZeroConfig's keyword arguments (wrap_policy aside: the blocks below), "micro_batch",
"accumulation", "checkpointing", "steps"}; {"settings": null} starts the rank, joins the process group and
stops (what a process holds besides training). Each rank writes OUT.<rank>.json: its losses, its peak
resident memory (VmHWM, its mapped libraries too) and that of setup and the first steps' phases; the test
reads the peak the cap holds to from the rank's cgroup. The model is a GPT
whose blocks each hold a lookup table (most of the parameters, cheap to compute), so that on two cores the
model states and the activations are both large beside what the process holds anyway.

Why a process of its own: each rank runs in its own memory cgroup, which a kept rank cannot join.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from zero_core import WrapPolicy, ZeroConfig, ZeroEngine
from zero_core.memory.fit import checkpoint_blocks

VOCAB, CLASSES, WIDTH, DEPTH, HEADS, SEQ = 16384, 256, 256, 8, 4, 512


class CapBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
        self.table = nn.Embedding(VOCAB, WIDTH)  # most of the block's parameters, for a lookup's compute

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        x = x + self.table(ids)
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, WIDTH))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class CapModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(CapBlock() for _ in range(DEPTH))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for index, block in enumerate(self.blocks):
            x = block(x, (ids * (index + 2)) % VOCAB)
        return self.head(self.norm(x))


CAP_UNITS = (CapBlock,)


def cap_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Predict the next id's class (the id mod CLASSES)."""
    return F.cross_entropy(model(ids)[:, :-1].flatten(0, 1), (ids[:, 1:] % CLASSES).flatten())


def sample_batch(samples: int, step: int, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(step * 7919 + rank)
    return torch.randint(0, VOCAB, (samples, SEQ), generator=generator)


def peak_resident_bytes(field: str = "VmHWM:") -> int:
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field))
    return int(line.split()[1]) * 1024


# (phase, peak and current resident bytes after it) for setup and the first two steps: where a peak that
# misses its prediction comes from, in the test's failure message.
PHASES: list[tuple[str, int, int]] = []


def _record(phase: str, step: int) -> None:
    if step < 2:
        PHASES.append((phase, peak_resident_bytes(), peak_resident_bytes("VmRSS:")))


def train(spec: dict) -> list[float]:
    torch.manual_seed(0)
    with torch.device("meta"):  # materialised a unit at a time by the engine, as a model too large for one rank is
        model = CapModel()
    if spec["checkpointing"]:
        blocks = tuple(f"blocks.{index}" for index in range(DEPTH))
        checkpoint_blocks(model, blocks)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = ZeroConfig(wrap_policy=WrapPolicy(module_classes=CAP_UNITS), **spec["settings"])
    engine = ZeroEngine(model, optimizer, config)
    _record("setup", 0)
    rank, losses = dist.get_rank(), []
    for step in range(spec["steps"]):
        total = 0.0
        for micro in range(spec["accumulation"]):
            loss = cap_loss(model, sample_batch(spec["micro_batch"], step * 64 + micro, rank))
            _record(f"{step} forward", step)
            engine.backward(loss / spec["accumulation"])
            total += loss.item() / spec["accumulation"]
            _record(f"{step} backward", step)
        engine.step()
        _record(f"{step} step", step)
        optimizer.zero_grad()
        losses.append(total)
    return losses


def main() -> None:
    spec, out = json.loads(Path(sys.argv[1]).read_text()), sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    losses = train(spec) if spec["settings"] is not None else []
    dist.barrier()
    report = {"losses": losses, "peak": peak_resident_bytes(), "phases": PHASES}
    Path(f"{out}.{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
