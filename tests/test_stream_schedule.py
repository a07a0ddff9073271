"""The CUDA stream schedule, checked without a GPU.

On CUDA, all-gathers and reduce-scatters run on side streams and the compute
stream is ordered behind them with events (FSDP2's pattern). A handle that is
never waited for is a missing dependency: on a GPU the optimizer would read
a gradient, or the forward a parameter, that the side stream is still
writing, and the number would be silently wrong. Here the streams are
stand-ins that log what the schedule asks of them, around the real gloo
collectives, so every stage's schedule is checked on the CPU: each
collective is enqueued synchronously inside its own stream after that stream
waited for the compute stream, and the compute stream waits for every event
before the results are read (gradients before the step, parameters before
their forward). The GPU itself is exercised by ``test_cuda.py`` when present.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from typing import Any

import pytest
import torch

from zero_core import ZeroEngine, collectives

from .distributed import by_rank, run_distributed, run_each
from .models import TinyTransformer, batch, lm_loss, make_optimizer
from .workers import config_for

WORLD_SIZE = 2


class FakeEvent:
    def __init__(self, stream: str):
        self.stream = stream
        self.waited = False


class FakeStream:
    """Logs waits and events instead of ordering kernels (CPU work is already in order)."""

    device = torch.device("cpu")

    def __init__(self, name: str, log: "ScheduleLog"):
        self.name, self.log = name, log

    def wait_stream(self, other: "FakeStream") -> None:
        self.log.stream_waits.append((self.name, other.name))

    def record_event(self) -> FakeEvent:
        event = FakeEvent(self.name)
        self.log.events.append(event)
        return event

    def wait_event(self, event: FakeEvent) -> None:
        assert self.name == "compute", f"{self.name} waited for an event: only the compute stream reads results"
        event.waited = True


class ScheduleLog:
    def __init__(self) -> None:
        self.stream_waits: list[tuple[str, str]] = []
        self.events: list[FakeEvent] = []
        self.launches: list[tuple[str, str, bool]] = []  # (collective, stream it ran in, async_op)
        self.dropped_unwaited = 0
        self.current = "compute"

    def unwaited(self, stream: str) -> int:
        return sum(1 for event in self.events if event.stream == stream and not event.waited)


@contextlib.contextmanager
def fake_cuda_streams(engine: ZeroEngine):
    """Give ``engine`` side streams, and route the schedule's stream calls to the log."""
    log = ScheduleLog()
    compute = FakeStream("compute", log)
    streams = {"compute": compute}

    @contextlib.contextmanager
    def in_stream(stream: FakeStream):
        previous, log.current = log.current, stream.name
        try:
            yield
        finally:
            log.current = previous

    def logged(name: str, collective: Any) -> Any:
        def launch(*args: Any, async_op: bool = False, **kwargs: Any) -> Any:
            log.launches.append((name, log.current, async_op))
            return collective(*args, async_op=async_op, **kwargs)

        return launch

    original_del = collectives.Handle.__del__

    def counting_del(handle: collectives.Handle) -> None:
        log.dropped_unwaited += handle._done is not None
        original_del(handle)

    patches = {
        (torch.cuda, "current_stream"): lambda device=None: compute,
        (torch.cuda, "stream"): in_stream,
        (collectives, "_all_gather_single"): logged("all_gather", collectives._all_gather_single),
        (collectives, "_reduce_scatter_single"): logged("reduce_scatter", collectives._reduce_scatter_single),
        (collectives.Handle, "__del__"): counting_del,
    }
    originals = {key: getattr(*key) for key in patches}
    comm = engine.comm
    for key, value in patches.items():
        setattr(*key, value)
    comm.all_gather_stream = streams["all_gather"] = FakeStream("all_gather", log)
    comm.reduce_scatter_stream = streams["reduce_scatter"] = FakeStream("reduce_scatter", log)
    try:
        yield log
    finally:
        comm.all_gather_stream = comm.reduce_scatter_stream = None
        for key, value in originals.items():
            setattr(*key, value)


