"""An Accelerate YAML written for DeepSpeed, as `accelerate config` writes it and as TRL's and the fine-tuning recipes'
READMEs launch it: what asks for our own behaviour is accepted, what DeepSpeed's engine would do is done, and a
refusal names the file and the block's key (never a flag the user did not type)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from accelerate_zero.launch import plugin_from_arguments
from accelerate_zero.plugin import DEEPSPEED_CLIPPING_ENV, DEEPSPEED_CONFIG_ENV, ZeroPlugin
from tests.paths import TESTS

# huggingface/trl's examples/accelerate_configs/deepspeed_zero3.yaml, as TRL ships it (the wild corpus' copy).
TRL_ZERO3 = (TESTS / "deepspeed_configs" / "wild" / "trl_deepspeed_zero3.yaml").read_text()


def _yaml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "deepspeed_zero3.yaml"
    path.write_text(text)
    return str(path)


@pytest.fixture(autouse=True)
def _no_launch_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", DEEPSPEED_CLIPPING_ENV, DEEPSPEED_CONFIG_ENV):
        monkeypatch.delenv(name, raising=False)


def test_the_standard_multinode_launcher_is_what_runs_here_and_the_others_are_refused(tmp_path: Path) -> None:
    """``standard`` is torch's own launcher: TRL's file reads as ``--zero_stage 3`` does (the launcher option is
    not handed on, so Accelerate's launcher does not act on it); DeepSpeed's ssh and MPI launchers are refused
    with what to give instead, naming the file and the key."""
    plugin, launch_args = plugin_from_arguments(["--config_file", _yaml(tmp_path, TRL_ZERO3), "train.py"])
    native, _ = plugin_from_arguments(["--zero_stage", "3", "train.py"])
    assert plugin == native
    assert launch_args.deepspeed_multinode_launcher is None
    for launcher in ("pdsh", "openmpi", "mvapich", "slurm"):
        path = _yaml(tmp_path, TRL_ZERO3.replace("launcher: standard", f"launcher: {launcher}"))
        with pytest.raises(ValueError) as refused:
            plugin_from_arguments(["--config_file", path, "train.py"])
        message = str(refused.value)
        assert message.startswith(f"{path}: deepspeed_config.deepspeed_multinode_launcher {launcher}: "), message
        assert "--num_machines, --machine_rank and --main_process_ip" in message and "--deepspeed" not in message


def test_gradient_clipping_in_the_block_clips_each_step_as_a_json_configs_does(tmp_path: Path) -> None:
    """``gradient_clipping`` in the block (``accelerate config`` writes it there) reaches each process as the same
    key in a DeepSpeed JSON config does: the Accelerator's step clips at it."""
    text = TRL_ZERO3.replace("  zero_stage: 3\n", "  zero_stage: 3\n  gradient_clipping: 0.5\n")
    plugin_from_arguments(["--config_file", _yaml(tmp_path, text), "train.py"])
    from_block = ZeroPlugin().deepspeed_loop.loop  # in a launched process, from what the launcher exported
    del os.environ[DEEPSPEED_CLIPPING_ENV]
    json_config = tmp_path / "ds.json"
    json_config.write_text(json.dumps({"zero_optimization": {"stage": 3}, "gradient_clipping": 0.5}))
    plugin_from_arguments(["--zero_config_file", str(json_config), "train.py"])
    from_json = ZeroPlugin().deepspeed_loop.loop
    assert from_block["gradient_clipping"] == from_json["gradient_clipping"] == 0.5


def test_a_clipping_given_twice_and_a_bad_one_are_refused_naming_the_file(tmp_path: Path) -> None:
    json_config = tmp_path / "ds.json"
    json_config.write_text(json.dumps({"zero_optimization": {"stage": 3}, "gradient_clipping": 1.0}))
    twice = f"deepspeed_config:\n  deepspeed_config_file: {json_config}\n  gradient_clipping: 0.5\n"
    twice += "distributed_type: DEEPSPEED\nnum_processes: 2\n"
    path = _yaml(tmp_path, twice)
    with pytest.raises(ValueError, match=f"{path}: deepspeed_config.gradient_clipping 0.5 and {json_config}'s"):
        plugin_from_arguments(["--config_file", path, "train.py"])
    path = _yaml(tmp_path, TRL_ZERO3.replace("  zero_stage: 3\n", "  zero_stage: 3\n  gradient_clipping: -1\n"))
    with pytest.raises(ValueError, match=f"{path}: deepspeed_config.gradient_clipping -1: a number >= 0"):
        plugin_from_arguments(["--config_file", path, "train.py"])
    plugin_from_arguments(["--gradient_clipping", "0.25", "--zero_stage", "2", "train.py"])  # the flag, typed
    assert ZeroPlugin().deepspeed_loop.loop["gradient_clipping"] == 0.25


def test_a_deepspeed_config_is_read_as_one_whatever_its_file_is_called(tmp_path: Path) -> None:
    """open-instruct's DeepSpeed configs are ``.conf`` files: one JSON object is a DeepSpeed config, and a
    ``.yaml`` file stays a ZeRO settings file."""
    conf = tmp_path / "stage3_no_offloading.conf"
    conf.write_text(json.dumps({"zero_optimization": {"stage": 3}, "gradient_accumulation_steps": 2}))
    plugin, _ = plugin_from_arguments(["--zero_config_file", str(conf), "train.py"])
    assert plugin.stage == 3 and os.environ["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] == "2"
    settings = tmp_path / "zero.yaml"
    settings.write_text("stage: 1\n")
    assert plugin_from_arguments(["--zero_config_file", str(settings), "train.py"])[0].stage == 1


def test_an_fp16_config_under_lightning_on_a_cpu_is_told_how_to_run() -> None:
    """Lightning runs ``16-mixed`` as ``bf16-mixed`` on a CPU: the refusal says what makes the file run there."""
    from lightning_zero.deepspeed_config import check_precision
    from zero_core.deepspeed import from_deepspeed

    translated = from_deepspeed({"fp16": {"enabled": True}, "zero_optimization": {"stage": 2}})
    with pytest.raises(ValueError, match=r'on a CPU Lightning runs 16-mixed as bf16-mixed, so there set "fp16"'):
        check_precision(translated, "bf16-mixed", "Trainer")
    check_precision(translated, "16-mixed", "Trainer")
