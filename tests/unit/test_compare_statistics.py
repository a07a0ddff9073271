"""The guard's arithmetic (benchmarks/compare.py): the pairs' order and the ratio's interval."""

from __future__ import annotations

import math
import random
import subprocess
import sys

import pytest

from tests.paths import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from compare import GUARD_OUTPUTS, abba_order, describe_checkout, pooled_record, ratio_estimate  # noqa: E402


def test_the_sides_alternate_which_goes_first_pair_by_pair() -> None:
    order = abba_order(6)
    assert order == [(0, 1), (1, 0), (0, 1), (1, 0), (0, 1), (1, 0)]
    # Flattened: A B B A A B B A ... so a steady drift favours neither side.
    assert [side for pair in order for side in pair] == [0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1, 0]


def test_the_ratio_is_the_geometric_mean_and_its_interval_holds_it() -> None:
    estimate = ratio_estimate([[0.5, 2.0], [1.0]])
    assert estimate.ratio == pytest.approx(1.0)  # 0.5 and 2 cancel: ratios multiply
    assert estimate.low <= estimate.ratio <= estimate.high
    assert (estimate.smallest, estimate.largest, estimate.pairs) == (0.5, 2.0, 3)
    steady = ratio_estimate([[1.1] * 5, [1.1] * 3])
    assert steady.low == pytest.approx(1.1) and steady.high == pytest.approx(1.1)


def test_the_interval_narrows_with_pairs_and_tells_a_five_percent_slip_from_noise() -> None:
    """Pairs whose ratios scatter by 5% around a 5% slip: 6 pairs cannot exclude 1.0, 40 pairs can, and the
    interval covers the true 1.05 either way."""
    noise = random.Random(1)
    ratios = [1.05 * math.exp(noise.gauss(0, 0.05)) for _ in range(40)]
    few, many = ratio_estimate([ratios[:3], ratios[3:6]]), ratio_estimate([ratios[:20], ratios[20:]])
    assert few.low < 1.05 < few.high and many.low < 1.05 < many.high
    assert many.high - many.low < few.high - few.low
    assert many.low > 1.0  # the slip is told from noise
    assert ratio_estimate([ratios], seed=0) == ratio_estimate([ratios], seed=0)  # the same figures, the same interval


def test_a_round_whose_processes_were_slow_throughout_widens_the_interval() -> None:
    """Two rounds that agree within each but not with each other (one side's processes slow for their whole
    life in one round): the interval spans both rounds' ratios, where pooling the pairs would have hidden it."""
    steady, shifted = [1.0, 1.01, 0.99, 1.0], [1.1, 1.11, 1.09, 1.1]
    apart = ratio_estimate([steady, shifted])
    pooled = ratio_estimate([steady + shifted])
    assert apart.ratio == pytest.approx(pooled.ratio)
    assert apart.low < 1.01 and apart.high > 1.09
    assert apart.high - apart.low > pooled.high - pooled.low


def _record(heading: str, rounds: list[list[float]], pairs: int = 3, machine: str = "2 cores (AMD EPYC)") -> dict:
    row = {
        "name": "zero3",
        "wall_rounds": rounds,
        "cpu_rounds": rounds,
        "round_ratios": [ratio_estimate([pairs_]).ratio for pairs_ in rounds],
        "median_wall_s": [4.0, 4.1],
        "median_cpu_s": [7.9, 8.0],
        "largest_loss_difference": 0.0,
        "others_cores_mean": 0.05,
    }
    question = {"size": "large", "world_size": 2, "device": "cpu", "pairs": pairs, "warmup": 2, "pinned": True}
    return {
        "heading": heading,
        **question,
        "date": "2026-12-03T08:00:00",
        "machine": machine,
        "rounds": len(rounds),
        "busy_before": 0.01,
        "comparisons": [row],
    }


def test_records_of_one_question_pool_their_rounds_into_one_narrower_estimate() -> None:
    """Two runs of the same two trees: the pooled estimate is the one drawn from all their rounds at once,
    narrower than either run's; runs of another question (other trees, pairs or processor) are refused, not
    averaged in."""
    noise = random.Random(2)
    rounds = [[1.02 * math.exp(noise.gauss(0, 0.06))] * 3 for _ in range(40)]
    first, second = _record("this tree (abc) over def", rounds[:20]), _record("this tree (abc) over def", rounds[20:])
    pooled = pooled_record([first, second])
    row = pooled["comparisons"][0]
    assert row["wall"] == vars(ratio_estimate(rounds))
    assert pooled["rounds"] == 40 and len(row["round_ratios"]) == 40
    alone = ratio_estimate(rounds[:20])
    assert row["wall"]["high"] - row["wall"]["low"] < alone.high - alone.low
    with pytest.raises(ValueError, match="different questions"):
        pooled_record([first, _record("this tree (abc) over ghi", rounds[:5])])
    with pytest.raises(ValueError, match="pairs"):
        pooled_record([first, _record("this tree (abc) over def", rounds[:5], pairs=4)])
    with pytest.raises(ValueError, match="machine"):
        pooled_record([first, _record("this tree (abc) over def", rounds[:5], machine="2 cores (Intel(R) Xeon(R))")])


@pytest.mark.distributed  # it starts git
def test_a_published_record_leaves_the_tree_the_same_question_and_a_code_change_does_not(tmp_path) -> None:
    """The guard's own outputs (the table, the records) do not mark the tree as changed, so a second run after
    a published one asks the same question and pools with it; a changed source file does mark it."""

    def git(*args: str) -> None:
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True)

    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    files = [tmp_path / "engine.py", tmp_path / GUARD_OUTPUTS[0], tmp_path / GUARD_OUTPUTS[1] / "one.json"]
    for path in files:
        path.write_text("before\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "start")
    clean = describe_checkout(tmp_path)
    assert "+changes" not in clean
    for path in files[1:]:
        path.write_text("a published record\n")
    (tmp_path / GUARD_OUTPUTS[1] / "two.json").write_text("{}\n")
    assert describe_checkout(tmp_path) == clean
    files[0].write_text("after\n")
    assert describe_checkout(tmp_path) == clean + "+changes"


@pytest.mark.parametrize("bad", [[], [[]], [[1.0], []], [[1.0, 0.0]], [[1.0, float("nan")]], [[-1.0]]])
def test_a_ratio_that_is_not_positive_and_finite_is_refused(bad: list[list[float]]) -> None:
    with pytest.raises(ValueError, match="positive and finite"):
        ratio_estimate(bad)
