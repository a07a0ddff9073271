"""The one settings schema (``zero_core.user_settings()``) reaches every adapter (single process).

Every test iterates the schema: a setting added to ``ZeroConfig`` is covered here, in the
strategies' keyword arguments and signatures, ``ZeroPlugin``, its environment variables,
YAML keys and launcher flags, ``--help`` and the configuration reference, without editing this file.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from jsonargparse import ArgumentParser
from torch import nn

from accelerate_zero import ZeroPlugin
from accelerate_zero.deepspeed_flags import REFUSED
from accelerate_zero.launch import main, plugin_from_arguments
from accelerate_zero.plugin import ENV_PREFIX
from lightning_zero import ZeroStrategy
from lightning_zero.fabric import ZeroFabricStrategy
from zero_core import MixedPrecision, Setting, WrapPolicy, ZeroConfig, user_settings

SETTINGS = user_settings()
STRATEGIES = [ZeroStrategy, ZeroFabricStrategy]


class GPTBlock(nn.Linear):
    """The block class the schema's ``wrap_classes`` example names."""


MODEL = nn.Sequential(GPTBlock(2, 2), nn.ReLU(), GPTBlock(2, 2))


def _ids(setting: Setting) -> str:
    return setting.name


# Every setting's example at once, but the stage's: its example (2) and offload_params' ("cpu", stage 3 only)
# do not go together, nor skip_nonfinite_steps' (true) and offload_step_in_backward's (true), nor
# memory_budget's with the settings it chooses itself. Each is also checked alone.
TOGETHER = [s for s in SETTINGS if s.name not in ("stage", "skip_nonfinite_steps", "memory_budget")]


def _config_value(setting: Setting) -> Any:
    """What ZeroConfig holds when the setting is set to its example."""
    return setting.text.resolve(setting.text.example, MODEL)


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in __import__("os").environ if n.startswith(ENV_PREFIX)]:
        monkeypatch.delenv(name)


def test_the_schema_is_zero_configs_user_facing_fields() -> None:
    """Every field but the precision (each framework's own flag sets it) is a setting, with a
    one-line doc, an example that is valid and not the default, and unique spellings."""
    names = [s.name for s in SETTINGS]
    assert names == [f.name for f in dataclasses.fields(ZeroConfig) if f.name != "mixed_precision"]
    for setting in SETTINGS:
        assert setting.doc and "\n" not in setting.doc, setting.name
        assert setting.text.example != setting.text.default, setting.name
        assert _config_value(setting) != setting.default, setting.name
        ZeroConfig(**{setting.name: _config_value(setting)})  # valid
        assert setting.text.parse(setting.text.format(setting.text.example)) == setting.text.example
        assert setting.keyword.to_config(setting.keyword.default) == setting.default
    for spelling in ([s.text.name for s in SETTINGS], [s.text.flag for s in SETTINGS]):
        assert len(set(spelling)) == len(spelling)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("setting", SETTINGS, ids=_ids)
def test_every_setting_is_a_strategy_keyword_argument(strategy: type, setting: Setting) -> None:
    parameter = inspect.signature(strategy).parameters[setting.name]
    assert parameter.default == setting.keyword.default
    assert parameter.annotation == setting.keyword.annotation
    value = _config_value(setting)
    assert getattr(strategy(**{setting.name: value}).zero_config, setting.name) == value


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategies_keep_their_defaults_and_calling_conventions(strategy: type) -> None:
    assert strategy().zero_config == ZeroConfig()
    assert strategy(2).zero_config.stage == 2  # the stage may come first by position, as before
    assert next(iter(inspect.signature(strategy).parameters)) == "stage"
    assert strategy(wrap_policy=GPTBlock).zero_config.wrap_policy == WrapPolicy(module_classes=(GPTBlock,))
    assert strategy(wrap_policy={GPTBlock}).zero_config.wrap_policy == WrapPolicy(module_classes=(GPTBlock,))
    with pytest.raises(
        TypeError, match=f"{strategy.__name__}.__init__\\(\\) got an unexpected keyword argument 'stages'"
    ):
        strategy(stages=2)
    with pytest.raises(TypeError, match="multiple values for argument 'stage'"):
        strategy(2, stage=3)
    with pytest.raises(ValueError, match="ZeroConfig.stage=5 is invalid"):
        strategy(stage=5)


