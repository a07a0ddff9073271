"""What one collective over a model's worth of bytes costs on this machine, alone: the floor under a stage's
communication when nothing else runs.

    torchrun --nproc_per_node 2 benchmarks/collective_cost.py [--numel 168e6] [--repeats 5]

On one machine with gloo every byte "sent" is copied by the CPUs through the loopback, on the same cores
that compute the step. So a collective here is work, not waiting, and overlapping it with the backward
hides little: stage 3, which moves 3Ψ per step where DDP moves 2Ψ (an all-gather in the forward, one in
the backward, a reduce-scatter; against DDP's all-reduce, a reduce-scatter and an all-gather), pays for its
extra all-gather in full. This prints the median seconds of an all-reduce, a reduce-scatter and an
all-gather of ``--numel`` fp32 elements (in units of the size the benchmarks' wrapped blocks have), so that
cost can be set beside the step times the guard measures (benchmarks/NOTES.md): torch's list forms, and the
engine's own ``zero_core.collectives`` calls, which on gloo run as one broadcast per rank on the flat buffer
in place (``CommContext.uses_rooted_collectives``) and, over two ranks, reduce-scatter as one exchange of
slices (one reduce per rank otherwise, and when the handle is polled). The engine's are what a step pays.

Beside each wall time it prints the CPU time the busiest rank's process spent (every thread of it, gloo's
included), with each rank on its own cores as the guard places them (``--pin 0``: where the scheduler puts
them): with one core per rank that CPU is taken from the step's compute, whatever overlaps what.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from zero_core.collectives import CommContext
from zero_core.collectives import all_gather as engine_all_gather
from zero_core.collectives import reduce_scatter as engine_reduce_scatter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rank_cores import take_own_cores  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--numel", type=float, default=168e6, help="fp32 elements in all (the 168M model)")
    parser.add_argument("--units", type=int, default=14, help="collectives per pass, as the model's units")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pin", type=int, default=1, help="1: each rank on its own cores, as the guard runs")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(take_own_cores(rank, size, bool(args.pin)))  # as the guard's ranks are placed
    per_unit = int(args.numel) // args.units // size * size
    full = [torch.ones(per_unit) for _ in range(args.units)]
    shards = [torch.ones(per_unit // size) for _ in range(args.units)]

    def all_reduce() -> None:
        for tensor in full:
            dist.all_reduce(tensor)

    def reduce_scatter() -> None:  # the list form: native on gloo
        for tensor, shard in zip(full, shards):
            dist.reduce_scatter(shard, list(tensor.chunk(size)))

    def all_gather() -> None:
        for tensor, shard in zip(full, shards):
            dist.all_gather(list(tensor.chunk(size)), shard)

    comm = CommContext.create(None, torch.device("cpu"))

    def engine_reduce_scatter_all(polled: bool = False) -> None:  # as a unit's gradients: into a shard of its own
        for tensor, shard in zip(full, shards):
            engine_reduce_scatter(comm, shard, tensor, polled=polled).wait()

    def engine_all_gather_all() -> None:
        for tensor, shard in zip(full, shards):
            engine_all_gather(comm, tensor, shard).wait()

    runs = (
        ("all_reduce", all_reduce),
        ("reduce_scatter", reduce_scatter),
        ("all_gather", all_gather),
        ("engine reduce_scatter", engine_reduce_scatter_all),
        # The form offload_step_in_backward keeps (its handles are polled): one rooted reduce per rank.
        ("engine reduce_scatter, polled", lambda: engine_reduce_scatter_all(polled=True)),
        ("engine all_gather", engine_all_gather_all),
    )
    for name, run in runs:
        times, cpu_times = [], []
        for _ in range(args.repeats + 1):
            dist.barrier()
            started, started_cpu = time.perf_counter(), time.process_time()
            run()
            times.append(time.perf_counter() - started)
            cpu_times.append(time.process_time() - started_cpu)
        # The first pass faults the buffers in. The busiest rank's CPU: the one whose compute loses the most.
        busiest = torch.tensor(statistics.median(cpu_times[1:]), dtype=torch.float64)
        dist.all_reduce(busiest, op=dist.ReduceOp.MAX)
        if rank == 0:
            median = statistics.median(times[1:])
            print(
                f"{name}: {median:.3f} s, CPU {busiest.item():.3f} s a rank, for {per_unit * args.units:,} fp32 "
                f"elements over {size} ranks",
                flush=True,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
