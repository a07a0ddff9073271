"""Every "ranks agree" packing, in one process: values and their negations under one MAX
all-reduce, the flags OR-ed across ranks, and the setup description's first difference."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from zero_core import collectives
from zero_core.agreement import StepAgreement, agree_on_step, differing_values, true_on_any_rank
from zero_core.agreement.setup import ADVICE, Field, agree_on_setup, describe_value, first_difference
from zero_core.collectives import CollectiveFailed, CommContext

from . import fake_world


def _packed_max(per_rank: list[dict[str, int]], prefix: list[float] = ()) -> list[float]:
    """What each rank holds after all-reducing ``prefix + values + (-values)`` with MAX."""
    rows = [list(prefix) + list(v.values()) + [-x for x in v.values()] for v in per_rank]
    return torch.tensor(rows, dtype=torch.float64).max(dim=0).values.tolist()


# ------------------------------------------------------------------ the ±x MAX packing
def test_values_equal_on_every_rank_do_not_differ() -> None:
    checks = {"forwards": 3, "backwards": 3, "steps": 1}
    assert differing_values(checks, _packed_max([checks, checks, checks])) == []


def test_differing_values_name_each_value_with_its_lowest_and_highest() -> None:
    ranks = [{"forwards": 3, "steps": 1}, {"forwards": 5, "steps": 1}, {"forwards": 4, "steps": 0}]
    assert differing_values(ranks[0], _packed_max(ranks)) == [
        "forwards: 3 on some ranks, 5 on others",
        "steps: 0 on some ranks, 1 on others",
    ]


def test_the_packing_is_read_from_the_end_and_handles_negative_values() -> None:
    """Callers put flags before the packed values: only the last 2n entries are read."""
    ranks = [{"offset": -7}, {"offset": 2}]
    reduced = _packed_max(ranks, prefix=[1.0, 0.0, 1.0])
    assert differing_values(ranks[1], reduced) == ["offset: -7 on some ranks, 2 on others"]
    assert differing_values({}, reduced) == []


# ------------------------------------------------------------------ true_on_any_rank
def test_one_rank_gets_its_own_flags_back_without_a_process_group() -> None:
    comm = CommContext.create(None, torch.device("cpu"))
    assert comm.world_size == 1
    assert true_on_any_rank(comm, [True, False, True], "which outputs") == [True, False, True]
    assert true_on_any_rank(comm, [], "which outputs") == []


def test_a_flag_true_on_any_rank_is_true_on_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    world = fake_world.install(monkeypatch, 3)
    flags = [[True, False, False, False], [False, False, True, False], [False, False, True, False]]
    results = world.run(lambda comm: true_on_any_rank(comm, flags[comm.rank], "reached outputs"))
    assert results == [[True, False, True, False]] * 3
    # The counts first, in a tensor of fixed size, then the flags.
    assert world.calls == [("all_reduce", "reached outputs")] * 2


def test_ranks_with_different_flag_counts_fail_alike_before_reducing_the_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    world = fake_world.install(monkeypatch, 2)
    flags = [[True, False], [True, False, True]]
    results = world.run(lambda comm: true_on_any_rank(comm, flags[comm.rank], "reached outputs"))
    assert all(isinstance(r, CollectiveFailed) for r in results)
    messages = {str(r) for r in results}
    assert len(messages) == 1
    message = messages.pop()
    assert "ZeRO: ranks disagree on reached outputs (how many): 2 on some ranks, 3 on others." in message
    assert collectives.DIVERGENCE_ADVICE in message
    assert len(world.calls) == 1  # the flags of different lengths were never all-reduced


def test_values_that_must_agree_are_checked_in_the_same_call(monkeypatch: pytest.MonkeyPatch) -> None:
    world = fake_world.install(monkeypatch, 2)
    results = world.run(
        lambda comm: true_on_any_rank(comm, [True], "outputs", must_agree={"records": 2 + comm.rank, "step": 4})
    )
    assert all(isinstance(r, CollectiveFailed) for r in results)
    # Only what differs is named: the flag count and the step agree.
    assert str(results[0]).startswith("ZeRO: ranks disagree on records: 2 on some ranks, 3 on others.\n")
    agreeing = world.run(lambda comm: true_on_any_rank(comm, [comm.rank == 1], "outputs", must_agree={"step": 4}))
    assert agreeing == [[True], [True]]


# ------------------------------------------------------------------ agree_on_step
def _unit(has_grad: list[bool], shard: torch.Tensor | None = None) -> SimpleNamespace:
    return SimpleNamespace(grads=SimpleNamespace(slot_has_grad=has_grad, sharded_grads=shard))


def test_step_agreement_ors_gradient_flags_and_finds_an_overflow_anywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    world = fake_world.install(monkeypatch, 2)
    counters = {"forwards": 2, "backwards": 2, "steps": 0}
    finite, overflow = torch.ones(4), torch.tensor([1.0, float("inf"), 0.0, 0.0])
    units = [
        [_unit([True, False], finite), _unit([False], finite)],
        [_unit([False, False], overflow), _unit([True], finite)],
    ]
    # An asynchronous save's write finished on both ranks, another's on rank 1 only: true only where on both.
    everywhere = [[True, False], [True, True]]

    def agree(comm: object) -> StepAgreement:
        return agree_on_step(units[comm.rank], comm, counters, check_finite=True, everywhere=everywhere[comm.rank])

    results = world.run(agree)
    assert results == [StepAgreement(True, [[True, False], [True]], False, [True, False])] * 2
    assert world.calls == [("all_reduce", "the optimizer-step agreement")]  # one all-reduce for all of it

    unchecked = world.run(lambda comm: agree_on_step(units[comm.rank], comm, counters, check_finite=False))
    assert [r.found_inf for r in unchecked] == [False, False]


def test_nan_counts_as_an_overflow_and_units_without_shards_are_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    world = fake_world.install(monkeypatch, 2)
    units = [[_unit([False], None)], [_unit([True], torch.tensor([float("nan")]))]]
    results = world.run(lambda comm: agree_on_step(units[comm.rank], comm, {"steps": 1}, check_finite=True))
    assert [r.found_inf for r in results] == [True, True]
    assert [r.slot_flags for r in results] == [[[True]], [[True]]]


def test_ranks_after_different_work_are_named_on_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    world = fake_world.install(monkeypatch, 3)
    units = [_unit([True])]
    counters = [{"forwards": 4, "backwards": 4}, {"forwards": 4, "backwards": 3}, {"forwards": 5, "backwards": 4}]
    results = world.run(lambda comm: agree_on_step(units, comm, counters[comm.rank], check_finite=False))
    assert all(isinstance(r, CollectiveFailed) for r in results)
    assert len({str(r) for r in results}) == 1
    assert str(results[0]).startswith(
        "ZeRO: ranks reached this optimizer step after different work "
        "(forwards: 4 on some ranks, 5 on others, backwards: 3 on some ranks, 4 on others).\n"
    )


def test_checks_only_report_that_they_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    world = fake_world.install(monkeypatch, 2)
    units = [_unit([True, True])]
    same = world.run(lambda comm: agree_on_step(units, comm, {"steps": 3}, False, checks={"groups": 17, "units": 5}))
    assert [r.checks_differ for r in same] == [False, False]
    differ = world.run(
        lambda comm: agree_on_step(units, comm, {"steps": 3}, False, checks={"groups": 17 + comm.rank, "units": 5})
    )
    assert [r.checks_differ for r in differ] == [True, True]
    assert [r.slot_flags for r in differ] == [[[True, True]]] * 2  # the flags still read right past the checks


# ------------------------------------------------------------------ setup agreement
def _described(stage: str, lr: str) -> list[Field]:
    return [Field("config.stage", stage), Field("parameter count", "2"), Field("optimizer param group 0 lr", lr)]


def test_first_difference_names_the_first_field_and_groups_ranks_by_value() -> None:
    described = [_described("3", "0.1"), _described("2", "0.2"), _described("3", "0.1")]
    assert first_difference(described) == (
        f"ZeRO: ranks disagree on config.stage: 3 on ranks 0, 2; 2 on rank 1. {ADVICE}"
    )


def test_first_difference_skips_fields_every_rank_shares() -> None:
    message = first_difference([_described("3", "0.1"), _described("3", "0.01")])
    assert message == f"ZeRO: ranks disagree on optimizer param group 0 lr: 0.1 on rank 0; 0.01 on rank 1. {ADVICE}"


def test_a_rank_that_described_fewer_fields_shows_nothing_there() -> None:
    longer = _described("3", "0.1") + [Field("optimizer default lr", "0.1")]
    message = first_difference([_described("3", "0.1"), longer])
    assert message == f"ZeRO: ranks disagree on optimizer default lr: (nothing) on rank 0; 0.1 on rank 1. {ADVICE}"


def test_entries_of_different_names_are_named_by_position() -> None:
    message = first_difference([[Field("a", "1")], [Field("b", "1")]])
    assert message == f"ZeRO: ranks disagree on setup entry 0: a = 1 on rank 0; b = 1 on rank 1. {ADVICE}"
    assert "equal descriptions, different digests" in first_difference([[Field("a", "1")]] * 2)


def test_values_are_described_alike_on_every_rank() -> None:
    assert describe_value(0.0) == describe_value(0) == "0"
    assert describe_value(0.5) == "0.5"
    assert describe_value({"b", "a", "c"}) == "{'a', 'b', 'c'}"
    assert describe_value([1.0, (2, 3)]) == "(1, (2, 3))"
    assert describe_value(torch.optim.AdamW) == "torch.optim.adamw.AdamW"
    assert describe_value(torch.tensor([1.0, 2.5])) == "tensor((1, 2.5), dtype=torch.float32)"
    described = describe_value(object())
    assert described == "<builtins.object>" and "0x" not in described  # no address


def test_setup_agreement_passes_alike_and_fails_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    world = fake_world.install(monkeypatch, 3)
    assert world.run(lambda comm: agree_on_setup(comm, _described("3", "0.1"))) == [None] * 3
    assert world.calls == [("all_gather", "setup digest")]  # equal digests: the descriptions stay home

    world.calls.clear()
    described = [_described("3", "0.1"), _described("3", "0.1"), _described("3", "0.3")]
    results = world.run(lambda comm: agree_on_setup(comm, described[comm.rank]))
    assert all(isinstance(r, ValueError) for r in results) and len({str(r) for r in results}) == 1
    assert str(results[0]) == (
        f"ZeRO: ranks disagree on optimizer param group 0 lr: 0.1 on ranks 0, 1; 0.3 on rank 2. {ADVICE}"
    )
    assert world.calls == [("all_gather", "setup digest"), ("all_gather_objects", "setup description")]


def test_the_digest_keeps_names_and_values_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """("ab", "c") and ("a", "bc") join to the same text without separators."""
    world = fake_world.install(monkeypatch, 2)
    described = [[Field("ab", "c")], [Field("a", "bc")]]
    results = world.run(lambda comm: agree_on_setup(comm, described[comm.rank]))
    assert all(isinstance(r, ValueError) for r in results)
    assert "setup entry 0: ab = c on rank 0; a = bc on rank 1" in str(results[0])


def test_one_rank_agrees_with_itself() -> None:
    comm = CommContext.create(None, torch.device("cpu"))
    agree_on_setup(comm, _described("3", "0.1"))
