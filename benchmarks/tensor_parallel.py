"""ZeRO × tensor parallelism beside FSDP2 × tensor parallelism, on one 2-D mesh, in one run.

    torchrun --nproc_per_node 4 benchmarks/tensor_parallel.py --out benchmarks/results/tensor_parallel.json
    python benchmarks/tensor_parallel.py --report benchmarks/results/tensor_parallel.json

The run writes its records (``--out``) and, beside ``benchmarks/results/``, ``benchmarks/TENSOR_PARALLEL.md``
from them (``--page`` names another); ``--report`` rewrites that page from saved records without running.

A Llama-style model (heads and SwiGLU columns split, RMSNorms sequence-parallel: torchtitan's plan) is
split over ``mesh["tensor_parallel"]`` (2 ranks); then either our engine (stages 1-3) or FSDP2's
``fully_shard`` (per layer and the root, over ``mesh["data_parallel"]``) shards it over the other 2.
Every contestant trains the same model from the same seed on the same batches (fp32 AdamW, no clipping).
The contestants take turns, a few steps each per round, so slow drifts of the machine fall on all of
them alike. Reported: the median step time of the slowest rank, its ratio to FSDP2 + TP, and the losses
(which must agree). Rank 0 writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.tensor_parallel_model import Layer, LlamaSize, TinyLlama, loss_of, parallelize  # noqa: E402
from zero_core import WrapPolicy, ZeroConfig, ZeroEngine, tensor_parallel_mesh  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_all import machine  # noqa: E402

HERE = Path(__file__).resolve().parent
SIZE = LlamaSize(vocab=8192, width=512, heads=8, hidden=1408, layers=6)
SEQUENCE, BATCH, TP = 128, 2, 2
CONTESTANTS = ("fsdp2_tp", "zero1_tp", "zero2_tp", "zero3_tp")


class Contestant:
    """A split model, its optimizer, and one training step."""

    def __init__(self, name: str, mesh: object):
        torch.manual_seed(0)
        self.model = parallelize(TinyLlama(SIZE), mesh["tensor_parallel"])
        if name == "fsdp2_tp":
            for layer in self.model.layers:
                fully_shard(layer, mesh=mesh["data_parallel"])
            fully_shard(self.model, mesh=mesh["data_parallel"])
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.engine = None
        if name.startswith("zero"):
            config = ZeroConfig(stage=int(name[4]), wrap_policy=WrapPolicy(module_classes=(Layer,)))
            self.engine = ZeroEngine(self.model, self.optimizer, config, device_mesh=mesh)
        self.backward: Callable[[torch.Tensor], None] = self.engine.backward if self.engine else torch.Tensor.backward

    def step(self, ids: torch.Tensor) -> float:
        loss = loss_of(self.model(ids), ids)
        self.backward(loss)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss.item()


def batch(step: int, dp_rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + dp_rank)
    return torch.randint(0, SIZE.vocab, (BATCH, SEQUENCE), generator=generator)


def slowest(seconds: float) -> float:
    value = torch.tensor([seconds])
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def page(result: dict) -> str:
    """TENSOR_PARALLEL.md from a run's records."""
    losses = result["losses"]
    reference = losses["fsdp2_tp"]
    agree = all(values == reference for values in losses.values())
    steps = len(reference)
    rounds, timed = result.get("rounds", 4), result.get("steps", 3)
    lines = [
        "# ZeRO × tensor parallelism beside FSDP2 × tensor parallelism",
        "",
        "Regenerate with `torchrun --nproc_per_node 4 benchmarks/tensor_parallel.py --out "
        "benchmarks/results/tensor_parallel.json` (or `python benchmarks/tensor_parallel.py --report "
        "benchmarks/results/tensor_parallel.json` to rewrite this page from the saved records).",
        "",
        f"Machine: {result.get('machine', 'not recorded')}. Date: {result.get('date', 'not recorded')}.",
        f"Versions: {', '.join(f'{k} {v}' for k, v in result['versions'].items())}."
        + (f" Wall time of the run: {result['wall_s']:.0f} s." if "wall_s" in result else ""),
        "",
        f"Model: Llama-style, {result['model_parameters']:,} parameters (vocabulary {SIZE.vocab}, width {SIZE.width}, "
        f"{SIZE.heads} heads, SwiGLU hidden {SIZE.hidden},",
        f"{SIZE.layers} layers, sequence {SEQUENCE}, micro-batch {BATCH} per data-parallel rank). "
        f"Mesh: {result['mesh']}.",
        'Every contestant splits the model with the same plan over `mesh["tensor_parallel"]` (torchtitan\'s:',
        "attention heads and SwiGLU columns split, RMSNorms sequence-parallel), then shards it over",
        '`mesh["data_parallel"]`: FSDP2\'s `fully_shard` per layer and at the root, or our engine',
        "(`ZeroEngine(device_mesh=mesh)`, one unit per layer). fp32 AdamW, no clipping, same seed and batches.",
        f"The contestants take turns, {timed} timed steps each per round, {rounds} rounds, "
        "after one untimed step each;",
        "the step time is the median over the slowest rank.",
        "",
        "| contestant | median step (s) | vs FSDP2 + TP |",
        "|---|---|---|",
    ]
    labels = {"fsdp2_tp": "fsdp2_tp (FSDP2 ZeRO-3 + TP)"}
    for name in CONTESTANTS:
        lines.append(
            f"| {labels.get(name, name)} | {result['median_step_s'][name]:.3f} | {result['vs_fsdp2_tp'][name]:.2f}x |"
        )
    verdict = "agree bit for bit" if agree else "do NOT agree"
    lines += [
        "",
        f"The losses of all four {verdict} at every one of the {steps} steps "
        f"(first {reference[0]:.4f}, last {reference[-1]:.4f}).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per contestant per round")
    parser.add_argument("--out", type=Path, help="the records (JSON) to write")
    parser.add_argument("--page", type=Path, default=HERE / "TENSOR_PARALLEL.md", help="the page to write")
    parser.add_argument("--report", type=Path, help="rewrite --page from these saved records; run nothing")
    args = parser.parse_args()
    if args.report is not None:
        args.page.write_text(page(json.loads(args.report.read_text())))
        print(f"wrote {args.page}")
        return
    if args.out is None:
        parser.error("--out is required for a run")
    started = time.perf_counter()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mesh = tensor_parallel_mesh(TP)
    dp_rank = mesh["data_parallel"].get_local_rank()
    contestants = {name: Contestant(name, mesh) for name in CONTESTANTS}
    times: dict[str, list[float]] = {name: [] for name in CONTESTANTS}
    losses: dict[str, list[float]] = {name: [] for name in CONTESTANTS}
    for name, contestant in contestants.items():  # warm-up step, not timed
        losses[name].append(contestant.step(batch(0, dp_rank)))
    for round_index in range(args.rounds):
        for name, contestant in contestants.items():
            for step in range(args.steps):
                ids = batch(1 + round_index * args.steps + step, dp_rank)
                dist.barrier()
                start = time.perf_counter()
                losses[name].append(contestant.step(ids))
                times[name].append(slowest(time.perf_counter() - start))
    if dist.get_rank() == 0:
        medians = {name: statistics.median(values) for name, values in times.items()}
        here = machine()
        result = {
            "date": here["date"],
            "machine": f"{here['cpu']}, {here['cores']} cores, CPU only, gloo",
            "rounds": args.rounds,
            "steps": args.steps,
            "wall_s": time.perf_counter() - started,
            "model_parameters": sum(p.numel() for p in TinyLlama(SIZE).parameters()),
            "mesh": "data_parallel 2 x tensor_parallel 2 (4 gloo CPU processes, one thread each)",
            "versions": here["versions"],
            "median_step_s": medians,
            "vs_fsdp2_tp": {name: medians[name] / medians["fsdp2_tp"] for name in CONTESTANTS},
            "losses": losses,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        args.page.write_text(page(result))
        for name in CONTESTANTS:
            print(f"{name}: {medians[name]:.3f} s ({result['vs_fsdp2_tp'][name]:.2f}x FSDP2 + TP)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