def _cli_value(value: Any) -> Any:
    """A value as a LightningCLI config file writes it: classes by their import path."""
    if dataclasses.is_dataclass(value):
        return {f.name: _cli_value(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    return [_cli_value(v) for v in value] if isinstance(value, tuple) else value


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_jsonargparse_sees_and_parses_every_setting(strategy: type) -> None:
    """LightningCLI reads the strategy's signature with jsonargparse: every generated parameter
    is parsed from a config and reaches the strategy's config."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--strategy", type=strategy)
    values = {s.name: _config_value(s) for s in TOGETHER}
    class_path = f"{strategy.__module__}.{strategy.__qualname__}"
    init_args = {name: _cli_value(value) for name, value in values.items()}
    parsed = parser.parse_object({"strategy": {"class_path": class_path, "init_args": init_args}})
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # renamed in 4.49
    built = instantiate(parsed).strategy
    assert isinstance(built, strategy)
    assert built.zero_config == ZeroConfig(**values)


def _all_examples() -> dict[str, Any]:
    return {s.text.name: s.text.example for s in TOGETHER}


@pytest.mark.parametrize("setting", SETTINGS, ids=_ids)
def test_every_setting_reaches_the_plugins_config(setting: Setting) -> None:
    plugin = ZeroPlugin(**{setting.text.name: setting.text.example})
    assert getattr(plugin, setting.text.name) == setting.text.example
    assert getattr(plugin.zero_config(MixedPrecision(), MODEL), setting.name) == _config_value(setting)
    assert ZeroPlugin().zero_config(MixedPrecision(), MODEL) == ZeroConfig()


@pytest.mark.parametrize("setting", SETTINGS, ids=_ids)
def test_every_setting_round_trips_through_the_environment(setting: Setting, monkeypatch: pytest.MonkeyPatch) -> None:
    plugin = ZeroPlugin(**{setting.text.name: setting.text.example})
    environment = plugin.environment()
    assert environment[ENV_PREFIX + setting.text.name.upper()] == setting.text.format(setting.text.example)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert ZeroPlugin() == plugin


def test_all_settings_at_once_round_trip_through_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    plugin = ZeroPlugin(**_all_examples())
    for name, value in plugin.environment().items():
        monkeypatch.setenv(name, value)
    assert ZeroPlugin() == plugin
    assert ZeroPlugin(stage=3, prefetch=5) == dataclasses.replace(plugin, stage=3, prefetch=5)  # explicit ones win


def _yaml_value(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


@pytest.mark.parametrize("setting", [*SETTINGS, None], ids=lambda s: "all" if s is None else s.name)
def test_settings_round_trip_through_a_yaml_file(setting: Setting | None, tmp_path: Path) -> None:
    values = _all_examples() if setting is None else {setting.text.name: setting.text.example}
    file = tmp_path / "zero.yaml"
    file.write_text(yaml.safe_dump({name: _yaml_value(value) for name, value in values.items()}))
    assert ZeroPlugin.from_yaml(file) == ZeroPlugin(**values)
    assert plugin_from_arguments(["--zero_config_file", str(file), "train.py"])[0] == ZeroPlugin(**values)


@pytest.mark.parametrize("setting", [*SETTINGS, None], ids=lambda s: "all" if s is None else s.name)
def test_settings_round_trip_through_the_launchers_flags(setting: Setting | None) -> None:
    chosen = TOGETHER if setting is None else [setting]
    flags = [word for s in chosen for word in (s.text.flag, s.text.format(s.text.example))]
    plugin, launch_args = plugin_from_arguments([*flags, "--num_processes", "2", "train.py", "--lr", "1"])
    assert plugin == ZeroPlugin(**{s.text.name: s.text.example for s in chosen})
    assert launch_args.training_script == "train.py" and launch_args.training_script_args == ["--lr", "1"]
    assert not [name for name in vars(launch_args) if name.startswith("zero_setting_")]


def test_the_flags_are_named_after_the_text_spelling_except_the_stage() -> None:
    flags = {s.name: s.text.flag for s in SETTINGS}
    assert flags["stage"] == "--zero_sharding_stage"  # --zero_stage is Accelerate's DeepSpeed flag
    assert all(flag == f"--zero_{s.text.name}" for s in SETTINGS if (flag := s.text.flag) != flags["stage"])
    environment = ZeroPlugin().environment()
    assert sorted(environment) == sorted(
        ["ACCELERATE_USE_ZERO", *(f"{ENV_PREFIX}{s.text.name.upper()}" for s in SETTINGS)]
    )


def _squeezed(text: str) -> str:
    """Text without whitespace, so lines wrapped by argparse (also at hyphens) still match."""
    return re.sub(r"\s+", "", text)


def test_every_flag_is_in_the_launchers_help_with_its_doc(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # As a user types it; with another argument given, Accelerate's formatter hides the groups it
    # does not know unless told otherwise.
    monkeypatch.setattr(sys, "argv", ["accelerate-zero", "launch", "--multi_gpu", "--help"])
    with pytest.raises(SystemExit) as exit:
        main(sys.argv[1:])
    assert exit.value.code == 0
    text = _squeezed(capsys.readouterr().out)
    assert "--zero_config_file" in text
    for setting in SETTINGS:
        assert _squeezed(f"{setting.text.flag} {setting.text.name.upper()} {setting.doc}") in text, setting.name
        assert _squeezed(f"(default: {setting.text.format(setting.text.default) or 'none'})") in text


def test_deepspeeds_flags_with_a_meaning_here_are_honoured() -> None:
    """A DeepSpeed user types Accelerate's DeepSpeed flags; those that mean one of our settings set it
    (Accelerate alone would drop them without --use_deepspeed, and the run would use stage 3)."""
    flags = ["--zero_stage", "1", "--offload_optimizer_device", "nvme", "--offload_optimizer_nvme_path", "/nvme"]
    plugin, launch_args = plugin_from_arguments([*flags, "train.py"])
    assert (plugin.stage, plugin.offload_optimizer, plugin.offload_dir) == (1, "nvme", "/nvme")
    assert launch_args.zero_stage is None and launch_args.offload_optimizer_device is None
    assert plugin_from_arguments(["--zero_stage", "2", "--zero_sharding_stage", "2", "t.py"])[0].stage == 2
    with pytest.raises(ValueError, match="--zero_stage 1 and --zero_sharding_stage 2 disagree"):
        plugin_from_arguments(["--zero_stage", "1", "--zero_sharding_stage", "2", "t.py"])
    with pytest.raises(ValueError, match="stage=0 is invalid"):
        plugin_from_arguments(["--zero_stage", "0", "t.py"])
    plugin, _ = plugin_from_arguments(["--zero_stage", "3", "--offload_param_device", "cpu", "t.py"])
    assert plugin.offload_params == "cpu"
    with pytest.raises(ValueError, match="offload_params='cpu' needs stage=3"):
        plugin_from_arguments(["--zero_stage", "2", "--offload_param_device", "cpu", "t.py"])
    nvme = ["--zero_stage", "3", "--offload_param_device", "nvme", "--offload_param_nvme_path", "/nvme"]
    plugin, _ = plugin_from_arguments([*nvme, "t.py"])
    assert (plugin.offload_params, plugin.offload_dir) == ("nvme", "/nvme")
    with pytest.raises(ValueError, match="--offload_param_nvme_path /other and --offload_optimizer_nvme_path /nvme"):
        plugin_from_arguments([*nvme[:4], "--offload_optimizer_nvme_path", "/nvme", nvme[4], "/other", "t.py"])


@pytest.mark.parametrize("dest", sorted(REFUSED))
def test_deepspeeds_other_flags_are_refused_with_what_to_do(dest: str) -> None:
    value = "true" if dest.startswith("zero3_") else "1"
    with pytest.raises(ValueError, match=f"--{dest}: {re.escape(REFUSED[dest])}"):
        plugin_from_arguments([f"--{dest}", value, "train.py"])


@pytest.mark.parametrize("flag", ["--use_deepspeed", "--use_fsdp"])
def test_asking_accelerate_for_another_framework_is_refused(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", flag, "train.py"]) == 2
    assert f"{flag} asks Accelerate for" in capsys.readouterr().err
