"""One contestant, one model size: step time, model-state memory, traffic, losses.

    torchrun --nproc_per_node 2 benchmarks/harness.py --contestant zero3 --size medium --out result.json

Launched once per contestant so peak resident memory is its own. Rank 0
writes the JSON. Memory of model states is measured, not predicted: every
live tensor storage once (after backward, with gradients and optimizer
state alive, activations freed).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from contestants import STAGE_OF, Unavailable, build  # noqa: E402
from gpt import GPT, GPTBlock, GPTConfig, next_token_loss, synthetic_batch  # noqa: E402
from profile_breakdown import profile_step  # noqa: E402

SIZES = {
    "small": (GPTConfig(vocab_size=2048, seq_len=64, width=256, depth=4, heads=4), 8),
    "medium": (GPTConfig(vocab_size=8192, seq_len=128, width=512, depth=8, heads=8), 4),
    # 168M parameters: where the per-step costs that grow with the model show.
    "large": (GPTConfig(vocab_size=16384, seq_len=128, width=1024, depth=12, heads=16), 2),
}
PHASES = ("forward", "backward", "optimizer step")


def live_tensor_bytes() -> int:
    gc.collect()
    warnings.simplefilter("ignore")  # isinstance() on deprecated torch objects warns
    seen, total = set(), 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            try:
                storage = obj.untyped_storage()
                pointer = storage.data_ptr()
            except (RuntimeError, NotImplementedError):
                continue  # wrapper subclasses (DTensor) own no storage; their local tensor is counted
            if pointer and pointer not in seen:
                seen.add(pointer)
                total += storage.nbytes()
    return total


def gather_ints(value: int) -> list[int]:
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    values = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(values, torch.tensor([value], dtype=torch.int64, device=device))
    return [int(v) for v in values]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contestant", required=True)
    parser.add_argument("--size", choices=SIZES, default="small")
    parser.add_argument("--depth", type=int, default=None, help="override the number of blocks")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL, one GPU per process")
    args = parser.parse_args()

    on_gpu = args.device == "cuda"
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world_size))))
    config, batch_size = SIZES[args.size]
    if args.depth is not None:
        config = GPTConfig(**{**config.__dict__, "depth": args.depth})
    torch.manual_seed(0)
    model = GPT(config).to(device)
    numel = sum(p.numel() for p in model.parameters())
    baseline = live_tensor_bytes() - sum(
        t.untyped_storage().nbytes() for t in list(model.parameters()) + list(model.buffers())
    )
    result: dict = {
        "contestant": args.contestant,
        "size": args.size,
        "depth": config.depth,
        "world_size": world_size,
        "device": args.device,
        "numel": numel,
        "stage": STAGE_OF[args.contestant],
    }
    try:
        contestant = build(args.contestant, model, GPTBlock, next_token_loss)
    except Unavailable as error:
        result["skipped"] = str(error)
        if rank == 0:
            Path(args.out).write_text(json.dumps(result, indent=1))
        return

    losses, times, phase_times = [], [], []
    for step in range(args.warmup + args.steps):
        ids = synthetic_batch(config, batch_size, step, rank).to(device)
        if contestant.comm_counter is not None:
            contestant.comm_counter.clear()
        dist.barrier()
        marks = [time.perf_counter()]
        for phase in contestant.phases(ids, losses):
            phase()
            if on_gpu:
                torch.cuda.synchronize()
            marks.append(time.perf_counter())
        # A step (and each phase) takes as long as its slowest rank.
        elapsed = torch.tensor(
            [marks[-1] - marks[0]] + [b - a for a, b in zip(marks, marks[1:])], device=device, dtype=torch.float64
        )
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if step >= args.warmup:
            times.append(float(elapsed[0]))
            phase_times.append(elapsed[1:].tolist())
    traffic = {}
    if contestant.engine is not None:
        traffic = {
            kind: {"calls": c.calls, "bytes": c.bytes} for kind, c in contestant.engine.last_step_traffic.items()
        }
    elif contestant.comm_counter:
        traffic = {
            "all_reduce": {
                "calls": contestant.comm_counter["all_reduce_calls"],
                "bytes": contestant.comm_counter["all_reduce_bytes"],
            }
        }

    # The peak of the timed steps: the profiler's own buffers must not count in it.
    peak_before_profile = (
        torch.cuda.max_memory_allocated() if on_gpu else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    # One more step under the torch profiler (after the timed ones: its overhead must not count).
    dist.barrier()
    profiled = profile_step(contestant.phases(synthetic_batch(config, batch_size, 998, rank).to(device), []))
    contestant.backward_only(
        synthetic_batch(config, batch_size, 999, rank).to(device)
    )  # gradients alive: the steady-state peak
    state_bytes = gather_ints(live_tensor_bytes() - baseline)
    breakdown = vars(contestant.engine.memory_report()) if contestant.engine is not None else None
    if contestant.engine is not None:
        # Between steps (offload_step_in_backward's units were stepping during that backward: some of their
        # state was in memory then): what the NVMe tier holds on disk, written and read once per step.
        contestant.optimizer_step()
        breakdown["nvme_bytes_between_steps"] = contestant.engine.memory_report().nvme_bytes
    peak_rss = gather_ints(peak_before_profile)  # on a GPU: peak allocated device memory
    result.update(
        median_step_s=statistics.median(times),
        step_times_s=times,
        phase_median_s={name: statistics.median(t[i] for t in phase_times) for i, name in enumerate(PHASES)},
        first_loss=losses[0],
        last_loss=losses[-1],
        model_state_bytes=state_bytes,
        breakdown=breakdown,
        peak_rss_bytes=peak_rss,
        traffic=traffic,
        profile=profiled,
    )
    if rank == 0:
        Path(args.out).write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
