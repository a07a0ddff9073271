"""Flat vs hybrid sharding at cluster scale, projected from bytes per link class measured here.

    python benchmarks/projection.py [--params 7e9] [--tokens-per-device 16384]

1. Measures: 4 gloo processes on this machine train the small GPT for two
   steps at each stage, flat (one shard group of 4) and hybrid (2 groups of
   2), and read ``engine.last_step_traffic_by_span``: the bytes each rank
   sent per step inside its shard group and across groups, as multiples of
   the padded parameter count Ψ (fp32). These coefficients are what the
   projection multiplies; they equal the formulas (stage 3: 3Ψ inside,
   Ψ/k across; the tests assert the same).
2. Projects one optimizer step of a ``--params`` model on ``nodes`` x 8
   devices: compute ``6 Ψ T / F`` (T tokens per device, F the device's
   sustained FLOP rate), and each collective as a ring, ``(p-1) α + (p-1)/p
   · bytes / β`` with the link it crosses: flat sharding spans every
   device, so across nodes its rings run at the network's per-device rate;
   hybrid keeps all-gathers and reduce-scatters on the node's links and
   sends only the gradient shards (an all-reduce over the nodes) across.
   Parameters move in bf16, gradients in fp32 (``MixedPrecision(bf16)``),
   one collective per unit (``--units``).
3. Writes ``benchmarks/PROJECTION.md`` and ``benchmarks/projection.png``:
   communication time, its share of the step (none of it overlapped, the
   upper bound; fully overlapped the step is max(compute, communication)),
   and the break-even batch, the tokens per device at which compute time
   equals communication time, so communication can hide behind compute.

4. ZeRO++ (``ZEROPP``): the same 4 ranks sharded together, secondary shards and quantized gradients over
   2 "nodes" of 2, int8 weights; its bytes per link class, then a projection at 64 nodes x 8 with 100,
   200 and 400 Gb/s between nodes, beside flat and hybrid ZeRO-3 and the paper's reported ratios.

Stated, not measured: the link rates and latencies and the device FLOP
rate (defaults: 900 GB/s and 3 µs inside a node, 400 Gb/s = 50 GB/s per
device and 10 µs between nodes, 400 TFLOP/s sustained bf16).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "examples"))
sys.path.insert(0, str(HERE))
from plotting import copy_to_docs, pyplot  # noqa: E402

DEVICES_PER_NODE = 8
NODE_COUNTS = (1, 2, 4, 8, 16, 32, 64)
# ZeRO++ as the paper runs it: sharded over every device, secondary shards and qgZ's hops over a node (2 of
# the 4 ranks measured here), int8 weights and int4 gradients in blocks of BLOCK.
BLOCK = 128
ZEROPP = {"quantize_weights": True, "quantize_gradients": True, "secondary_shard_group_size": 2}
INTER_GBITS = (100.0, 200.0, 400.0)
# The paper's own figures (Wang et al., 2023, abstract): cross-node volume 3M -> 0.75M, up to 2.16x the
# throughput of ZeRO-3 at 384 GPUs.
PAPER_VOLUME_RATIO, PAPER_THROUGHPUT_RATIO = 4.0, 2.16


# ------------------------------------------------------------------ measuring
def _measure_rank(rank: int, world_size: int, port: int, queue) -> None:  # type: ignore[no-untyped-def]
    from gpt import GPT, GPTBlock, GPTConfig, next_token_loss, synthetic_batch

    from zero_core import WrapPolicy, ZeroConfig, ZeroEngine

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    results = []
    layouts = [(stage, {"shard_group_size": group}) for stage in (1, 2, 3) for group in (None, 2)]
    layouts.append((3, ZEROPP))
    for stage, settings in layouts:
        torch.manual_seed(0)
        config = GPTConfig(vocab_size=256, seq_len=32, width=64, depth=4, heads=4)
        model = GPT(config)
        engine = ZeroEngine(
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-3),
            ZeroConfig(stage=stage, wrap_policy=WrapPolicy(module_classes=(GPTBlock,)), **settings),
        )
        for step in range(2):
            ids = synthetic_batch(config, 4, step, rank)
            engine.backward(next_token_loss(model(ids), ids))
            engine.step()
        padded = sum(report.padded_numel for report in engine.unit_reports())
        traffic = {span: count.bytes / (4 * padded) for span, count in engine.last_step_traffic_by_span.items()}
        results.append(
            {
                "stage": stage,
                "shard_group_size": engine.shard_group_size,
                "zeropp": settings is ZEROPP,
                "per_param": traffic,
                "units": len(engine.unit_reports()),
            }
        )
        engine.unshard()
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def measure() -> list[dict]:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    processes = [context.Process(target=_measure_rank, args=(rank, 4, port, queue)) for rank in range(4)]
    for process in processes:
        process.start()
    results = queue.get()
    for process in processes:
        process.join(timeout=60)
    return results


# ----------------------------------------------------------------- projecting
@dataclass(frozen=True)
class Hardware:
    intra_bytes_per_s: float
    intra_latency_s: float
    inter_bytes_per_s: float  # per device (one NIC per device)
    inter_latency_s: float
    flops: float  # sustained per device


def ring_seconds(payload_bytes: float, ranks: int, bandwidth: float, latency: float, all_reduce: bool = False) -> float:
    """An all-gather / reduce-scatter (or, ``all_reduce``, both) of ``payload_bytes`` over a ring of ``ranks``."""
    if ranks <= 1:
        return 0.0
    rounds = 2 if all_reduce else 1
    return rounds * ((ranks - 1) * latency + (ranks - 1) / ranks * payload_bytes / bandwidth)


@dataclass(frozen=True)
class Projection:
    nodes: int
    compute_s: float
    flat_comm_s: float
    hybrid_comm_s: float
    flat_break_even_tokens: float
    hybrid_break_even_tokens: float


def project(
    params: float, tokens: float, units: int, nodes: int, hw: Hardware, inside: float, across: float
) -> Projection:
    """Stage 3, bf16 parameters, fp32 gradients. ``inside``/``across``: measured elements moved per
    parameter per step inside a shard group and across groups (3 and 1/k)."""
    devices = nodes * DEVICES_PER_NODE
    # Of the 3Ψ moved inside: 2Ψ of parameter all-gathers (bf16), Ψ of gradient reduce-scatters (fp32).
    gather_bytes, reduce_bytes = (inside - 1) * params * 2, params * 4
    flat_link = (hw.inter_bytes_per_s, hw.inter_latency_s) if nodes > 1 else (hw.intra_bytes_per_s, hw.intra_latency_s)
    per_unit = lambda total: total / units  # noqa: E731 - one collective per unit
    flat = units * (
        2 * ring_seconds(per_unit(gather_bytes) / 2, devices, *flat_link)
        + ring_seconds(per_unit(reduce_bytes), devices, *flat_link)
    )
    intra = (hw.intra_bytes_per_s, hw.intra_latency_s)
    hybrid = units * (
        2 * ring_seconds(per_unit(gather_bytes) / 2, DEVICES_PER_NODE, *intra)
        + ring_seconds(per_unit(reduce_bytes), DEVICES_PER_NODE, *intra)
    )
    # Across nodes: each device's gradient shard (across x Ψ elements, fp32), all-reduced over the nodes.
    hybrid += units * ring_seconds(
        per_unit(across * params * 4), nodes, hw.inter_bytes_per_s, hw.inter_latency_s, all_reduce=True
    )
    compute = 6 * params * tokens / hw.flops
    per_token = 6 * params / hw.flops
    return Projection(nodes, compute, flat, hybrid, flat / per_token, hybrid / per_token)


@dataclass(frozen=True)
class ZeroPlusPlus:
    inter_gbits: float
    compute_s: float
    flat_comm_s: float
    hybrid_comm_s: float
    zeropp_comm_s: float
    flat_cross_node_bytes: float  # per device per step: bf16 parameters, fp32 gradients
    flat_bf16_cross_node_bytes: float  # the paper's baseline: bf16 gradients too
    zeropp_cross_node_bytes: float


def project_zeropp(
    params: float, tokens: float, units: int, nodes: int, hw: Hardware, inside: float, across: float, wire: dict
) -> ZeroPlusPlus:
    """ZeRO++ beside flat and hybrid ZeRO-3 on ``nodes`` x 8 devices. ``wire``: measured bytes per parameter
    per step of the int8 forward gathers (``forward``) and of the int4 gradient rows (``gradients``); sharded
    over every device, the backward gathers in bf16 inside a node, the gradients in two hops."""
    devices = nodes * DEVICES_PER_NODE
    base = project(params, tokens, units, nodes, hw, inside, across)
    intra, inter = (hw.intra_bytes_per_s, hw.intra_latency_s), (hw.inter_bytes_per_s, hw.inter_latency_s)
    per_unit = lambda total: total / units  # noqa: E731 - one collective per unit
    forward, gradients = wire["forward"] * params, wire["gradients"] * params
    zeropp = units * (
        ring_seconds(per_unit(forward), devices, *(inter if nodes > 1 else intra))
        + ring_seconds(per_unit(2 * params), DEVICES_PER_NODE, *intra)  # the backward's gather, in a node
        + ring_seconds(per_unit(gradients), DEVICES_PER_NODE, *intra)  # qgZ's first hop (an all-to-all)
        + ring_seconds(per_unit(gradients / DEVICES_PER_NODE), nodes, *inter)  # its second: 1/8 across
    )
    share = (devices - 1) / devices
    return ZeroPlusPlus(
        hw.inter_bytes_per_s * 8 / 1e9,
        base.compute_s,
        base.flat_comm_s,
        base.hybrid_comm_s,
        zeropp,
        share * (2 * 2 + 4) * params,
        share * (2 * 2 + 2) * params,
        share * forward + (nodes - 1) / nodes * gradients / DEVICES_PER_NODE,
    )


def _markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def _zeropp_table(rows: list[ZeroPlusPlus]) -> list[str]:
    header = ["between nodes", "compute (s)", "flat ZeRO-3 comm (s)", "hybrid comm (s)", "ZeRO++ comm (s)"]
    header += ["step, ZeRO++ vs flat", "cross-node bytes per device: flat (bf16 grads) / ZeRO++", "the paper's"]
    paper = f"{PAPER_VOLUME_RATIO:g}x fewer volume; up to {PAPER_THROUGHPUT_RATIO}x throughput (384 GPUs)"
    cells = []
    for r in rows:
        speedup = (r.compute_s + r.flat_comm_s) / (r.compute_s + r.zeropp_comm_s)
        volume = r.flat_bf16_cross_node_bytes / r.zeropp_cross_node_bytes
        times = [r.compute_s, r.flat_comm_s, r.hybrid_comm_s, r.zeropp_comm_s]
        cells.append([f"{r.inter_gbits:g} Gb/s", *(f"{t:.3f}" for t in times), f"{speedup:.2f}x"])
        cells[-1] += [f"{volume:.1f}x fewer", paper]
    return _markdown_table(header, cells)


def _table(rows: list[Projection]) -> list[str]:
    header = ["nodes x 8", "compute (s)", "flat comm (s)", "flat comm share", "hybrid comm (s)"]
    header += ["hybrid comm share", "break-even tokens/device, flat", "hybrid"]
    cells = []
    for r in rows:
        share = lambda comm: comm / (comm + r.compute_s)  # noqa: E731 - nothing overlapped: the upper bound
        cells.append(
            [f"{r.nodes}", f"{r.compute_s:.3f}", f"{r.flat_comm_s:.3f}", f"{share(r.flat_comm_s):.0%}"]
            + [f"{r.hybrid_comm_s:.3f}", f"{share(r.hybrid_comm_s):.0%}"]
            + [f"{r.flat_break_even_tokens:,.0f}", f"{r.hybrid_break_even_tokens:,.0f}"]
        )
    return _markdown_table(header, cells)


def _plot(
    rows: list[Projection], zeropp_by_nodes: list[ZeroPlusPlus], zeropp_by_rate: list[ZeroPlusPlus], path: Path
) -> None:
    """Per step and break-even batch by node count (flat, hybrid, ZeRO++), and at 64 nodes ZeRO++'s step
    against flat ZeRO-3's by the rate between nodes, beside the paper's reported throughput ratio."""
    plt = pyplot()
    nodes = [r.nodes for r in rows]
    figure, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4))
    left.plot(nodes, [r.flat_comm_s for r in rows], "o-", label="flat ZeRO-3: communication")
    left.plot(nodes, [r.hybrid_comm_s for r in rows], "s-", label="hybrid (node groups): communication")
    left.plot(nodes, [r.zeropp_comm_s for r in zeropp_by_nodes], "^-", label="ZeRO++ (qwZ + hpZ + qgZ)")
    left.plot(nodes, [r.compute_s for r in rows], "k--", label="compute")
    left.set(xscale="log", yscale="log", xlabel="nodes (x 8 devices)", ylabel="seconds per step", title="Per step")
    left.legend(fontsize=8)
    middle.plot(nodes, [r.flat_break_even_tokens for r in rows], "o-", label="flat")
    middle.plot(nodes, [r.hybrid_break_even_tokens for r in rows], "s-", label="hybrid")
    compute_per_token = rows[-1].flat_comm_s / rows[-1].flat_break_even_tokens  # 6 Ψ / F, as project() has it
    middle.plot(nodes, [z.zeropp_comm_s / compute_per_token for z in zeropp_by_nodes], "^-", label="ZeRO++")
    middle.set(
        xscale="log",
        yscale="log",
        xlabel="nodes (x 8 devices)",
        ylabel="tokens per device",
        title="Break-even batch (compute = communication)",
    )
    middle.legend(fontsize=8)
    rates = [r.inter_gbits for r in zeropp_by_rate]
    ratios = [(r.compute_s + r.flat_comm_s) / (r.compute_s + r.zeropp_comm_s) for r in zeropp_by_rate]
    right.plot(rates, ratios, "^-", label="ZeRO++ vs flat ZeRO-3, projected (nothing overlapped)")
    right.axhline(PAPER_THROUGHPUT_RATIO, color="k", linestyle=":", label="the paper: up to 2.16x (384 GPUs)")
    right.set(xlabel="Gb/s per device between nodes", ylabel="step time, flat / ZeRO++", title="64 nodes x 8")
    right.set_ylim(bottom=1.0)
    right.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-plots", action="store_true", help="no projection.png (plots need the 'bench' extra)")
    parser.add_argument("--params", type=float, default=7e9)
    parser.add_argument("--tokens-per-device", type=float, default=16384)
    parser.add_argument("--units", type=int, default=32, help="collectives per kind per step (one per block)")
    parser.add_argument("--intra-gbytes", type=float, default=900.0)
    parser.add_argument("--intra-latency-us", type=float, default=3.0)
    parser.add_argument("--inter-gbits", type=float, default=400.0)
    parser.add_argument("--inter-latency-us", type=float, default=10.0)
    parser.add_argument("--tflops", type=float, default=400.0)
    parser.add_argument("--out", default=str(HERE / "PROJECTION.md"))
    args = parser.parse_args()
    if not args.no_plots:
        pyplot()  # a missing matplotlib stops here, before the measuring
    hw = Hardware(
        args.intra_gbytes * 1e9,
        args.intra_latency_us * 1e-6,
        args.inter_gbits / 8 * 1e9,
        args.inter_latency_us * 1e-6,
        args.tflops * 1e12,
    )

    measured = measure()
    stage3 = {r["shard_group_size"]: r["per_param"] for r in measured if r["stage"] == 3}
    hybrid = stage3[2]
    inside = hybrid["SHARD_GROUP"]
    # Measured with groups of 2: Ψ/k per rank. With a node of 8 as the group, each device's shard is Ψ/8.
    across = hybrid["ACROSS_GROUPS"] * 2 / DEVICES_PER_NODE
    rows = [project(args.params, args.tokens_per_device, args.units, n, hw, inside, across) for n in NODE_COUNTS]
    zeropp = next(r["per_param"] for r in measured if r["zeropp"])
    # Measured over 2 "nodes" of 2 in fp32 (per_param counts fp32 elements: x 4 is bytes): the forward's int8
    # gathers inside the one shard group, the gradients' second hop (1/2 of the int4 rows) across the groups.
    wire = {"forward": 4 * zeropp["SHARD_GROUP"], "gradients": 4 * zeropp["ACROSS_SECONDARY"] * 2}
    zeropp_rows = [
        project_zeropp(
            args.params,
            args.tokens_per_device,
            args.units,
            64,
            Hardware(hw.intra_bytes_per_s, hw.intra_latency_s, gbits / 8 * 1e9, hw.inter_latency_s, hw.flops),
            inside,
            across,
            wire,
        )
        for gbits in INTER_GBITS
    ]

    lines = [
        "# Flat vs hybrid sharding at cluster scale (projected)",
        "",
        f"Generated by `python benchmarks/projection.py` ({' '.join(sys.argv[1:]) or 'defaults'}).",
        "",
        "## Measured here: elements moved per parameter per step, per rank (4 gloo ranks; hybrid = 2 groups of 2)",
        "",
        "| stage | layout | inside the shard group | across shard groups | every rank | formula (inside / across) |",
        "|---|---|---|---|---|---|",
    ]
    for r in [r for r in measured if not r["zeropp"]]:
        k = r["shard_group_size"]
        inside_formula = 3 if r["stage"] == 3 else 2
        across_formula = f"1/{k}" if k < 4 else "0"
        layout = "flat (4)" if k == 4 else f"hybrid ({k} x {4 // k})"
        per = r["per_param"]
        lines.append(
            f"| {r['stage']} | {layout} | {per['SHARD_GROUP']:.3f} | {per['ACROSS_GROUPS']:.3f} | "
            f"{per['WORLD']:.4f} | {inside_formula} / {across_formula} |"
        )
    lines += [
        "",
        '(Ψ counts the padded flat parameters; "every rank" is the step agreement and buffers. Flat sharding\'s '
        "3Ψ crosses every link, the slowest included; hybrid sharding's crosses only the links inside a group.)",
        "",
        f"## Projected: ZeRO-3, {args.params:.3g} parameters, {args.tokens_per_device:,.0f} tokens per device per step",
        "",
        f"Stated hardware: inside a node {args.intra_gbytes:g} GB/s and {args.intra_latency_us:g} µs per hop; between "
        f"nodes {args.inter_gbits:g} Gb/s per device and {args.inter_latency_us:g} µs per hop; {args.tflops:g} TFLOP/s "
        f"sustained per device; {DEVICES_PER_NODE} devices per node, shard groups of one node; {args.units} units.",
        "",
        *_table(rows),
        "",
        "Communication share assumes nothing overlaps (the upper bound); with full overlap the step takes "
        "max(compute, communication), which is compute wherever the batch is above break-even. Flat sharding's "
        "rings cross the network as soon as there are two nodes, so its communication jumps there and its "
        "break-even batch with it; hybrid sharding pays the network only for the gradient shards (Ψ/8 fp32 per "
        "device), so its cost grows slowly with the node count (ring latency and the (n-1)/n factor).",
        "",
        "## ZeRO++ at 64 nodes x 8, by the rate between nodes",
        "",
        f"Measured here (4 gloo ranks as 2 nodes of 2, fp32, blocks of {BLOCK}), bytes per parameter per step: "
        f"the forward's int8 gathers {wire['forward']:.4f} (formula 1 + 4/{BLOCK} = {1 + 4 / BLOCK:.4f}); the "
        f"int4 gradient rows {wire['gradients']:.4f} (0.5 + 4/{BLOCK} = {0.5 + 4 / BLOCK:.4f}), of which qgZ's "
        "second hop sends 1/k across nodes; the backward's gathers stay inside a node (hpZ): "
        f"{4 * zeropp['SECONDARY']:.4f} inside the secondary groups (fp32 gathers 4 + the first hop).",
        "",
        "Projected: sharded over all 512 devices, secondary shards and qgZ's first hop inside each node of 8, "
        "parameters gathered in int8 forward and bf16 backward, gradients in int4; the step's compute and the "
        "links as above. Flat ZeRO-3 moves bf16 parameters and fp32 gradients (the cross-node column compares "
        "with bf16 gradients, the paper's baseline).",
        "",
        *_zeropp_table(zeropp_rows),
        "",
        "The paper counts qgZ's cross-node volume as 0.25M (the whole gradient at int4); with the intra-node "
        "sum first, each device sends 1/8 of it across, so our count of that hop is lower, and the forward's "
        "int8 gathers (about Ψ bytes per device) are most of what is left. Its 2.16x is measured end to end "
        "on 384 V100s with overlap; ours is a projection with nothing overlapped.",
    ]
    if not args.no_plots:
        zeropp_by_nodes = [
            project_zeropp(args.params, args.tokens_per_device, args.units, n, hw, inside, across, wire)
            for n in NODE_COUNTS
        ]
        _plot(rows, zeropp_by_nodes, zeropp_rows, Path(args.out).with_name("projection.png"))
        copy_to_docs(Path(args.out).with_name("projection.png"))
        lines += ["", "![projection](projection.png)"]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(json.dumps({"measured": measured}, indent=1)[:2000])


if __name__ == "__main__":
    main()
