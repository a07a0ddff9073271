"""Lightning's DeepSpeedStrategy keyword arguments, taken by ZeroStrategy and ZeroFabricStrategy
(``lightning_zero/deepspeed_arguments.py``): ``DeepSpeedStrategy(<keywords>)`` becomes ``ZeroStrategy(<the same
keywords>)`` and trains as those settings would; what cannot be honoured is refused by name, with what to do."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from jsonargparse import ArgumentParser

from lightning_zero import ZeroStrategy
from lightning_zero.deepspeed_arguments import KEYWORDS, LIGHTNING_DEFAULTS, SHARED, fp16_section, lightning_config
from lightning_zero.fabric import ZeroFabricStrategy
from tests.paths import TESTS
from tests.rank_pool import run_distributed
from zero_core import ZeroConfig, user_settings

STRATEGIES = [ZeroStrategy, ZeroFabricStrategy]
CORPUS = TESTS / "deepspeed_configs"
# What every call with DeepSpeedStrategy's keywords has unless told otherwise: its default stage, for fp16
# DeepSpeed's loss scaling (its fp16 section's defaults; loss_scale 0 and the first scale 2**16 are ours too), and
# its ZeRO's skip of a step whose gradients hold inf or NaN.
AS_DEEPSPEED = {"stage": 2, "loss_scale_window": 1000, "loss_scale_hysteresis": 2, "min_loss_scale": 1.0}
AS_DEEPSPEED["skip_nonfinite_steps"] = True

# Each keyword (DeepSpeedStrategy's own and those it shares with ours by name): a call that gives it, and our own
# spelling of the same settings (beyond AS_DEEPSPEED). An empty spelling: accepted without effect.
_OFFLOADED_PARAMS = {"stage": 3, "offload_parameters": True}
CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "zero_optimization": ({"zero_optimization": True}, {}),
    "remote_device": ({"stage": 3, "remote_device": "cpu"}, {"stage": 3}),
    "offload_parameters": (_OFFLOADED_PARAMS, {"stage": 3, "offload_params": "cpu"}),
    "offload_params_device": (
        {**_OFFLOADED_PARAMS, "offload_params_device": "nvme", "nvme_path": "/scratch"},
        {"stage": 3, "offload_params": "nvme", "offload_dir": "/scratch"},
    ),
    "nvme_path": (
        {"offload_optimizer": True, "offload_optimizer_device": "nvme", "nvme_path": "/scratch"},
        {"offload_optimizer": "nvme", "offload_dir": "/scratch"},
    ),
    "params_buffer_count": ({**_OFFLOADED_PARAMS, "params_buffer_count": 8}, {"stage": 3, "offload_params": "cpu"}),
    "params_buffer_size": ({**_OFFLOADED_PARAMS, "params_buffer_size": 10**6}, {"stage": 3, "offload_params": "cpu"}),
    "max_in_cpu": ({**_OFFLOADED_PARAMS, "max_in_cpu": 10**6}, {"stage": 3, "offload_params": "cpu"}),
    # Lightning's default nvme_path for an nvme device, as DeepSpeedStrategy writes it.
    "offload_optimizer_device": (
        {"offload_optimizer": True, "offload_optimizer_device": "nvme"},
        {"offload_optimizer": "nvme", "offload_dir": "/local_nvme"},
    ),
    "optimizer_buffer_count": ({"offload_optimizer": True, "optimizer_buffer_count": 8}, {"offload_optimizer": "cpu"}),
    "block_size": ({"block_size": 4096}, {}),
    "queue_depth": ({"queue_depth": 4}, {}),
    "single_submit": ({"single_submit": True}, {}),
    "overlap_events": ({"overlap_events": False}, {}),
    "thread_count": ({"thread_count": 2}, {}),
    "pin_memory": ({"offload_optimizer": True, "pin_memory": True}, {"offload_optimizer": "cpu"}),
    "sub_group_size": ({"sub_group_size": 10**9}, {}),
    "contiguous_gradients": ({"contiguous_gradients": False}, {}),
    "overlap_comm": ({"overlap_comm": False}, {}),
    "allgather_partitions": ({"allgather_partitions": False}, {}),
    "reduce_scatter": ({"reduce_scatter": False}, {}),
    "allgather_bucket_size": ({"allgather_bucket_size": 5 * 10**8}, {}),
    "reduce_bucket_size": ({"reduce_bucket_size": 5 * 10**8}, {}),
    "zero_allow_untested_optimizer": ({"zero_allow_untested_optimizer": False}, {}),
    "logging_batch_size_per_gpu": ({"logging_batch_size_per_gpu": 4}, {}),
    "logging_level": ({"logging_level": logging.INFO}, {}),
    "initial_scale_power": ({"initial_scale_power": 10}, {"initial_loss_scale": 1024.0}),
    "hysteresis": ({"hysteresis": 3}, {"loss_scale_hysteresis": 3}),
    "cpu_checkpointing": ({"cpu_checkpointing": True}, {"offload_activations": True}),
    "contiguous_memory_optimization": ({"contiguous_memory_optimization": True}, {}),
    "synchronize_checkpoint_boundary": ({"synchronize_checkpoint_boundary": True}, {}),
    "load_full_weights": ({"stage": 3, "load_full_weights": True}, {"stage": 3}),
    "exclude_frozen_parameters": ({"exclude_frozen_parameters": True}, {}),
    # Ours by name, with DeepSpeedStrategy's meaning; with one of its own keywords, its defaults around them.
    "stage": ({"stage": 3, "overlap_comm": True}, {"stage": 3}),
    "partition_activations": ({"partition_activations": True, "overlap_comm": True}, {"partition_activations": True}),
    "offload_optimizer": ({"offload_optimizer": True}, {"offload_optimizer": "cpu"}),
    "loss_scale": ({"loss_scale": 128.0, "hysteresis": 2}, {"loss_scale": 128.0}),
    "loss_scale_window": ({"loss_scale_window": 500, "hysteresis": 2}, {"loss_scale_window": 500}),
    "min_loss_scale": ({"min_loss_scale": 4.0, "hysteresis": 2}, {"min_loss_scale": 4.0}),
}


def test_every_keyword_of_deepspeed_strategy_is_taken_and_none_shadows_a_setting() -> None:
    """Against Lightning's own signatures (the Trainer's DeepSpeedStrategy and Fabric's): every keyword is
    DeepSpeedStrategy's own, ours by name, or one our strategies take as DDP's (and config)."""
    import inspect

    from lightning.fabric.strategies import DeepSpeedStrategy as FabricDeepSpeedStrategy
    from lightning.pytorch.strategies import DeepSpeedStrategy

    ddp = {"accelerator", "parallel_devices", "cluster_environment", "process_group_backend", "timeout", "config"}
    for theirs, precision in ((DeepSpeedStrategy, "precision_plugin"), (FabricDeepSpeedStrategy, "precision")):
        assert set(inspect.signature(theirs).parameters) == KEYWORDS.keys() | SHARED.keys() | ddp | {precision}
        for strategy in STRATEGIES:  # DDP's keywords: the Trainer's strategy takes precision_plugin, Fabric's precision
            assert (ddp - {"config"}) < set(inspect.signature(strategy).parameters)
    assert CASES.keys() == KEYWORDS.keys() | SHARED.keys()
    assert not KEYWORDS.keys() & {s.name for s in user_settings()}
    for strategy in STRATEGIES:
        parameters = inspect.signature(strategy).parameters
        for name, keyword in KEYWORDS.items():
            assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY and parameters[name].default is None
            assert parameters[name].annotation == keyword.annotation | None


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_each_keyword_gives_the_settings_of_our_spelling(strategy: type, name: str) -> None:
    theirs, ours = CASES[name]
    assert strategy(**theirs).zero_config == strategy(**{**AS_DEEPSPEED, **ours}).zero_config


# DeepSpeedStrategy's own keywords that become settings here; the others are accepted without effect.
MAPPED = {"offload_parameters", "offload_params_device", "offload_optimizer_device", "nvme_path", "initial_scale_power",
          "hysteresis", "cpu_checkpointing"}  # fmt: skip


@pytest.mark.parametrize("name", sorted(KEYWORDS.keys() - MAPPED - {"zero_optimization"}))
def test_a_keyword_without_effect_is_listed_at_setup(name: str, caplog: pytest.LogCaptureFixture) -> None:
    """Never silent: a setup line names each one, as a keyword or as the config key it became (DeepSpeed's
    aio section is listed whole)."""
    theirs, ours = CASES[name]
    assert ours in ({}, {"stage": 3}, {"stage": 3, "offload_params": "cpu"}, {"offload_optimizer": "cpu"})
    with caplog.at_level(logging.INFO):
        ZeroStrategy(**theirs)
    listed = " ".join(line for line in caplog.text.splitlines() if "accepted without effect here" in line)
    names = [name, *KEYWORDS[name].keys]
    if any(key.startswith("aio.") for key in KEYWORDS[name].keys):
        names.append("aio")  # DeepSpeed's aio section is one key, without effect as a whole
    assert any(re.search(rf"(^|[ .,]){re.escape(n)}(=| \(|,)", listed) for n in names), caplog.text


def test_zero_optimization_true_asks_for_what_we_do(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        assert ZeroStrategy(zero_optimization=True, stage=3).zero_config == ZeroConfig(**{**AS_DEEPSPEED, "stage": 3})
    assert "accepted without effect" not in caplog.text


def test_our_spelling_alone_keeps_our_defaults_and_a_deepspeed_keyword_brings_deepspeeds() -> None:
    assert ZeroStrategy(stage=3, loss_scale_window=500).zero_config == ZeroConfig(stage=3, loss_scale_window=500)
    assert ZeroStrategy(overlap_comm=True).zero_config.stage == 2  # DeepSpeedStrategy's default stage
    assert ZeroStrategy(3, overlap_comm=True).zero_config.stage == 3
    # offload_optimizer: DeepSpeedStrategy's bool, or our "none"/"cpu"/"nvme", on one keyword.
    for value, device in ((True, "cpu"), (False, "none"), ("cpu", "cpu"), ("none", "none")):
        assert ZeroStrategy(stage=3, offload_optimizer=value).zero_config.offload_optimizer == device
    # Ours at its default gives way to DeepSpeedStrategy's keyword for the same knob (LightningCLI passes both).
    assert ZeroStrategy(cpu_checkpointing=True, offload_activations=False).zero_config.offload_activations
    nvme = ZeroStrategy(offload_optimizer=True, offload_optimizer_device="nvme", nvme_path="/fast")
    assert (nvme.zero_config.offload_optimizer, nvme.zero_config.offload_dir) == ("nvme", "/fast")


@pytest.mark.parametrize(
    "keywords, message",
    [
        ({"zero_optimization": False}, "zero_optimization=False trains plain data parallelism.*use DDPStrategy"),
        ({"offload_parameters": True}, "offload_parameters=True needs stage=3 .*default stage is 2.*pass stage=3"),
        (
            {"offload_optimizer": "cpu", "offload_optimizer_device": "nvme"},
            "offload_optimizer_device='nvme' goes with offload_optimizer=True.*give one",
        ),
        ({"initial_scale_power": 8, "initial_loss_scale": 512.0}, "initial_scale_power=8 and initial_loss_scale=512.0"),
        ({"hysteresis": 3, "loss_scale_hysteresis": 2}, "hysteresis=3 and loss_scale_hysteresis=2 set one knob"),
        ({"hysteresis": 0}, r"hysteresis -> fp16.hysteresis.*fp16.hysteresis=0 \(an integer >= 1"),
        (
            {"offload_optimizer": True, "offload_optimizer_device": "gpu"},
            r"offload_optimizer_device -> zero_optimization.offload_optimizer.device.*device='gpu' \(\"none\"",
        ),
        ({"overlap_comm": "yes"}, r"zero_optimization.overlap_comm='yes' \(true, false or \"auto\"\)"),
        ({"logging_batch_size_per_gpu": 0}, r"train_micro_batch_size_per_gpu=0 \(an integer >= 1"),
        ({"remote_device": "gpu"}, r"remote_device='gpu' \(\"cpu\" or \"nvme\""),
        ({"load_full_weights": "yes"}, r"load_full_weights='yes' \(True or False\)"),
        ({"logging_level": "info"}, r"logging_level='info' \(a logging level"),
        # The same setting both ways, differently: the keywords' config against ours.
        ({**_OFFLOADED_PARAMS, "offload_params": "nvme"}, "offload_params='nvme' against the config's 'cpu'"),
        (
            {"offload_optimizer": True, "offload_optimizer_device": "nvme", "nvme_path": "/a", "offload_dir": "/b"},
            "offload_dir='/b' against the config's '/a'",
        ),
    ],
)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_what_cannot_be_honoured_is_refused_by_name(strategy: type, keywords: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        strategy(**keywords)


def test_with_a_config_the_keywords_deepspeed_strategy_ignores_there_are_refused() -> None:
    """DeepSpeedStrategy(config=...) builds no config from its keywords: they would be silently unused there, so
    they are refused; its fp16 knobs still fill a config without an fp16 section in, as there; the keywords it
    uses itself (remote_device, ...) keep their treatment."""
    config = {"zero_optimization": {"stage": 3}}
    with pytest.raises(ValueError, match="overlap_comm=False with config=: DeepSpeedStrategy ignores it there.*set "
                       "zero_optimization.overlap_comm in the config, or drop the keyword"):  # fmt: skip
        ZeroStrategy(config=config, overlap_comm=False)
    with pytest.raises(ValueError, match="offload_optimizer=True with config=.*zero_optimization.offload_optimizer"):
        ZeroFabricStrategy(config=config, offload_optimizer=True)
    with pytest.raises(ValueError, match="hysteresis=3 with config=.*the config's fp16 section decides"):
        ZeroStrategy(config={**config, "fp16": {"enabled": True}}, hysteresis=3)
    # No fp16 section: DeepSpeedStrategy's, from its knobs and DeepSpeed's defaults (acting under 16-mixed only).
    expected = ZeroConfig(**{**AS_DEEPSPEED, "stage": 3, "initial_loss_scale": 256.0})
    assert ZeroStrategy(config=config, initial_scale_power=8).zero_config == expected
    assert ZeroStrategy(config=config).zero_config == ZeroConfig(**{**AS_DEEPSPEED, "stage": 3})
    assert ZeroStrategy(config=config, remote_device="cpu", load_full_weights=True).zero_config.stage == 3
    # Ours with a config: as before, given once or in agreement.
    assert ZeroStrategy(config=config, loss_scale_hysteresis=4).zero_config.loss_scale_hysteresis == 4
    with pytest.raises(ValueError, match="stage=2 against the config's 3"):
        ZeroStrategy(config=config, stage=2)


def _all_defaults(**keywords: Any) -> dict[str, Any]:
    """Every keyword at DeepSpeedStrategy's default (as its _create_default_config receives them), then these."""
    return {**{name: value for name, value in LIGHTNING_DEFAULTS.items() if value is not None}, **keywords}


