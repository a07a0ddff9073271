"""Every key DeepSpeed reads has a treatment here, the generated table says it, and bad input is one clear
error naming the file, the key and the fix, before anything starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import ROOT, TESTS
from zero_core.deepspeed import from_deepspeed
from zero_core.deepspeed.key_table import all_rows, markdown

TABLE = ROOT / "docs" / "deepspeed-keys.md"


def _deepspeed_top_level_keys() -> set[str]:
    """The top-level keys DeepSpeed's own ``DeepSpeedConfig`` reads, recorded as it reads a minimal config."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    config_module = pytest.importorskip("deepspeed.runtime.config")
    read: set[str] = set()

    class Keys(list):
        def __contains__(self, key: object) -> bool:
            read.add(str(key))
            return list.__contains__(self, key)

    class Recording(dict):
        def get(self, key, default=None):  # type: ignore[no-untyped-def]
            read.add(key)
            return super().get(key, default)

        def __getitem__(self, key):  # type: ignore[no-untyped-def]
            read.add(key)
            return super().__getitem__(key)

        def __contains__(self, key: object) -> bool:
            read.add(str(key))
            return super().__contains__(key)

        def keys(self):  # type: ignore[no-untyped-def]
            return Keys(super().keys())

    minimal = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}
    config_module.DeepSpeedConfig(Recording(minimal))
    return read


