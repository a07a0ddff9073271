"""``zero_core.estimate`` before launch equals ``engine.memory_report()`` measured on real runs (stages
1-3, fp32/bf16, offload to host and to disk, SGD), from the same model built on the meta device; the
``zero-estimate`` command prints it; the largest model for a budget is the largest that fits."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys
from contextlib import redirect_stdout
from io import StringIO

import pytest
import torch

from tests.models import Block, TinyTransformer, batch, lm_loss, make_optimizer
from tests.paths import ROOT
from tests.rank_pool import run_distributed
from tests.workers import config_for
from zero_core import (
    MemoryReport,
    MixedPrecision,
    WrapPolicy,
    ZeroConfig,
    ZeroEngine,
    estimate,
    expected_model_state_bytes,
    user_settings,
)
from zero_core.collectives import all_reduce_working_bytes, gather_working_bytes, reduce_working_bytes
from zero_core.estimate_cli import build_parser, main
from zero_core.memory.estimate import (
    SHARED_SETTINGS,
    EstimateSettings,
    count_units,
    largest_fitting_model,
    shared_config,
    shared_settings,
)
from zero_core.sizes import human_bytes

WORLD = 2
BF16 = MixedPrecision(compute_dtype=torch.bfloat16)
FIELDS = ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes", "nvme_bytes", "host_bytes")
# (stage, precision, offload_optimizer, optimizer): the engine's shapes of memory, each once.
CASES = [
    *((stage, precision, "none", "adamw") for stage in (1, 2, 3) for precision in (None, BF16)),
    *((stage, BF16, "cpu", "adamw") for stage in (1, 2, 3)),
    (3, None, "cpu", "adamw"),  # fp32: the offloaded master is a second copy, on the host
    (3, BF16, "nvme", "adamw"),
    (2, None, "none", "sgd"),
    # offload_params="cpu": in fp32 the shard is the master (on a CPU device); in bf16 a host copy of its own.
    (3, None, "params", "adamw"),
    (3, BF16, "params", "adamw"),
    (3, None, "cpu+params", "adamw"),
    # offload_params="nvme": the shards in files (in fp32 the master stays a tensor of its own).
    (3, None, "params-nvme", "adamw"),
    (3, BF16, "nvme+params-nvme", "adamw"),
]
# The offload column: offload_optimizer, then "+params" for offload_params="cpu" ("params" alone: only that).
OFFLOADS = {"none": ("none", "none"), "cpu": ("cpu", "none"), "nvme": ("nvme", "none")}
OFFLOADS |= {"params": ("none", "cpu"), "cpu+params": ("cpu", "cpu")}
OFFLOADS |= {"params-nvme": ("none", "nvme"), "nvme+params-nvme": ("nvme", "nvme")}
STATE_BYTES = {"adamw": 8, "sgd": 4}  # per parameter: two fp32 moments, one momentum buffer
# Every other case of the offload plan (tests/distributed/offload/test_offload_plan.py's grid: each stage,
# precision and mode), so that the estimate and the measured report cannot drift apart for any of them
# ("optimizer/params").
MODES = ("none", "cpu", "nvme")
OFFLOADS |= {f"{optimizer}/{params}": (optimizer, params) for optimizer in MODES for params in MODES}
_COVERED = {(stage, precision, OFFLOADS[offload]) for stage, precision, offload, _ in CASES}
CASES += [
    (stage, precision, f"{optimizer}/{params}", "adamw")
    for stage in (1, 2, 3)
    for precision in (None, BF16)
    for optimizer in MODES
    for params in MODES
    if (stage == 3 or params == "none") and (stage, precision, (optimizer, params)) not in _COVERED
]


def _measure(rank: int, world_size: int, directory: str) -> list[dict]:
    """Each case: one step (the optimizer state exists), then the next backward: the estimate's moment."""
    results = []
    for stage, precision, offload, optimizer in CASES:
        torch.manual_seed(0)
        model = TinyTransformer()
        offload_optimizer, offload_params = OFFLOADS[offload]
        config = dataclasses.replace(
            config_for(stage, precision=precision),
            offload_optimizer=offload_optimizer,
            offload_params=offload_params,
            offload_dir=directory if "nvme" in offload else None,
        )
        engine = ZeroEngine(model, make_optimizer(optimizer, model), config)
        for step in range(2):
            ids = batch(step, rank)
            engine.backward(lm_loss(model(ids), ids))
            if step == 0:
                engine.step()
        results.append({"report": engine.memory_report(), "units": len(engine.unit_reports())})
    return results


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict]]:
    """One spawn for every case."""
    return run_distributed(_measure, WORLD, str(tmp_path_factory.mktemp("offload")))