def _train(stage: int, streams: bool, overlap: bool = False, prefetch: int = 1) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyTransformer()
    config = dataclasses.replace(config_for(stage, prefetch=prefetch), overlap_param_refresh=overlap)
    engine = ZeroEngine(model, make_optimizer("adamw", model), config)
    rank = engine.comm.rank
    result: dict[str, Any] = {"losses": [], "unwaited_reduces_at_step": [], "unwaited_gathers_after_forward": []}
    schedule = fake_cuda_streams(engine) if streams else contextlib.nullcontext()
    with schedule as log:
        for step in range(4):
            for micro in range(2):  # two micro-batches, the first without synchronising
                ids = batch(2 * step + micro, rank)
                sync = contextlib.nullcontext() if micro == 1 else engine.no_sync()
                with sync:
                    loss = lm_loss(model(ids), ids)
                    if log is not None:
                        result["unwaited_gathers_after_forward"].append(log.unwaited("all_gather"))
                    engine.backward(loss)
            engine.clip_grad_norm_(1.0)
            if log is not None:
                result["unwaited_reduces_at_step"].append(log.unwaited("reduce_scatter"))
            engine.step()
            result["losses"].append(loss.item())
        ids = batch(99, rank)
        result["losses"].append(lm_loss(model(ids), ids).item())
        gc.collect()
        if log is not None:
            result.update(
                unwaited_at_end={name: log.unwaited(name) for name in ("all_gather", "reduce_scatter")},
                events=len(log.events),
                launches=sorted(set(log.launches)),
                stream_waits=sorted(set(log.stream_waits)),
                dropped_unwaited=log.dropped_unwaited,
            )
    return result


CASES = [(1, False, 1), (2, False, 1), (3, False, 1), (3, False, 2), (1, True, 1), (2, True, 1)]


def _cases(rank: int, world_size: int) -> list[dict[str, Any]]:
    return [
        {"plain": _train(stage, False, overlap, prefetch), "streams": _train(stage, True, overlap, prefetch)}
        for stage, overlap, prefetch in CASES
    ]


def _single_rank(rank: int, world_size: int) -> list[dict[str, Any]]:
    return _cases(rank, world_size)


@pytest.fixture(scope="module")
def grid() -> dict[str, Any]:
    return {
        "two ranks": run_distributed(run_each, WORLD_SIZE, {"cases": _cases}),
        "one rank": run_distributed(run_each, 1, {"cases": _single_rank}),
    }


@pytest.mark.parametrize("ranks", ["two ranks", "one rank"])
@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"stage{s}-overlap{o}-prefetch{p}" for s, o, p in CASES])
def test_side_stream_schedule_orders_every_result(grid: dict[str, Any], ranks: str, case: int) -> None:
    stage, overlap, prefetch = CASES[case]
    for results in by_rank(grid[ranks], "cases"):
        plain, streams = results[case]["plain"], results[case]["streams"]
        # The same training either way: the schedule changes where work is enqueued, not what.
        assert streams["losses"] == pytest.approx(plain["losses"], rel=1e-6)
        # One rank, stage 1: gathers and reduces are in place, nothing to enqueue. Otherwise
        # even one rank's copies take the side streams.
        assert (streams["events"] > 0) == (ranks == "two ranks" or stage > 1)
        if ranks == "two ranks":
            # Every collective ran synchronously inside its own stream ...
            assert {name for name, _, _ in streams["launches"]} == {"all_gather", "reduce_scatter"}
            for name, stream, async_op in streams["launches"]:
                assert (stream, async_op) == (name, False)
            # ... after that stream waited for what the compute stream wrote.
            assert {("all_gather", "compute"), ("reduce_scatter", "compute")} <= set(streams["stream_waits"])
        # The compute stream waited for every result before reading it: gradients before the
        # step, parameters before their forward (stage 3: only the prefetched units are still
        # in flight after a forward; stages 1/2 without overlap: refreshed before step() returns).
        assert streams["unwaited_reduces_at_step"] == [0] * 4
        if stage == 3:
            assert all(count <= prefetch for count in streams["unwaited_gathers_after_forward"])
        elif not overlap:
            assert streams["unwaited_gathers_after_forward"] == [0] * 8
        assert streams["unwaited_at_end"] == {"all_gather": 0, "reduce_scatter": 0}
        assert streams["dropped_unwaited"] == 0
