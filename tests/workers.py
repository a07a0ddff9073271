"""Bodies of the multi-process tests: each runs a grid of cases on one rank
and returns plain numbers for the tests to assert on."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

from zero_core import MixedPrecision, WrapPolicy, ZeroConfig, ZeroEngine

from .models import Block, TinyTransformer, batch, lm_loss, make_optimizer, uses_branch


def refusal(action: Any, error_type: type[Exception]) -> str | None:
    """The message of the ``error_type`` that ``action()`` raises, or None if it raises nothing."""
    try:
        action()
    except error_type as error:
        return str(error)
    return None


def relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest per-tensor max|a - b| / max|b| over keys of ``b``."""
    worst = 0.0
    for key, expected in b.items():
        actual = a[key].to(expected.dtype)
        scale = expected.abs().max().clamp_min(1e-12)
        worst = max(worst, float((actual - expected).abs().max() / scale))
    return worst


def rank0_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The reference's state with rank 0's buffers, as DDP broadcasts them before the next forward
    and as ZeRO exports them."""
    for buffer in module.buffers():
        torch.distributed.broadcast(buffer, 0)
    return module.state_dict()


def config_for(
    stage: int,
    prefetch: int = 1,
    precision: MixedPrecision | None = None,
    shard_group_size: int | None = None,
    persistence_threshold: int = 0,
    **settings: object,
) -> ZeroConfig:
    return ZeroConfig(
        stage=stage,
        prefetch=prefetch,
        wrap_policy=WrapPolicy(module_classes=(Block,)),
        mixed_precision=precision or MixedPrecision(),
        shard_group_size=shard_group_size,
        persistence_threshold=persistence_threshold,
        **settings,
    )


def _sum_then_average(state, bucket):  # type: ignore[no-untyped-def]
    """DDP's all-reduce summing first and averaging after, as the engine's fp32 reduce does (DDP's own divides
    each rank's gradient first). Unannotated: DDP checks a hook's annotations, which would be strings here."""
    world_size = torch.distributed.get_world_size()
    future = torch.distributed.all_reduce(bucket.buffer(), async_op=True).get_future()
    return future.then(lambda done: done.value()[0].div_(world_size))


def train_against_ddp(
    stage: int,
    optimizer_name: str,
    *,
    steps: int = 5,
    micro_batches: int = 1,
    clip: float | None = None,
    prefetch: int = 1,
    shard_group_size: int | None = None,
    sync_every_micro_batch: bool = False,
    persistence_threshold: int = 0,
    settings: dict[str, Any] | None = None,
    reference_clips_at_our_norm: bool = False,
    equal_sums: bool = False,
) -> dict[str, Any]:
    """Train the same model under DDP and under ZeRO on this rank's data, step by step.

    ``sync_every_micro_batch``: every micro-batch's backward reduces (no ``no_sync``); ``settings``: more of
    the engine's config (``config_for``'s keywords); ``reference_clips_at_our_norm``: DDP's gradients clipped
    with the engine's norm (which sums the shards' squares in another order, one rounding off torch's): for
    optimizers whose update amplifies a rounding (Muon's bf16 Newton-Schulz), so the steps see equal gradients;
    ``equal_sums``: every rank trains on rank 0's batches and DDP sums before it averages, as the engine does,
    so the averaged gradient is the same in any order of the sum (at 3 ranks the reduce-scatter and DDP's
    all-reduce add in other orders, and DDP divides first: a rounding apart)."""
    torch.manual_seed(0)
    reference = TinyTransformer()
    model = copy.deepcopy(reference)
    ddp = DistributedDataParallel(reference, find_unused_parameters=True)
    if equal_sums:
        ddp.register_comm_hook(None, _sum_then_average)
    reference_optimizer = make_optimizer(optimizer_name, reference)
    engine = ZeroEngine(
        model,
        make_optimizer(optimizer_name, model),
        config_for(
            stage,
            prefetch,
            shard_group_size=shard_group_size,
            persistence_threshold=persistence_threshold,
            **(settings or {}),
        ),
    )
    rank = torch.distributed.get_rank()
    losses, reference_losses, param_errors, norms = [], [], [], []
    for step in range(steps):
        branch = uses_branch(step)
        for micro in range(micro_batches):
            ids = batch(step * micro_batches + micro, 0 if equal_sums else rank)
            last = sync_every_micro_batch or micro == micro_batches - 1
            with ddp.no_sync() if not last else _nullcontext():
                ref_loss = lm_loss(ddp(ids, use_branch=branch), ids) / micro_batches
                ref_loss.backward()
            with engine.no_sync() if not last else _nullcontext():
                loss = lm_loss(model(ids, use_branch=branch), ids) / micro_batches
                engine.backward(loss)
            losses.append(loss.item())
            reference_losses.append(ref_loss.item())
        if clip is not None and reference_clips_at_our_norm:
            # The norm compared as below, the gradients scaled alike: what the step does with the same gradients.
            norm = engine.clip_grad_norm_(clip)
            ref_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters() if p.grad is not None])
            torch.nn.utils.clip_grads_with_norm_(reference.parameters(), clip, norm.to(ref_norm.dtype))
            norms.append((float(norm), float(ref_norm)))
        elif clip is not None:
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
            norm = engine.clip_grad_norm_(clip)
            norms.append((float(norm), float(ref_norm)))
        reference_optimizer.step()
        # The model's, not the optimizer's: parameters outside its groups (Muon's biases and norms) would keep
        # their gradients under torch and be clipped with them; the engine's step consumes every gradient.
        reference.zero_grad()
        engine.step()
        param_errors.append(relative_difference(engine.full_state_dict(), rank0_state_dict(reference)))
    return {
        "losses": losses,
        "reference_losses": reference_losses,
        "param_errors": param_errors,
        "norms": norms,
        "peak_live_units": engine.peak_live_units,
        "final_state": engine.full_state_dict(),
    }


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def parity_grid(rank: int, world_size: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [train_against_ddp(**case) for case in cases]


def train_precision(stage: int, compute_dtype: torch.dtype, steps: int = 8) -> list[float]:
    """Losses of a short AdamW run in ``compute_dtype`` (fp32 master, fp32 reduction)."""
    torch.manual_seed(0)
    model = TinyTransformer()
    # A moderate initial scale: no overflow-skipped steps, so the runs stay comparable.
    config = config_for(stage, precision=MixedPrecision(compute_dtype=compute_dtype), initial_loss_scale=2.0**10)
    engine = ZeroEngine(model, make_optimizer("adamw", model, lr=3e-3), config)
    return train_clipped(model, engine, torch.distributed.get_rank(), range(steps))


def train_accumulated(engine: ZeroEngine, rank: int, steps: range, accumulate: int = 1) -> list[float]:
    """Each step: ``accumulate`` micro-batches of each rank's own, clipped at 0.5, one optimizer step; the
    micro-batches' losses."""
    losses = []
    for step in steps:
        for micro in range(accumulate):
            ids = batch(10 * step + micro, rank)
            loss = lm_loss(engine.model(ids), ids)
            engine.backward(loss / accumulate)
            losses.append(loss.item())
        engine.clip_grad_norm_(0.5)
        engine.step()
    return losses


def train_clipped(
    model: torch.nn.Module, engine: ZeroEngine, rank: int, steps: range, device: torch.device | None = None
) -> list[float]:
    """Steps on each rank's own batches (two, repeated: the loss must fall), clipped at 1.0; their losses."""
    losses = []
    for step in steps:
        ids = batch(step % 2, rank).to(device or "cpu")
        loss = lm_loss(model(ids), ids)
        engine.backward(loss)
        engine.clip_grad_norm_(1.0)
        engine.step()
        losses.append(loss.item())
    return losses


def precision_grid(rank: int, world_size: int) -> dict[str, list[float]]:
    return {
        f"stage{stage}-{str(dtype).removeprefix('torch.')}": train_precision(stage, dtype)
        for stage in (1, 2, 3)
        for dtype in (torch.float32, torch.bfloat16, torch.float16)
    }


class GptRun:
    """The examples' small GPT (3 blocks as units) under a ZeroEngine, trained with AdamW on
    this rank's synthetic batches: the model the memory and traffic formulas are checked on."""

    def __init__(self, stage: int, **config: Any):
        import os
        import sys

        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
        import gpt

        self.gpt = gpt
        torch.manual_seed(0)
        self.config = gpt.GPTConfig(vocab_size=128, seq_len=16, width=32, depth=3, heads=2)
        self.model = gpt.GPT(self.config)
        wrap = WrapPolicy(module_classes=(gpt.GPTBlock,))
        self.engine = ZeroEngine(
            self.model,
            torch.optim.AdamW(self.model.parameters(), lr=1e-3),
            ZeroConfig(stage=stage, wrap_policy=wrap, **config),
        )
        self.rank = torch.distributed.get_rank()

    def backward(self, step: int) -> None:
        ids = self.gpt.synthetic_batch(self.config, 4, step, self.rank)
        self.engine.backward(self.gpt.next_token_loss(self.model(ids), ids))

    def train_step(self, step: int) -> None:
        self.backward(step)
        self.engine.step()

    def sizes(self) -> dict[str, int]:
        engine = self.engine
        return {
            "numel": engine.num_parameters,
            "padded_numel": sum(u.padded_numel for u in engine.unit_reports()),
            "units": len(engine.unit_reports()),
            "param_tensors": len(list(self.model.parameters())),
        }


def measure_state_and_traffic(stage: int, compute_dtype: torch.dtype) -> dict[str, Any]:
    """Bytes held after a step plus the next backward, and bytes moved by one step."""
    run = GptRun(stage, mixed_precision=MixedPrecision(compute_dtype=compute_dtype))
    run.train_step(0)
    run.train_step(1)
    traffic = run.engine.last_step_traffic
    at_rest_bytes = sum(p.untyped_storage().nbytes() for p in run.model.parameters())
    run.backward(2)
    return {
        "report": run.engine.memory_report(),
        **run.sizes(),
        "all_gather_bytes": traffic["all_gather"].bytes,
        "reduce_scatter_bytes": traffic["reduce_scatter"].bytes,
        "params_bytes_at_rest": at_rest_bytes,
    }


def accounting_grid(rank: int, world_size: int) -> list[dict[str, Any]]:
    return [measure_state_and_traffic(stage, dtype) for stage in (1, 2, 3) for dtype in (torch.float32, torch.bfloat16)]


class SentCollectives:
    """Counts the collectives handed to ``torch.distributed`` (logical bytes, as the ZeRO formulas count
    them) by the ranks they run between, which ``span(group)`` names (each test says how)."""

    spans: tuple[str, ...] = ()  # reported even when nothing ran between them

    def __init__(self) -> None:
        self.bytes: dict[str, int] = dict.fromkeys(self.spans, 0)
        self._originals: dict[str, Any] = {}

    def span(self, group: Any) -> str:
        raise NotImplementedError

    def _wrap(self, name: str, payload: Any, group_of: Any = lambda args, kwargs: kwargs.get("group")) -> None:
        original = self._originals[name] = getattr(torch.distributed, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            span = self.span(group_of(args, kwargs))
            self.bytes[span] = self.bytes.get(span, 0) + payload(*args)
            return original(*args, **kwargs)

        setattr(torch.distributed, name, counted)

    def __enter__(self) -> "SentCollectives":
        nbytes = lambda tensors: sum(t.numel() * t.element_size() for t in tensors)  # noqa: E731
        self._wrap("all_gather", lambda outputs, *_: nbytes(outputs))
        self._wrap("reduce_scatter", lambda output, inputs, *_: nbytes(inputs))
        self._wrap("all_reduce", lambda tensor, *_: nbytes([tensor]))
        self._wrap("broadcast", lambda tensor, *_: nbytes([tensor]))
        self._wrap("reduce", lambda tensor, *_: nbytes([tensor]))  # gloo's reduce-scatter: one reduce per slice
        # Gloo's reduce-scatter over two ranks: one exchange, the peer's slice sent and this rank's received.
        # Both count, as the formulas count a reduce-scatter by its whole input.
        self._wrap(
            "batch_isend_irecv",
            lambda ops, *_: nbytes([op.tensor for op in ops]),
            group_of=lambda args, kwargs: args[0][0].group,
        )
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._originals.items():
            setattr(torch.distributed, name, original)


class SentByDimension(SentCollectives):
    """By the mesh dimension a collective's group spans. DTensor's own collectives (the layers' activations)
    go through torch's functional collectives and are not counted here (``LayerCollectives`` counts them):
    they are tensor parallelism's, the same with or without ZeRO."""

    def span(self, group: Any) -> str:
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        if len(ranks) == dist.get_world_size():
            return "world"
        return "tensor_parallel" if ranks[-1] - ranks[0] == len(ranks) - 1 else "data_parallel"


class LayerCollectives(TorchDispatchMode):
    """The bytes of the collectives DTensor runs for the split layers themselves (torch's functional
    collectives: the row-wise linears' all-reduces and the like), in forward and backward. Each DTensor op
    is let through (``NotImplemented``) so that DTensor turns it into the collectives this mode then sees,
    as torch's CommDebugMode does."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **kwargs)
        name = func._overloadpacket.__name__
        if func.namespace == "_c10d_functional" and name.startswith(("all_", "reduce_scatter", "broadcast")):
            counted = out if name.startswith("all_gather") else args[0]
            self.bytes[name] = self.bytes.get(name, 0) + sum(
                t.numel() * t.element_size() for t in (counted if isinstance(counted, (list, tuple)) else [counted])
            )
        return out
