"""What the ZeRO++ tests run on each rank: a small GPT trained with and without quantized collectives.

The corpus is a Markov chain over 64 tokens where each token has 4 equally likely successors: the loss
starts near ln 64 (4.16) and can fall no lower than ln 4 (1.39), so a run that learns ends well below its
start at a floor that quantization cannot reach under by luck.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zero_core import MixedPrecision, WrapPolicy, ZeroConfig, ZeroEngine, estimate
from zero_core.quantization import packed_bytes

from .allocations import peak_allocated_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import gpt  # noqa: E402

VOCAB, SEQ, BATCH, SUCCESSORS = 64, 16, 4, 4
# 150 steps: past the steep part of the curve (from ln 64 to about 1.84, its floor ln 4), where the quantized
# runs differ most from the exact one; 300 added nothing the assertions see but a minute of the suite.
STEPS, EVERY = 150, 25
BF16 = MixedPrecision(compute_dtype=torch.bfloat16)


def corpus_batch(step: int, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(step * 7919 + rank)
    ids = torch.empty(BATCH, SEQ, dtype=torch.long)
    ids[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=generator)
    choice = torch.randint(0, SUCCESSORS, (BATCH, SEQ), generator=generator)
    for i in range(1, SEQ):
        ids[:, i] = (ids[:, i - 1] * 5 + choice[:, i] * 17 + 3) % VOCAB
    return ids


class Run:
    """A small GPT (two blocks as units and the root) under stage 3 with AdamW, in bf16 with fp32 masters."""

    def __init__(self, device: str = "cpu", **settings: Any):
        torch.manual_seed(0)
        self.device = torch.device(device)
        self.config = gpt.GPTConfig(vocab_size=VOCAB, seq_len=SEQ, width=32, depth=2, heads=2)
        self.model = gpt.GPT(self.config).to(self.device)
        wrap = WrapPolicy(module_classes=(gpt.GPTBlock,))
        config = ZeroConfig(**{"stage": 3, "wrap_policy": wrap, **settings})
        self.engine = ZeroEngine(self.model, torch.optim.AdamW(self.model.parameters(), lr=3e-3), config)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def step(self, step: int) -> float:
        """One optimizer step on this rank's batch; the loss averaged over every rank."""
        ids = corpus_batch(step, self.rank).to(self.device)
        loss = gpt.next_token_loss(self.model(ids), ids)
        self.engine.backward(loss)
        self.engine.step()
        mean = loss.detach().float()
        dist.all_reduce(mean)
        return mean.item() / self.world

    def train(self, steps: range) -> list[float]:
        return [self.step(step) for step in steps]


QUANTIZED = {"quantize_weights": True, "quantize_gradients": True}  # qwZ and qgZ


def convergence(rank: int, world_size: int, variants: dict[str, dict[str, Any]]) -> dict[str, list[float]]:
    """``STEPS`` steps of each variant's settings, the same batches: their loss curves by name."""
    return {name: Run(mixed_precision=BF16, **settings).train(range(STEPS)) for name, settings in variants.items()}


def payload(name: str, args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], Any]:
    """The tensors a call to ``torch.distributed.<name>`` sends, and its group (None: the world). A batch of
    point-to-point ops sends its isends' tensors."""
    first = args[0]
    if name == "batch_isend_irecv":
        return [op.tensor for op in first if op.op is dist.isend], first[0].group
    return (first if isinstance(first, list) else [first]), kwargs.get("group")


class SentPayloads:
    """Every collective handed to ``torch.distributed`` with its payload bytes, in order (really sent)."""

    NAMES = (
        "broadcast",
        "all_gather",
        "all_gather_into_tensor",
        "all_reduce",
        "reduce_scatter",
        "reduce",
        "all_to_all_single",
        "batch_isend_irecv",  # gloo's reduce-scatter over two ranks: an exchange of slices
    )

    def __enter__(self) -> "SentPayloads":
        self.calls: list[tuple[str, int]] = []
        self._originals = {name: getattr(dist, name) for name in self.NAMES}
        for name, original in self._originals.items():
            setattr(dist, name, self._counted(name, original))
        return self

    def _counted(self, name: str, original: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            tensors, _ = payload(name, args, kwargs)
            self.calls.append((name, sum(t.numel() * t.element_size() for t in tensors)))
            return original(*args, **kwargs)

        return counted

    def __exit__(self, *exc: object) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)