def _estimate(stage: int, precision: MixedPrecision | None, offload: str, optimizer: str) -> MemoryReport:
    with torch.device("meta"):
        model = TinyTransformer()
    result = estimate(
        model, WORLD, precision=precision, optimizer_state_bytes_per_param=STATE_BYTES[optimizer],
        offload_optimizer=OFFLOADS[offload][0], offload_params=OFFLOADS[offload][1],
        wrap_policy=WrapPolicy(module_classes=(Block,)),
        host_is_device=True,  # a CPU device: the offloaded master and gradient shard stay in place
    )  # fmt: skip
    return result[stage]


@pytest.mark.parametrize(
    "index", range(len(CASES)), ids=[f"stage{s}-{p and 'bf16' or 'fp32'}-{o}-{n}" for s, p, o, n in CASES]
)
def test_estimate_equals_the_measured_report(measured: list[list[dict]], index: int) -> None:
    """Padding is the engine's own (units planned alike), so what remains is Adam's scalar ``step``
    per parameter piece (at most one per parameter tensor and unit, 4 bytes). Optimizer state is
    compared as the mean over ranks: the frozen layer shares the root unit with trainable
    parameters, and which rank's shard holds it is the layout's affair."""
    expected = _estimate(*CASES[index])
    reports = [per_rank[index]["report"] for per_rank in measured]
    params = sum(1 for _ in TinyTransformer().parameters())
    slack = 4 * (params + measured[0][index]["units"])
    for name in FIELDS:
        mean = sum(getattr(report, name) for report in reports) / len(reports)
        want = getattr(expected, name)
        assert abs(mean - want) <= slack, f"{name}: measured {mean} on average, estimated {want}"
    for report in reports:  # parameters and gradients are the same on every rank
        assert report.parameter_bytes == expected.parameter_bytes
        assert report.gradient_bytes == expected.gradient_bytes
    mean_device = sum(report.device_bytes for report in reports) / len(reports)
    assert abs(mean_device - expected.device_bytes) <= 2 * slack


