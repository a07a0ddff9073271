"""zero_core.fit: the activations it measures on fake tensors are what a real forward saves, its choice is the
first candidate of the cost order that fits the budget (each candidate's figure the estimator's model states
plus the stated terms), and bad budgets are refused with what to do."""

from __future__ import annotations

import contextlib
import importlib.util

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from tests.models import Block, TinyTransformer, lm_loss
from zero_core import MemoryBudget, WrapPolicy, ZeroConfig, estimate, fit
from zero_core.fit_cli import main as zero_fit
from zero_core.memory.activations import _count_saved, default_loss, measure_activations
from zero_core.memory.estimate import count_units
from zero_core.memory.fit import StatePlacement

GiB, MiB = 2**30, 2**20
SEQ = 128


def _model() -> TinyTransformer:
    with torch.device("meta"):
        return TinyTransformer(blocks=4, width=64, vocab=256)


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return lm_loss(model(ids), ids)


def _defaults() -> dict:
    defaults = dict(world_size=2, global_batch_size=16, wrap_policy=Block, loss_fn=_loss, device="cpu")
    defaults["overhead_bytes"] = 0  # the model's own bytes, not the process's, decide the choice
    return defaults


def _fit(budget, **kwargs):
    return fit(_model, torch.zeros(1, SEQ, dtype=torch.long), budget=budget, **{**_defaults(), **kwargs})


def test_budgets_parse_in_every_form_and_bad_ones_say_what_to_use() -> None:
    assert MemoryBudget.of("20GiB") == MemoryBudget(device=20 * GiB)
    assert MemoryBudget.of("device=1GB, host=2GiB,disk=1TB") == MemoryBudget(10**9, 2 * GiB, 10**12)
    assert MemoryBudget.of({"device": "512MiB", "disk": 10**9}) == MemoryBudget(512 * MiB, None, 10**9)
    assert MemoryBudget.of(12345) == MemoryBudget(device=12345)
    assert MemoryBudget.of(" device = 20 GiB , disk=1TB") == MemoryBudget(device=20 * GiB, disk=10**12)
    assert MemoryBudget.of({"device": 2.0e9, "host": None}) == MemoryBudget(device=2 * 10**9)
    for bad, words in [
        ("20 GX", "is not a size"),
        ("1e400", "not a finite size"),
        ("device=1GiB,device=2GiB", "write each tier once"),
        ("20GiB,host=1GiB", "is not one tier=size"),
        ("gpu=1GiB", "use device=, host= and disk="),
        (0, "a positive integer"),
        (True, "a positive integer"),
        ("device=-1GiB", "is not a size"),
    ]:
        with pytest.raises(ValueError, match=words):
            MemoryBudget.of(bad)


def _saved_for_real(model: torch.nn.Module, batch, loss_fn) -> int:
    """What a real forward on the CPU saves for backward, counted by the same counter as the fake run."""
    return _count_saved(model, batch, [], contextlib.nullcontext(), loss_fn).kept(False)


@pytest.mark.parametrize("samples", [1, 2, 5, 8])
def test_the_fake_run_saves_what_a_real_forward_saves(samples: int) -> None:
    """The fake tensors pick the CPU's kernels, so the count at 2 and 3 samples equals a real run's, byte for
    byte, and the line through them gives every larger batch exactly and errs high at 1."""
    torch.manual_seed(0)
    real = TinyTransformer(blocks=4, width=64, vocab=256)
    policy = WrapPolicy(module_classes=(Block,))
    profile = measure_activations(
        _model(), torch.zeros(1, SEQ, dtype=torch.long), wrap_policy=policy, bucket_numel=10**6, loss_fn=_loss
    )
    assert profile.smaller.kept(False) == _saved_for_real(real, torch.randint(0, 256, (2, SEQ)), _loss)
    real_bytes = _saved_for_real(real, torch.randint(0, 256, (samples, SEQ)), _loss)
    if samples == 1:
        assert real_bytes < profile.kept_bytes(1, False) < real_bytes * 1.01
    else:
        assert profile.kept_bytes(samples, False) == real_bytes
    assert profile.checkpointed_blocks == ("blocks.0", "blocks.1", "blocks.2", "blocks.3")
    # Checkpointed, each block keeps its input instead of what it saves, and one block is recomputed at once.
    saved = profile.smaller
    assert saved.kept(True) == saved.outside_blocks + sum(saved.block_inputs) + max(saved.in_blocks)
    assert saved.kept(True) < saved.kept(False)
    assert profile.peak_bytes(samples, False) == profile.kept_bytes(samples, False) + 2 * (
        saved.largest_saved + (profile.larger.largest_saved - saved.largest_saved) * (samples - 2)
    )


