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

from tests.models import TinyTransformer, batch, lm_loss, make_optimizer
from tests.rank_pool import by_rank, run_distributed, run_each
from tests.workers import config_for
from zero_core import ZeroEngine, collectives
from zero_core.collectives import ops as collective_ops

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
        self.log.sequence.append(("wait_stream", self.name, other.name))

    def record_event(self) -> FakeEvent:
        event = FakeEvent(self.name)
        self.log.events.append(event)
        self.log.sequence.append(("record", self.name, self.log.current))
        return event

    def wait_event(self, event: FakeEvent) -> None:
        assert self.name == "compute", f"{self.name} waited for an event: only the compute stream reads results"
        event.waited = True


class ScheduleLog:
    def __init__(self) -> None:
        self.sequence: list[tuple[str, str, Any]] = []  # what each stream was asked to do, in order
        self.events: list[FakeEvent] = []
        self.dropped_unwaited = 0
        self.current = "compute"

    def unwaited(self, stream: str) -> int:
        return sum(1 for event in self.events if event.stream == stream and not event.waited)

    def launches(self) -> set[tuple[str, str, bool]]:
        """(collective, stream it was enqueued in, async_op)."""
        return {(name, stream, async_op) for kind, name, (stream, async_op) in self._entries("launch")}

    def _entries(self, kind: str) -> list[tuple[str, str, Any]]:
        return [entry for entry in self.sequence if entry[0] == kind]

    def violations(self) -> list[str]:
        """Per side stream: wait for the compute stream, enqueue the collective, record the event
        that covers it, inside that stream. Anything else is a race on a GPU."""
        state: dict[str, str] = {}
        found = []
        for kind, stream, detail in self.sequence:
            if kind == "wait_stream":
                if state.get(stream) == "launched":
                    found.append(f"a collective on {stream} has no event after it")
                state[stream] = "waited"
            elif kind == "launch":
                stream = detail[0]  # the stream it was enqueued in
                if state.get(stream) != "waited":
                    found.append(f"a collective on {stream} was enqueued before {stream} waited for the compute stream")
                state[stream] = "launched"
            elif kind == "record":
                if stream == "compute" or detail != stream or state.get(stream) != "launched":
                    found.append(f"an event on {stream} (recorded while {detail} was current) covers no collective")
                state[stream] = "recorded"
        return found


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
            log.sequence.append(("launch", name, (log.current, async_op)))
            return collective(*args, async_op=async_op, **kwargs)

        return launch

    original_del = collectives.Handle.__del__

    def counting_del(handle: collectives.Handle) -> None:
        log.dropped_unwaited += handle._done is not None
        original_del(handle)

    patches = {
        (torch.cuda, "current_stream"): lambda device=None: compute,
        (torch.cuda, "stream"): in_stream,
        (collective_ops, "_all_gather_single"): logged("all_gather", collective_ops._all_gather_single),
        (collective_ops, "_reduce_scatter_single"): logged("reduce_scatter", collective_ops._reduce_scatter_single),
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
    rank = engine.rank
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
                launches=sorted(log.launches()),
                violations=log.violations(),
                dropped_unwaited=log.dropped_unwaited,
            )
    return result


CASES = [(1, False, 1), (2, False, 1), (3, False, 1), (3, False, 2), (1, True, 1), (2, True, 1)]


def _cases(rank: int, world_size: int) -> list[dict[str, Any]]:
    return [
        {"plain": _train(stage, False, overlap, prefetch), "streams": _train(stage, True, overlap, prefetch)}
        for stage, overlap, prefetch in CASES
    ]


@pytest.fixture(scope="module")
def grid() -> dict[str, Any]:
    return {
        "two ranks": run_distributed(run_each, WORLD_SIZE, {"cases": _cases}),
        "one rank": run_distributed(run_each, 1, {"cases": _cases}),
    }


@pytest.mark.parametrize("ranks", ["two ranks", "one rank"])
@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"stage{s}-overlap{o}-prefetch{p}" for s, o, p in CASES])
def test_side_stream_schedule_orders_every_result(grid: dict[str, Any], ranks: str, case: int) -> None:
    stage, overlap, prefetch = CASES[case]
    for results in by_rank(grid[ranks], "cases"):
        plain, streams = results[case]["plain"], results[case]["streams"]
        # The same training either way: the schedule changes where work is enqueued, not what.
        assert streams["losses"] == pytest.approx(plain["losses"], rel=1e-6)
        # One rank, stage 1: gathers and reduces are in place, nothing to enqueue. Otherwise even
        # one rank's collectives take the side streams (NCCL runs one-rank communicators).
        assert (streams["events"] > 0) == (ranks == "two ranks" or stage > 1)
        # Every collective was enqueued synchronously inside its own stream, after that stream
        # waited for the compute stream, and an event recorded right after it in that stream
        # is what the compute stream waits for.
        for name, stream, async_op in streams["launches"]:
            assert (stream, async_op) == (name, False)
        launched = {name for name, _, _ in streams["launches"]}
        assert launched == (
            {"reduce_scatter"}
            if ranks == "one rank" and stage == 2
            else set()
            if ranks == "one rank" and stage == 1
            else {"all_gather", "reduce_scatter"}
        )
        assert streams["violations"] == []
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