def test_a_parameter_count_follows_the_readme() -> None:
    """7B parameters on 8 ranks in bf16 with Adam: stage 3 holds 2Ψ/N + 4Ψ/N + 12Ψ/N."""
    psi, n = 7 * 10**9, 8
    result = estimate(psi, n, precision=BF16)
    assert result[3] == MemoryReport(2 * psi // n, 4 * psi // n, 12 * psi // n)
    assert result[1].gradient_bytes == 4 * psi  # stage 1: full fp32 gradients
    assert result[0].model_state_bytes == (2 + 2 + 12) * psi  # DDP
    hybrid = estimate(psi, 16, shard_group_size=8, precision=BF16)
    assert hybrid[3] == result[3]  # shards divide over the group, not the world
    offloaded = estimate(psi, n, precision=BF16, offload_optimizer="cpu")[3]
    assert offloaded.device_bytes == (2 + 4) * psi // n  # compute shard, gradient shard
    assert offloaded.host_bytes == (4 + 8 + 4) * psi // n  # master, Adam's moments, the gradient copy
    on_disk = estimate(psi, n, precision=BF16, offload_optimizer="nvme", offload_fraction=0.5)[3]
    assert on_disk.nvme_bytes == (8 + 4) * psi // n // 2  # the offloaded half's moments and fp32 master


@pytest.mark.parametrize("stage", (0, 1, 2, 3))
def test_the_largest_model_fits_and_one_more_parameter_does_not(stage: int) -> None:
    settings = EstimateSettings(world_size=8, precision=BF16, offload_optimizer="cpu", offload_fraction=0.5)
    budget = 80 * 2**30
    largest = largest_fitting_model(budget, stage, settings)
    fits, one_more = (
        estimate(n, 8, precision=BF16, offload_optimizer="cpu", offload_fraction=0.5)[stage]
        for n in (largest, largest + 1)
    )
    assert fits.device_bytes <= budget < one_more.device_bytes
    assert largest > 10**9  # not a degenerate answer


def test_the_command_prints_every_stage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--params", "7B", "--world-size", "8", "--precision", "bf16", "--budget", "80GiB"]) == 0
    out = capsys.readouterr().out
    for row in ("DDP", "stage 1", "stage 2", "stage 3"):
        assert row in out
    assert "9.78 GiB" in out  # stage 3's 12Ψ/N: master and Adam's moments
    assert "largest in 80.00 GiB" in out


def test_the_command_reads_a_model_built_on_meta(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "tests.models:TinyTransformer", "--world-size", "2", "--wrap-classes", "Block"]
    assert main([*argv, "--offload-optimizer", "nvme"]) == 0
    out = capsys.readouterr().out
    assert f"{sum(p.numel() for p in TinyTransformer().parameters()):,} parameters" in out  # the tie counted once
    assert "in 4 unit(s)" in out and "nvme" in out
    assert main([*argv, "--whole-tensor-optimizer", "muon", "--optimizer-bytes", "4"]) == 0
    planned = estimate(TinyTransformer(), 2, wrap_policy=Block, whole_tensor_optimizer="muon")
    line = f"sends up to {human_bytes(planned.whole_tensor_sent_bytes)} to the tensors' owners and back"
    assert planned.whole_tensor_sent_bytes > 0 and line in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--params", "7x", "--world-size", "8"], "7e9, 7B or 350M"),
        (["--params", "7e9", "--world-size", "8", "--shard-group-size", "3"], "divisor of world_size=8"),
        (["--params", "7e9", "--world-size", "8", "--budget", "lots"], "80GiB"),
        (["--model", "tests.models", "--world-size", "8"], "module:factory"),
        (["--params", "7e9", "--world-size", "8", "--offload-optimizer", "cpu", "--offload-fraction", "2"], "(0, 1]"),
        (["--params", "7e9", "--world-size", "8", "--secondary-shard-group-size", "3"], "divisor of the shard group"),
        (["--params", "7e9", "--world-size", "8", "--secondary-shard-group-size", "8"], "smaller than it"),
    ],
)
def test_bad_input_names_what_to_use(argv: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(argv)
    assert named in capsys.readouterr().err


def test_the_installed_entry_point_runs() -> None:
    """``python -m zero_core.estimate_cli`` is what the ``zero-estimate`` script calls.
    Why a process of its own: the command a user types is the subject."""
    root = ROOT
    done = subprocess.run(
        [sys.executable, "-m", "zero_core.estimate_cli", "--params", "350M", "--world-size", "4"],
        capture_output=True, text=True, cwd=root, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "350,000,000 parameters" in done.stdout


def test_the_estimate_takes_the_engines_settings_from_the_schema() -> None:
    """The settings it shares with the engine are ZeroConfig's, checked by it; none is declared again."""
    names = {setting.name for setting in user_settings()}
    assert set(SHARED_SETTINGS) <= names
    own = {field.name for field in dataclasses.fields(EstimateSettings)}
    assert own == {"world_size", "config", "optimizer_state_bytes_per_param", "host_is_device"}
    schema = {field.name for field in dataclasses.fields(ZeroConfig)}
    assert not own & schema
    # They take the schema's settings by name (the formula's stage is the row's: 0 is DDP, no ZeroConfig's).
    assert not set(inspect.signature(estimate).parameters) & schema
    assert set(inspect.signature(expected_model_state_bytes).parameters) & schema == {"stage"}
    settings = EstimateSettings(
        16, shard_group_size=8, offload_optimizer="nvme", offload_fraction=0.5, wrap_policy=Block
    )
    config = ZeroConfig(
        shard_group_size=8, offload_optimizer="nvme", offload_fraction=0.5, wrap_policy=WrapPolicy((Block,))
    )
    assert settings.config == config and settings.shard_size == 8
    assert EstimateSettings(16, config) == settings  # a ZeroConfig itself
    for bad, refusal in ((dict(offload_params="disk"), "ZeroConfig.offload_params"), (dict(stage=2), "no setting")):
        with pytest.raises((ValueError, TypeError), match=refusal):
            estimate(10**6, 8, **bad)


def test_the_commands_flags_for_the_engines_settings_are_generated_from_the_schema() -> None:
    """One flag per shared setting, spelled, documented and parsed by its record; no other flag sets one."""
    actions = {action.dest: action for action in build_parser()._actions}
    shared = shared_settings()
    assert [s.name for s in shared] == [s.name for s in user_settings() if s.name in SHARED_SETTINGS]
    for setting in shared:
        action = actions[setting.text.name]
        assert action.option_strings == ["--" + setting.text.name.replace("_", "-")]
        assert action.help.startswith(setting.doc.replace("%", "%%"))
        example = setting.text.format(setting.text.example)
        assert action.type(example) == setting.text.parse(example)
    text_names = {s.text.name for s in user_settings()} | {s.name for s in user_settings()}
    assert {dest for dest in actions if dest in text_names} == {s.text.name for s in shared}


def test_hpz_pieces_are_a_line_of_their_own() -> None:
    """stage 3 with secondary_shard_group_size=k: each unit's padded elements / k in the compute dtype, printed
    beside the table (the table's peak, after a backward, holds none of them)."""
    plain = estimate(7_000_000, 8, precision=MixedPrecision(compute_dtype=torch.bfloat16))
    pieces = estimate(
        7_000_000, 8, precision=MixedPrecision(compute_dtype=torch.bfloat16), secondary_shard_group_size=4
    )
    assert plain.secondary_piece_bytes == 0
    assert pieces.secondary_piece_bytes == 7_000_000 // 4 * 2
    assert pieces.by_stage == plain.by_stage
    out = StringIO()
    with redirect_stdout(out):
        main(["--params", "7e6", "--world-size", "8", "--precision", "bf16", "--secondary-shard-group-size", "4"])
    assert "secondary_shard_group_size=4: 3.34 MiB more on the device" in out.getvalue()


def test_zero_plus_plus_buffers_are_lines_of_their_own() -> None:
    """quantize_weights and quantize_gradients: the working memory of the largest unit's quantized gather and
    reduce (the formulas tests/distributed/zero_plus_plus/test_quantized_gradients.py holds to what the profiler
    sees allocated), in the layout the engine would run them (one hop, two hops with hpZ, hybrid's all-reduce
    across groups), printed beside the table, which they leave alone."""
    bf16 = MixedPrecision(compute_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    plain = estimate(7_000_000, 8, precision=bf16)
    both = estimate(7_000_000, 8, precision=bf16, quantize_weights=True, quantize_gradients=True)
    assert (plain.quantized_gather_bytes, plain.quantized_reduce_bytes) == (0, 0)
    assert both.by_stage == plain.by_stage
    shard = 7_000_000 // 8
    assert both.quantized_gather_bytes == gather_working_bytes(shard, 8, 128, 8, 2)
    assert both.quantized_reduce_bytes == reduce_working_bytes(shard, 8, None, 128, 4, 2)
    assert both.quantized_reduce_bytes > 8 * 2 * shard // 4  # at least the int4 gradient, sent and arrived
    two_hops = estimate(7_000_000, 8, precision=bf16, quantize_gradients=True, secondary_shard_group_size=4)
    assert two_hops.quantized_gather_bytes == 0
    assert two_hops.quantized_reduce_bytes == reduce_working_bytes(shard, 8, 4, 128, 4, 2)
    hybrid = estimate(
        7_000_000, 8, precision=bf16, quantize_gradients=True, shard_group_size=4, quantization_block_size=64
    )
    inside, across = (
        reduce_working_bytes(2 * shard, 4, None, 64, 4, 2),
        all_reduce_working_bytes(2 * shard, 2, 64, 4, 2),
    )
    assert hybrid.quantized_reduce_bytes == max(inside, across)
    with torch.device("meta"):  # a model: its largest unit decides
        model = TinyTransformer(blocks=2, vocab=4096)
    units = count_units(model, shared_config(wrap_policy=Block))
    largest = max(-(-unit.numel // 8) for unit in units)
    by_model = estimate(model, 8, wrap_policy=Block, quantize_weights=True)
    assert by_model.quantized_gather_bytes == gather_working_bytes(largest, 8, 128, 8, 4)
    out = StringIO()
    with redirect_stdout(out):
        main(["--params", "7e6", "--world-size", "8", "--quantize-weights", "true", "--quantize-gradients", "true"])
    assert "quantize_weights: up to" in out.getvalue() and "packed int4 buffers" in out.getvalue()


def test_an_asynchronous_saves_host_copy_is_a_line_of_its_own() -> None:
    """asynchronous_checkpoints: each rank's shard of the fp32 weights and of the optimizer state, kept in host
    memory from the first asynchronous save on (tests/distributed/checkpoint/test_async_save.py holds it to what
    the engine copies), printed beside the table, which it leaves alone; hybrid sharding copies a shard group's
    share."""
    plain = estimate(7_000_000, 8)
    staged = estimate(7_000_000, 8, asynchronous_checkpoints=True)
    assert plain.checkpoint_staging_bytes == 0 and staged.by_stage == plain.by_stage
    assert staged.checkpoint_staging_bytes == 7_000_000 // 8 * (4 + 8)
    hybrid = estimate(7_000_000, 8, asynchronous_checkpoints=True, shard_group_size=4)
    assert hybrid.checkpoint_staging_bytes == 7_000_000 // 4 * (4 + 8)
    out = StringIO()
    with redirect_stdout(out):
        main(["--params", "7e6", "--world-size", "8", "--asynchronous-checkpoints", "true"])
    assert "asynchronous_checkpoints: 10.01 MiB more of host memory per rank" in out.getvalue()
