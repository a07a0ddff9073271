"""What ZeRO++'s quantization costs on its own: quantize + pack, unpack + dequantize, per element.

    python benchmarks/quantization_cost.py [--numel 84e6] [--threads 1] [--repeats 3] [--device cuda]

Times the quantizer the collectives use (``zero_core/quantization.py``) on one rank's tensors of the 168M
model on 2 ranks: qwZ quantizes a shard (numel / 2) and dequantizes the gathered unit (numel); qgZ
quantizes the full gradient (numel) and dequantizes what it receives (numel). Here the whole model is one
tensor; the engine does it unit by unit, in rows of at most 4M elements. Beside each: a bf16 copy of the
same elements, the cheapest thing the exact path does with them. Median of ``--repeats`` runs, in one
process with ``--threads`` threads (the harness gives each of 2 ranks one of the 2 cores).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from zero_core.quantization import dequantize_into, pack, quantize, unpack

BLOCK = 128


def _median_seconds(work: Callable[[], object], repeats: int, device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    work()  # warm up (a GPU's first kernels compile and allocate)
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        work()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=float, default=84e6, help="elements (default: half of the 168M model)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu or cuda: the GPU's throughput of the same torch ops")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    numel = int(args.numel)
    values = torch.randn(numel, dtype=torch.bfloat16, device=device)
    out = torch.empty(numel, dtype=torch.bfloat16, device=device)
    time_it = lambda work: _median_seconds(work, args.repeats, device)  # noqa: E731
    copy = time_it(lambda: out.copy_(values))
    where = device.type if device.type == "cuda" else f"{args.threads} thread(s)"
    print(f"{numel:,} elements, blocks of {BLOCK}, {where}; a bf16 copy: {copy:.4f} s")
    print("| bits | quantize + pack (s) | unpack + dequantize (s) | ns per element, both | x a bf16 copy |")
    print("|---|---|---|---|---|")
    for bits in (8, 4):
        packed = pack(quantize(values, BLOCK, bits))
        forth = time_it(lambda: pack(quantize(values, BLOCK, bits)))
        back = time_it(lambda: dequantize_into(out, unpack(packed, numel, bits=bits), BLOCK))
        per_element = (forth + back) / numel * 1e9
        print(f"| {bits} | {forth:.4f} | {back:.4f} | {per_element:.1f} | {(forth + back) / copy:.0f}x |")


if __name__ == "__main__":
    main()