def _deepspeed_section_keys() -> set[str]:
    """The dotted keys of the sections DeepSpeed declares as models (each field and its alias)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )

    sections = {
        "zero_optimization": DeepSpeedZeroConfig,
        "zero_optimization.offload_optimizer": DeepSpeedZeroOffloadOptimizerConfig,
        "zero_optimization.offload_param": DeepSpeedZeroOffloadParamConfig,
        "fp16": DeepSpeedFP16Config,
        "bf16": DeepSpeedBF16Config,
    }
    keys = set()
    for prefix, model in sections.items():
        for name, field in model.model_fields.items():
            keys |= {f"{prefix}.{name}"} | ({f"{prefix}.{field.alias}"} if field.alias else set())
    return keys


def test_every_key_deepspeed_reads_has_a_row() -> None:
    rows = {row.key for row in all_rows()}
    covered = rows | {key.split(".", 1)[0] for key in rows}
    top_level = _deepspeed_top_level_keys()
    assert len(top_level) > 50  # the recording saw DeepSpeed read its config
    assert sorted(top_level - covered) == []
    sections = _deepspeed_section_keys()
    assert len(sections) > 60
    assert sorted(sections - rows) == []


def test_the_generated_table_is_the_code() -> None:
    assert TABLE.read_text() == markdown(), "regenerate it: python -m zero_core.deepspeed > docs/deepspeed-keys.md"
    for row in all_rows():
        assert f"| `{row.key}` | {row.treatment.value}" in TABLE.read_text()


def _refusal(config_or_path) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError) as error:
        from_deepspeed(config_or_path)
    return str(error.value)


def test_bad_input_names_the_file_the_key_and_the_fix(tmp_path: Path) -> None:
    missing = tmp_path / "ds_config.json"
    assert _refusal(missing) == f"{missing}: the DeepSpeed config file does not exist; pass the path of its JSON file."
    assert "the DeepSpeed config file is a directory" in _refusal(tmp_path)
    missing.write_text('{"zero_optimization": {"stage": 3,}}')
    assert _refusal(missing).startswith(f"{missing}: not valid JSON at line 1, column 35 (Expecting property name")
    missing.write_text("[1, 2]")
    assert _refusal(missing) == f"{missing}: a DeepSpeed config is a JSON object, found list."
    missing.write_text(json.dumps({"zero_optimization": {"stage": "3", "overlap_comm": "yes"}, "steps_per_prnt": 10}))
    message = _refusal(missing)
    assert message.startswith(f"{missing}: 3 key(s) cannot be honoured here, so nothing was started: ")
    assert "zero_optimization.stage='3' (the integer 1, 2 or 3; for stage 0 use plain DDP)" in message
    assert "zero_optimization.overlap_comm='yes' (true, false or \"auto\")" in message
    assert "steps_per_prnt=10 (not a DeepSpeed key; did you mean 'steps_per_print'?)" in message
    assert "gradient_clipping=-1 (a number >= 0" in _refusal(
        {"gradient_clipping": -1, "zero_optimization": {"stage": 1}}
    )


@pytest.mark.distributed  # runs the launcher
def test_a_bad_config_stops_the_launch_before_any_process_starts(tmp_path: Path) -> None:
    """Why a process of its own: the launcher is the subject: it must refuse before starting the script."""
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True}}))
    script = tmp_path / "train.py"
    ran = tmp_path / "ran"
    script.write_text(f"open({str(ran)!r}, 'w').close()\n")
    repository = ROOT
    result = subprocess.run(
        [sys.executable, "-m", "accelerate_zero.launch", "launch", "--num_processes", "2", "--zero_config_file"]
        + [str(config), str(script)],
        env={**os.environ, "ACCELERATE_USE_CPU": "1", "PYTHONPATH": str(repository)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert f"accelerate-zero: {config}: 1 key(s) cannot be honoured here" in result.stderr
    assert "zero_optimization.zero_quantized_nontrainable_weights=True (frozen weights kept in int8" in result.stderr
    assert not ran.exists()


def test_keys_accepted_without_effect_are_listed_at_setup(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture
) -> None:
    import argparse
    import logging

    from accelerate_zero.deepspeed_flags import settings_from_deepspeed_file
    from lightning_zero import ZeroStrategy

    config = {"zero_optimization": {"stage": 3, "sub_group_size": 1e9, "stage3_max_live_parameters": 1e9}}
    expected = (
        "DeepSpeed config: 2 key(s) accepted without effect here: zero_optimization.sub_group_size (the offloaded "
        "step already runs unit by unit); zero_optimization.stage3_max_live_parameters (stage 3 keeps the running "
        "unit and `prefetch` units gathered, and releases each after its pass)."
    )
    with caplog.at_level(logging.INFO):
        ZeroStrategy(config=config)
    assert expected in caplog.text
    file = tmp_path / "ds_config.json"
    file.write_text(json.dumps(config))
    settings_from_deepspeed_file(str(file), argparse.Namespace(mixed_precision=None))
    assert f"accelerate-zero: {expected}" in capsys.readouterr().err
    caplog.clear()
    with caplog.at_level(logging.INFO):
        ZeroStrategy(config={"zero_optimization": {"stage": 3}})
    assert "accepted without effect" not in caplog.text


def test_what_deepspeed_ignores_or_only_logs_with_is_accepted_and_said_on_the_setup_line(tmp_path: Path) -> None:
    """LLaMA-Factory's configs carry top-level ``comms_config`` and ``monitor_config`` (names of DeepSpeed's config
    objects, which DeepSpeed 0.19 never reads from the file): accepted, as DeepSpeed trains them; a monitor section
    is accepted with the setup line saying that nothing is written here, and where to log instead."""
    wild = TESTS / "deepspeed_configs" / "wild" / "llamafactory_ds_z3_fp8_config.json"
    line = from_deepspeed(wild).without_effect_line()
    assert line is not None
    assert "comms_config (DeepSpeed 0.19 reads no such key either" in line
    assert "monitor_config (DeepSpeed 0.19 reads no such key either" in line and "nothing is written" in line
    monitors = {"zero_optimization": {"stage": 2}, "tensorboard": {"enabled": True, "output_path": "runs"}}
    line = from_deepspeed(monitors).without_effect_line()
    assert line is not None and "tensorboard (DeepSpeed's monitor: not written here; log with the framework's" in line


def test_every_unknown_key_is_refused_with_what_to_do(tmp_path: Path) -> None:
    """A key DeepSpeed does not read: the nearest key of its own section where one is near, else delete it; never a
    setting of ours that only sounds alike (bf16.loss_scale is fp16's key: bf16 needs none)."""
    config = {
        "zero_optimization": {"stage": 2, "reduce_bucket_sise": 5e8, "totally_new_knob": 1},
        "bf16": {"enabled": True, "loss_scale": 0},
        "a_newer_deepspeeds_key": {},
    }
    message = _refusal(config)
    assert (
        "zero_optimization.reduce_bucket_sise=500000000.0 (not a DeepSpeed key; did you mean 'reduce_bucket_size'?)"
        in message
    )
    assert "zero_optimization.totally_new_knob=1 (not a key DeepSpeed 0.19 reads: delete it, or correct it;" in message
    assert "bf16.loss_scale=0 (bf16 trains without a loss scale, under DeepSpeed too: delete the key)" in message
    assert "a_newer_deepspeeds_key={} (not a key DeepSpeed 0.19 reads: delete it" in message
    assert "nearest setting here" not in message and "no setting here does this" not in message