def _tiny_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_a_hugging_face_model_measures_as_it_runs_with_the_cpus_attention() -> None:
    from transformers import LlamaForCausalLM

    config = _tiny_llama_config()
    torch.manual_seed(0)
    real = LlamaForCausalLM(config)
    with torch.device("meta"):
        meta = LlamaForCausalLM(config)
    ids = torch.zeros(2, 16, dtype=torch.long)
    batch = {"input_ids": ids, "labels": ids}
    policy = WrapPolicy(module_classes=(type(real.model.layers[0]),))
    profile = measure_activations(meta, batch, wrap_policy=policy, bucket_numel=10**6)
    assert profile.smaller.kept(False) == _saved_for_real(real, batch, default_loss)
    assert len(profile.checkpointed_blocks) == 2


def _expected_device_bytes(candidate, activations) -> int:
    """The figure the docs state, rebuilt here: the estimator's model states (host and device one memory on a
    CPU), stage 3's gathered units, stages 2/3's two full gradients, autograd's largest gradient, the step's
    working memory, and the activations (at stages 2/3 overlapping the gradient shards)."""
    config = candidate.config
    report = estimate(_model(), 2, config, host_is_device=True)[config.stage]
    units = [-(-u // 2) * 2 for u in _unit_numels()]
    others = sorted(units[1:], reverse=True)
    gathered = (units[0] + sum(others[: 1 + config.prefetch])) * 4 if config.stage == 3 else 0
    reducing = sum(sorted(units, reverse=True)[:2]) * 4 if config.stage >= 2 else 0
    largest_parameter = max(p.numel() for p in _model().parameters() if p.requires_grad) * 4
    trainable = [u.trainable_numel for u in count_units(_model(), config)]
    offloaded = config.offload.offloaded_units(trainable)
    stepping = max((units[i] // 2 for i in range(len(units)) if i not in offloaded), default=0) * 4
    staged = 0
    if config.offload_optimizer == "nvme":
        staged = sum(sorted((units[i] // 2 for i in offloaded), reverse=True)[: config.offload_units_in_memory]) * 8
    peak = activations.peak_bytes(candidate.micro_batch_size, candidate.activation_checkpointing)
    filling = report.gradient_bytes if config.stage >= 2 else 0
    states = report.device_bytes + report.host_bytes
    return states + gathered + reducing + largest_parameter + max(stepping, staged) + max(peak, filling) - filling


def _unit_numels() -> list[int]:
    return [u.numel for u in count_units(_model(), ZeroConfig(wrap_policy=WrapPolicy(module_classes=(Block,))))]


def test_the_choice_is_the_first_candidate_of_the_cost_order_that_fits_on_a_grid_of_budgets(tmp_path) -> None:
    policy = WrapPolicy(module_classes=(Block,))
    activations = measure_activations(
        _model(), torch.zeros(1, SEQ, dtype=torch.long), wrap_policy=policy, bucket_numel=10**6, loss_fn=_loss
    )
    choices = []
    for budget in [int(mib * MiB) for mib in (20, 15.9, 8.8, 5.2, 3.4, 2.6, 2.1)]:
        result = _fit(budget, offload_dir=str(tmp_path))
        assert len({candidate.cost for candidate in result.candidates}) == len(result.candidates)  # no ties
        usable = budget * (1 - result.margin)
        chosen = result.candidates.index(result.choice)
        assert result.choice.predicted.device <= usable
        assert all(candidate.predicted.device > usable for candidate in result.candidates[:chosen])
        for candidate in result.candidates[:: max(1, len(result.candidates) // 40)]:
            assert candidate.predicted.device == _expected_device_bytes(candidate, activations)
        if chosen:
            assert result.runner_up is result.candidates[chosen - 1]
            assert "over the budget: device" in result.runner_up_lost
        choices.append(result.choice)
    # A smaller budget never buys a cheaper configuration; the grid reaches checkpointing and the disk.
    costs = [choice.cost for choice in choices]
    assert costs == sorted(costs)
    assert any(choice.activation_checkpointing for choice in choices)
    assert choices[-1].placement.on_disk and choices[-1].config.offload_optimizer == "nvme"
    assert all(c.micro_batch_size * c.gradient_accumulation_steps == 8 for c in choices)


def test_a_budget_below_every_configuration_names_the_smallest_that_fits() -> None:
    with pytest.raises(ValueError, match="no configuration fits") as refused:
        _fit(MiB)
    message = str(refused.value)
    assert "Without offload_dir the disk tiers were not tried" in message
    smallest = int(message.split(" bytes) per rank")[0].rsplit("(", 1)[1])
    result = _fit(smallest)  # the budget it names is enough, with what it said
    with pytest.raises(ValueError, match="no configuration fits"):
        _fit(smallest - 2)  # and it is the smallest
    assert result.choice.describe() in message
    assert result.choice.placement is StatePlacement.IN_MEMORY


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"world_size": 0}, "world_size=0 is invalid"),
        ({"global_batch_size": 15}, "positive multiple of world_size=2"),
        ({"margin": 1.5}, r"margin=1.5 is invalid"),
        ({"budget": "host=1GiB"}, "no device part"),
        ({"budget": "device=1GiB,host=1GiB"}, "on a CPU device the host is the device"),
        ({"overhead_bytes": -1}, "overhead_bytes=-1 is invalid"),
        ({"optimizer_state_bytes_per_param": 8.0}, "optimizer_state_bytes_per_param=8.0 is invalid"),
    ],
)
def test_bad_input_is_refused_before_any_work(kwargs: dict, words: str) -> None:
    def never_built() -> torch.nn.Module:
        raise AssertionError("the model was built before the input was checked")

    with pytest.raises(ValueError, match=words):
        fit(never_built, torch.zeros(1, SEQ, dtype=torch.long), **{**_defaults(), "budget": GiB, **kwargs})


def test_a_factory_that_returns_no_module_and_a_device_without_support_are_refused() -> None:
    with pytest.raises(ValueError, match="returned a dict, not an nn.Module"):
        fit(dict, torch.zeros(1, SEQ), **{**_defaults(), "budget": GiB})
    if not torch.backends.cuda.is_built():
        with pytest.raises(ValueError, match="built without CUDA; use device='cpu'"):
            _fit(GiB, device="cuda")
    with pytest.raises(ValueError, match=r"MemoryBudget.device=-5 is invalid"):
        MemoryBudget(device=-5)


def test_an_error_of_the_model_itself_is_raised_as_it_is_with_a_note() -> None:
    def wrong_shapes(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return model(ids.view(-1, 3))  # not the model's input

    with pytest.raises(RuntimeError) as raised:
        _fit(GiB, loss_fn=wrong_shapes)
    assert any("counting its activations" in note for note in raised.value.__notes__)


def test_a_forward_that_reads_values_is_refused_with_the_way_out() -> None:
    def reads_a_value(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        loss = _loss(model, ids)
        return loss * float(loss.item() > 0)

    with pytest.raises(ValueError, match="could not run on fake tensors.*activation_bytes="):
        _fit(GiB, loss_fn=reads_a_value)
    given = _fit(GiB, loss_fn=reads_a_value, activation_bytes=10**6)  # measured by the user: no checkpointing
    assert not given.activation_checkpointing


def test_the_chosen_checkpointing_wraps_exactly_the_measured_blocks() -> None:
    every = _fit(GiB).candidates
    smallest = min(c.predicted.device for c in every if c.activation_checkpointing and not c.placement)
    result = _fit(int(smallest / 0.9) + 1)  # in memory only with checkpointing
    assert result.activation_checkpointing
    model = TinyTransformer(blocks=4, width=64, vocab=256)
    result.apply_activation_checkpointing(model)
    wrapped = [name for name, module in model.named_modules() if isinstance(module, CheckpointWrapper)]
    assert wrapped == list(result.checkpointed_blocks)
    with pytest.raises(ValueError, match="already has checkpoint_wrapper blocks"):
        result.apply_activation_checkpointing(model)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_zero_fit_prints_the_choice_and_refuses_a_bad_budget(tmp_path, capsys) -> None:
    _tiny_llama_config().save_pretrained(tmp_path)
    common = ["--hf-config", str(tmp_path), "--world-size", "2", "--device", "cpu", "--sequence-length", "64"]
    assert zero_fit([*common, "--budget", "600MiB", "--global-batch-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "zero fit for device 600.00 MiB per rank" in out and "micro-batch size: 4" in out
    with pytest.raises(SystemExit):
        zero_fit([*common, "--budget", "600 MiBs"])
    assert "is not a size" in capsys.readouterr().err