@pytest.mark.parametrize(
    "preset, keywords",
    [
        ("lightning_deepspeed_stage_2.json", {"stage": 2}),
        ("lightning_deepspeed_stage_3_offload.json", {"stage": 3, "offload_optimizer": True,
                                                      "offload_parameters": True}),
        (
            "lightning_deepspeed_stage_3_offload_nvme.json",
            {"stage": 3, "offload_optimizer": True, "offload_parameters": True, "remote_device": "nvme",
             "offload_params_device": "nvme", "offload_optimizer_device": "nvme"},
        ),
    ],
)  # fmt: skip
def test_the_config_is_the_one_lightning_builds_for_its_presets(preset: str, keywords: dict) -> None:
    """Every keyword at Lightning's default: the layout Lightning 2.6.6 wrote for its presets (the corpus)."""
    config, _ = lightning_config(_all_defaults(**keywords))
    assert config == json.loads((CORPUS / preset).read_text())


@pytest.mark.distributed  # a process of its own: Lightning's DeepSpeedStrategy imports DeepSpeed
def test_each_keyword_builds_the_config_lightnings_deepspeed_strategy_builds(tmp_path: Path) -> None:
    """Lightning's own DeepSpeedStrategy (the Trainer's and Fabric's), given each case's keywords, builds the
    config lightning_config builds from them with every other keyword at its default; and under 16-mixed its
    setup adds the fp16 section fp16_section makes ("enabled": "auto" here: the flag decides).
    Why a process of its own: Lightning's DeepSpeedStrategy imports DeepSpeed, whose import changes process-wide
    state (its accelerator, its patches of torch)."""
    pytest.importorskip("deepspeed")
    cases = [theirs for theirs, _ in CASES.values()]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    script = TESTS / "scripts" / "lightning_deepspeed_keywords.py"
    environment = {k: v for k, v in os.environ.items() if k != "PL_DEEPSPEED_CONFIG_PATH"}
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "cases.json"), str(tmp_path / "out.json")],
        env={**environment, "DS_ACCELERATOR": "cpu"}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    for keywords, lightnings in zip(cases, json.loads((tmp_path / "out.json").read_text()), strict=True):
        ours, _ = lightning_config(_all_defaults(**keywords))
        assert ours == lightnings["trainer"] == lightnings["fabric"], keywords
        assert {**fp16_section(keywords), "enabled": True} == lightnings["fp16"], keywords


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_jsonargparse_parses_the_keywords_as_lightning_cli_does(strategy: type) -> None:
    """The keywords are in the signature, so a LightningCLI config sets them (offload_optimizer by our spelling:
    its annotation is the schema's str). LightningCLI passes every setting, ours at our defaults: those stand
    (DeepSpeedStrategy's defaults fill in only what a call leaves out), but where DeepSpeedStrategy's keywords set
    a knob, ours at its default gives way."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--strategy", type=strategy)
    init_args = {"stage": 3, "offload_parameters": True, "hysteresis": 3, "cpu_checkpointing": True,
                 "overlap_comm": False, "logging_batch_size_per_gpu": 4, "offload_optimizer": "cpu"}  # fmt: skip
    class_path = f"{strategy.__module__}.{strategy.__qualname__}"
    parsed = parser.parse_object({"strategy": {"class_path": class_path, "init_args": init_args}})
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # renamed in 4.49
    built = instantiate(parsed).strategy
    # skip_nonfinite_steps: DeepSpeed's ZeRO itself skips a step whose gradients hold inf or NaN.
    expected = ZeroConfig(
        stage=3, offload_params="cpu", loss_scale_hysteresis=3, offload_activations=True, offload_optimizer="cpu",
        skip_nonfinite_steps=True,
    )  # fmt: skip
    assert built.zero_config == expected
    # Ours at a value of its own is no default: it must agree.
    init_args = {"stage": 3, "offload_parameters": True, "offload_params": "nvme", "offload_dir": "/scratch"}
    with pytest.raises(ValueError, match="offload_params='nvme' against the config's 'cpu'"):
        instantiate(parser.parse_object({"strategy": {"class_path": class_path, "init_args": init_args}}))


# ---------------------------------------------------------------- training
def _fit(strategy: Any, precision: str) -> dict[str, Any]:
    import lightning.pytorch as pl

    from lightning_zero import ZeroPrecision
    from tests.lightning_module import TinyLM

    module = TinyLM(batchnorm=False, dataset_size=32)
    # fp16 by the plugin: Trainer(precision="16-mixed") on a CPU would train in bf16.
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=4, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, plugins=[ZeroPrecision(precision)],
    )  # fmt: skip
    trainer.fit(module)
    weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
    engine = trainer.strategy.engine
    offload = (engine.config.offload_optimizer, engine.config.offload_params)
    return {"weights": weights, "losses": module.losses, "scale": engine.loss_scale, "offload": offload}


def _same_training(rank: int, world_size: int) -> dict[str, bool]:
    deepspeeds = _fit(ZeroStrategy(stage=3, offload_optimizer=True, offload_parameters=True), "32-true")
    ours = _fit(ZeroStrategy(stage=3, offload_optimizer="cpu", offload_params="cpu"), "32-true")
    # fp16: the loss scaling DeepSpeedStrategy's keywords ask for (2**10 to start: this model overflows at 2**16).
    deepspeed_fp16 = _fit(ZeroStrategy(stage=3, offload_optimizer=True, initial_scale_power=10), "16-mixed")
    ours_fp16 = _fit(
        ZeroStrategy(**{**AS_DEEPSPEED, "stage": 3, "offload_optimizer": "cpu", "initial_loss_scale": 2.0**10}),
        "16-mixed",
    )
    return {
        "fp32": all(torch.equal(deepspeeds["weights"][k], w) for k, w in ours["weights"].items()),
        "fp32 losses": deepspeeds["losses"] == ours["losses"],
        "offloaded": deepspeeds["offload"] == ours["offload"] == ("cpu", "cpu"),  # the same numbers without
        "fp16": all(torch.equal(deepspeed_fp16["weights"][k], w) for k, w in ours_fp16["weights"].items()),
        "fp16 losses": deepspeed_fp16["losses"] == ours_fp16["losses"],
        "fp16 scale": deepspeed_fp16["scale"] == ours_fp16["scale"] == 2.0**10,
    }


def test_deepspeed_keywords_train_bit_for_bit_as_our_spelling() -> None:
    """ZeroStrategy(stage=3, offload_optimizer=True, offload_parameters=True) under the Trainer: the same weights
    and losses as ZeroStrategy(stage=3, offload_optimizer="cpu", offload_params="cpu"); in fp16, with
    initial_scale_power, the same as our spelling of DeepSpeed's loss scaling."""
    (result,) = run_distributed(_same_training, 1)
    assert result == dict.fromkeys(result, True) and len(result) == 6
