"""Which host AdamW is fastest on this machine's optimizer shards, and how far from torch's default each is.

    python benchmarks/host_adam.py [--numel 84000000] [--steps 3]

The offloaded step runs the user's optimizer on host memory; torch has three CPU implementations of
Adam/AdamW (a per-tensor loop, ``foreach`` and ``fused``). Times one step of each on one fp32 shard
(default: one rank's share of the 168M model at 2 ranks) after a warm-up, with the threads torch uses,
and the largest difference of the updated weights from the default implementation's.
"""

from __future__ import annotations

import argparse
import time

import torch

VARIANTS = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def time_variant(options: dict, numel: int, steps: int, pieces: int) -> tuple[float, torch.Tensor]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel // pieces)) for _ in range(pieces)]
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **options)
    grads = [torch.randn_like(p) for p in params]
    timings = []
    for _ in range(steps + 1):  # the first step allocates the state
        for p, g in zip(params, grads):
            p.grad = g
        start = time.perf_counter()
        optimizer.step()
        timings.append(time.perf_counter() - start)
    return sorted(timings[1:])[len(timings[1:]) // 2], torch.cat([p.detach() for p in params])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=84_000_000)
    parser.add_argument("--pieces", type=int, default=12, help="tensors in the shard (one per unit)")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.numel / 1e6:.0f}M fp32 elements")
    results = {name: time_variant(opts, args.numel, args.steps, args.pieces) for name, opts in VARIANTS.items()}
    reference = results["foreach"][1]
    for name, (seconds, weights) in results.items():
        difference = (weights - reference).abs().max().item()
        rate = args.numel * 4 * 4 / seconds / 2**30  # param, grad, two moments read; param, moments written
        print(f"{name:>9}: {seconds:.3f} s per step ({rate:.1f} GiB/s of state), max |w - foreach| {difference:.2e}")


if __name__ == "__main__":
    main()
