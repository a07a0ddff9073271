"""A stage-3 GPT job whose optimizer state decides whether it fits a memory cap.

    python -m torch.distributed.run --nproc_per_node 2 tests/scripts/offload_cap.py MODES OFFLOAD_DIR OUT [CGROUP]

MODES is one or more of "none", "nvme" (offload_optimizer, one unit's state in memory at a time) and
"nvme-resume", joined by "+": each is a run of its own, one after the other in the same processes. Each
trains 3 steps of a 71M-parameter GPT (10 blocks of width 768) from the same start. "nvme-resume" also saves
a checkpoint after the second step, and after the third loads it and takes the third step again ("resumed":
its loss): a save and a load read and write the offloaded state a unit at a time, so they fit where training
fits. Rank 0 writes to OUT, by mode: the losses, and the peak of the memory cgroup CGROUP (a directory of
the v1 controller, the job's own) when that run ended ("peak": what a job of that run alone would have peaked
at, if it came first; None without CGROUP); and the bytes of optimizer state the in-memory run would hold on
all ranks ("state bytes").
"""

from __future__ import annotations

import contextlib
import gc
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from gpt import GPT, GPTBlock, GPTConfig, next_token_loss, synthetic_batch  # noqa: E402

from zero_core import WrapPolicy, ZeroConfig, ZeroEngine  # noqa: E402
from zero_core.host_memory import release_freed_memory  # noqa: E402


def _status_bytes(field: str) -> int:
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field))
    return int(line.split()[1]) * 1024


@contextlib.contextmanager
def peak_growth(grown: dict[str, int], phase: str) -> Iterator[None]:
    """The most this process's resident memory grew during the block (its peak, reset first, less where it was)."""
    release_freed_memory()  # what the heap keeps of freed memory is not counted as where it was
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from now
    before = _status_bytes("VmRSS:")
    yield
    grown[phase] = _status_bytes("VmHWM:") - before


def cgroup_peak(group: Path | None) -> int | None:
    """The most memory the cgroup (v1 memory controller) has used so far: its processes' and page cache."""
    return int((group / "memory.max_usage_in_bytes").read_text()) if group is not None else None


def run(mode: str, directory: str, config: GPTConfig) -> dict:
    """One run of ``mode``: this rank's losses and, for "nvme-resume", how far its memory grew in the save and load."""
    torch.manual_seed(0)
    with torch.device("meta"):  # materialised unit by unit: setup never holds the whole model
        model = GPT(config)
    # fused: the kernel the offloaded step picks on the host, so both runs compute the same update bit for bit
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    settings = ZeroConfig(
        stage=3,
        wrap_policy=WrapPolicy(module_classes=(GPTBlock,)),
        offload_optimizer=mode.removesuffix("-resume"),
        offload_dir=directory,
        offload_units_in_memory=1,
    )
    engine = ZeroEngine(model, optimizer, settings)

    def train(step: int) -> float:
        ids = synthetic_batch(config, 2, step, dist.get_rank())
        loss = next_token_loss(model(ids), ids)
        engine.backward(loss)
        engine.step()
        return loss.item()

    losses = [train(0), train(1)]
    checkpoint = Path(directory) / "checkpoint"
    grown: dict[str, int] = {}  # how far this process's memory grew above where it was, during the save and load
    if mode == "nvme-resume":
        with peak_growth(grown, "save"):
            engine.save_checkpoint(checkpoint)
    losses.append(train(2))
    resumed = None
    if mode == "nvme-resume":
        with peak_growth(grown, "load"):
            engine.load_checkpoint(checkpoint)
        resumed = train(2)
    return {"losses": losses, "resumed": resumed, "grown": grown, "num_parameters": engine.num_parameters}


def main() -> None:
    modes, directory, out = sys.argv[1].split("+"), sys.argv[2], Path(sys.argv[3])
    group = Path(sys.argv[4]) if len(sys.argv) > 4 else None  # the memory cgroup the job runs in
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    config = GPTConfig(width=768, depth=10, heads=12)
    report: dict = {}
    for mode in modes:
        result = run(mode, directory, config)  # its engine and model are gone when it returns
        gc.collect()
        every_rank: list = [None] * dist.get_world_size()
        dist.all_gather_object(every_rank, result["grown"])  # also: every rank's run has ended
        most_grown = {phase: max(g[phase] for g in every_rank) for phase in result["grown"]}
        report[mode] = {"losses": result["losses"], "resumed": result["resumed"], "grown": most_grown}
        report[mode]["peak"] = cgroup_peak(group)
        report["state bytes"] = 8 * result["num_parameters"]  # Adam's two fp32 moments, over all ranks
    if dist.get_rank() == 0:
        out.write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