def traffic(rank: int, world_size: int) -> dict[str, Any]:
    """One step's collectives, exact and with quantized weights (same model, same batch), call by call."""
    block = 64
    sent = {}
    for name in ("exact", "quantize_weights", "quantize_gradients"):
        run = Run(mixed_precision=BF16, quantization_block_size=block, **({name: True} if name != "exact" else {}))
        run.step(0)
        with SentPayloads() as payloads:
            run.step(1)
        sent[name] = payloads.calls
        shards = [report.padded_numel // world_size for report in run.engine.unit_reports()]
        if name == "quantize_weights":
            in_flight = _gathers_in_flight(run)
        if name == "quantize_gradients":
            reduces_in_flight = _reduces_in_flight(run)
    return {
        "sent": sent,
        "in_flight": in_flight,
        "reduces_in_flight": reduces_in_flight,
        "block": block,
        "shards": shards,
        "packed": {s: packed_bytes(s, block) for s in shards},
        "packed_int4": {s: packed_bytes(s, block, 4) for s in shards},
        "reduce_element_bytes": run.engine.config.mixed_precision.reduce_dtype.itemsize,
    }


def _gathers_in_flight(run: Run) -> dict[str, Any]:
    """``memory_report().communication_bytes`` while the first block computes (prefetch 1: the second block's
    quantized gather in flight) and after the step; the second block's shard, to hold it to."""
    seen: list[int] = []
    hook = run.model.blocks[0].register_forward_pre_hook(
        lambda *_: seen.append(run.engine.memory_report().communication_bytes)
    )
    run.step(2)
    hook.remove()
    second = next(r for r in run.engine.unit_reports() if r.name == "blocks.1")
    return {"during": seen, "after": run.engine.memory_report().communication_bytes, "shard": second.shard_numel}


def _reduces_in_flight(run: Run) -> dict[str, Any]:
    """``memory_report()`` while the first block's gradients arrive: the second block's quantized reduce is in
    flight (issued when its backward finished, waited for at the end of backward), and after the step."""
    seen: list[tuple[int, int]] = []

    def report(_: torch.Tensor) -> None:
        if not seen:  # the first of the block's parameters: nothing of its own reduce issued yet
            memory = run.engine.memory_report()
            seen.append((memory.communication_bytes, memory.gradient_bytes))

    first = next(run.model.blocks[0].parameters())
    hook = first.register_post_accumulate_grad_hook(report)
    run.step(2)
    hook.remove()
    units = {r.name: r for r in run.engine.unit_reports()}
    memory = run.engine.memory_report()
    return {
        "during": seen,
        "after": (memory.communication_bytes, memory.gradient_bytes),
        "shard": units["blocks.1"].shard_numel,
        "padded": {name: r.padded_numel for name, r in units.items()},
    }


def exact_reads(rank: int, world_size: int, directory: Path) -> dict[str, Any]:
    """With quantized weights: exports and ``gathered_parameters()`` read the fp32 masters, not the
    dequantized values the forward used; checkpoints move between runs with and without ZeRO++'s three pieces
    exactly (``directory``: shared by the ranks)."""
    results: dict[str, Any] = {}
    quantized = Run(quantize_weights=True, quantization_block_size=16)
    quantized.train(range(3))
    masters = quantized.engine.full_state_dict(to_cpu=True)
    with quantized.engine.gathered_parameters():
        inside = {name: p.detach().clone() for name, p in quantized.model.named_parameters()}
    results["gathered_parameters_exact"] = all(torch.equal(inside[n], masters[n]) for n in inside)
    # The forward computes with dequantized values: they differ from the masters (else nothing was quantized).
    ids = corpus_batch(99, rank)
    with torch.no_grad():
        quantized_logits = quantized.model(ids)
        with quantized.engine.gathered_parameters():
            exact_logits = quantized.model(ids)
    results["forward_differs_from_masters"] = not torch.equal(quantized_logits, exact_logits)
    # Saved with it, loaded without it (and back), saved again: the test compares the two checkpoints.
    every_piece = {**QUANTIZED, "secondary_shard_group_size": 1}
    for source_settings, target_settings, name in (
        (every_piece, {}, "with_to_without"),
        ({}, every_piece, "without_to_with"),
    ):
        source = Run(quantization_block_size=16, **source_settings)
        source.train(range(2))
        source.engine.save_checkpoint(directory / f"saved-{name}")
        target = Run(quantization_block_size=16, **target_settings)
        target.train(range(5, 6))  # its own state first: the load must replace it
        target.engine.load_checkpoint(directory / f"saved-{name}")
        target.engine.save_checkpoint(directory / f"reloaded-{name}")
        results[name] = target.engine.steps_taken == source.engine.steps_taken
    return results


def compositions(rank: int, world_size: int, directory: Path) -> dict[str, tuple[list[float], list[float]]]:
    """Quantized weights and gradients with the parameter shards offloaded (host, files), with some units
    kept whole, at stage 2 (gradients only), and with accumulation: 10 steps each, beside the same run
    exact."""
    cases = {
        "offload_params_cpu": {"offload_params": "cpu", "offload_optimizer": "cpu"},
        "offload_params_nvme": {"offload_params": "nvme", "offload_optimizer": "nvme", "offload_dir": str(directory)},
        "persistence_threshold": {"persistence_threshold": 5000},  # the blocks kept whole, the root sharded
        "stage_2": {"stage": 2},
    }
    results = {}
    for name, settings in cases.items():
        quantized = {"quantize_gradients": True} if name == "stage_2" else QUANTIZED
        exact = Run(mixed_precision=BF16, **settings).train(range(10))
        results[name] = (exact, Run(mixed_precision=BF16, **settings, **quantized).train(range(10)))
    results["accumulation"] = (_accumulated(Run()), _accumulated(Run(**QUANTIZED)))
    return results


def _accumulated(run: Run, micro_batches: int = 3) -> list[float]:
    """10 steps of ``micro_batches`` micro-batches each (no_sync on all but the last)."""
    losses = []
    for step in range(10):
        total = 0.0
        for micro in range(micro_batches):
            ids = corpus_batch(step * micro_batches + micro, run.rank)
            loss = gpt.next_token_loss(run.model(ids), ids) / micro_batches
            if micro < micro_batches - 1:
                with run.engine.no_sync():
                    run.engine.backward(loss)
            else:
                run.engine.backward(loss)
            total += loss.item()
        run.engine.step()
        losses.append(total)
    return losses


def on_cuda(rank: int, world_size: int) -> dict[str, list[float]]:
    """On a GPU (the side streams under NCCL): 8 steps exact, with quantized gathers and with quantized
    gradients, the parameter shards on the device and staged from pinned host memory (the staging copy and
    the weights' quantization share the all-gather's stream; the gradients' hops run on the reduce-scatter
    stream)."""
    device = f"cuda:{rank % torch.cuda.device_count()}"
    torch.cuda.set_device(device)
    losses = {}
    for offload in ("none", "cpu"):
        for quantized in ("exact", "weights", "gradients"):
            settings = {} if quantized == "exact" else {f"quantize_{quantized}": True}
            run = Run(device, mixed_precision=BF16, offload_params=offload, **settings)
            assert (run.engine.comm.all_gather_stream is not None) == (dist.get_backend() == "nccl")
            losses[f"{offload}-{quantized}"] = run.train(range(8))
    return losses


class SentByNode(SentPayloads):
    """Payload bytes of the collectives whose ranks span more than one "node" of ``node_size`` ranks."""

    def __init__(self, node_size: int):
        self.node_size = node_size

    def _counted(self, name: str, original: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            tensors, group = payload(name, args, kwargs)
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
            link = "across" if len({r // self.node_size for r in ranks}) > 1 else "inside"
            self.calls.append((f"{name} {link}", sum(t.numel() * t.element_size() for t in tensors)))
            return original(*args, **kwargs)

        return counted

    def total(self, name: str, link: str) -> int:
        return sum(nbytes for call, nbytes in self.calls if call == f"{name} {link}")


def secondary_shards(rank: int, world_size: int) -> dict[str, Any]:
    """At 4 ranks as 2 "nodes" of 2: runs with secondary shards over a node (and over 1 rank, and with
    quantized weights) beside the same runs without, with accumulation; the bytes each backward sends across
    nodes; the pieces' bytes between a forward and its backward."""
    results: dict[str, Any] = {}
    for name, settings in {
        "k2": {"secondary_shard_group_size": 2},
        "k1": {"secondary_shard_group_size": 1},
        "k2_quantized": {"secondary_shard_group_size": 2, "quantize_weights": True},
        "hybrid_k1": {"secondary_shard_group_size": 1, "shard_group_size": 2},
    }.items():
        base = {key: settings[key] for key in ("quantize_weights", "shard_group_size") if key in settings}
        results[name] = (
            _accumulated(Run(mixed_precision=BF16, **base), micro_batches=2),
            _accumulated(Run(mixed_precision=BF16, **settings), micro_batches=2),
        )
    for name, settings in {
        "without": {},
        "with": {"secondary_shard_group_size": 2},
        "with_k1": {"secondary_shard_group_size": 1},
    }.items():
        run = Run(mixed_precision=BF16, **settings)
        run.step(0)
        ids = corpus_batch(1, rank)
        before = run.engine.memory_report().parameter_bytes
        loss = gpt.next_token_loss(run.model(ids), ids)
        between = run.engine.memory_report().parameter_bytes
        with SentByNode(node_size=2) as sent, tempfile.TemporaryDirectory() as scratch:
            peak = peak_allocated_bytes(lambda: run.engine.backward(loss), Path(scratch) / "trace.json")
        after = run.engine.memory_report().parameter_bytes
        run.engine.step()
        padded = [report.padded_numel for report in run.engine.unit_reports()]
        with torch.device("meta"):
            estimated = estimate(gpt.GPT(run.config), world_size, run.engine.config).secondary_piece_bytes
        results[f"backward_{name}"] = {
            "estimated": estimated,
            "gathered_across": sent.total("broadcast", "across") + sent.total("all_gather_into_tensor", "across"),
            "gathered_inside": sent.total("broadcast", "inside") + sent.total("all_gather_into_tensor", "inside"),
            "pieces": between - before,
            "left_after_backward": after - before,
            "padded": padded,
            "backward_peak": peak,  # the most bytes the backward allocated at once (the profiler's count)
        }
    return results
