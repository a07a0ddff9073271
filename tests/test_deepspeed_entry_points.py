"""The entry points DeepSpeed users already type, on the ZeRO engine: ``TrainingArguments(deepspeed=...)`` with
``ZeroTrainer`` (transformers' "auto" rules, with or without DeepSpeed installed), ``accelerate-zero launch
--config_file`` with an Accelerate DeepSpeed YAML, and Lightning's DeepSpeed strategy names and keywords."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from importlib.util import find_spec
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from accelerate_zero.trainer_deepspeed import (
    check_scheduler_step_counts,
    refuse_partitioned_model,
    resolve_for_trainer,
)

from .distributed import _free_port

CONFIGS = Path(__file__).parent / "deepspeed_configs"
SCRIPTS = Path(__file__).parent / "scripts"


# ---------------------------------------------------------------- TrainingArguments(deepspeed=...)
def _training_arguments(**overrides: object) -> SimpleNamespace:
    """The TrainingArguments values transformers' DeepSpeed rules read."""
    values = dict(
        world_size=2,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_grad_norm=0.5,
        learning_rate=3e-4,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_epsilon=1e-6,
        weight_decay=0.1,
        fp16=False,
        fp16_full_eval=False,
        bf16=True,
        bf16_full_eval=False,
        auto_find_batch_size=False,
    )
    return SimpleNamespace(**{**values, **overrides})


def _model(hidden_size: int | None = 32) -> SimpleNamespace:
    return SimpleNamespace(config=SimpleNamespace(hidden_size=hidden_size) if hidden_size else SimpleNamespace())


def test_training_arguments_fill_the_autos_as_transformers_does() -> None:
    config = json.loads((CONFIGS / "transformers_ds_config_zero3.json").read_text())
    resolved = resolve_for_trainer(config, _training_arguments(), _model(32))
    assert resolved["train_micro_batch_size_per_gpu"] == 4
    assert resolved["gradient_accumulation_steps"] == 2
    assert resolved["train_batch_size"] == 2 * 4 * 2
    assert resolved["gradient_clipping"] == 0.5
    assert resolved["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1}
    assert resolved["scheduler"]["params"]["warmup_min_lr"] == 0
    assert resolved["scheduler"]["params"]["warmup_max_lr"] == 3e-4
    assert resolved["scheduler"]["params"]["warmup_num_steps"] == "auto"  # the run's length decides it later
    assert resolved["fp16"]["enabled"] is False  # TrainingArguments(bf16=True): not fp16
    zero = resolved["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"]) == (32 * 32, int(0.9 * 32 * 32))
    assert zero["stage3_param_persistence_threshold"] == 320
    assert config["gradient_clipping"] == "auto"  # the user's dict is left as it was


def test_training_arguments_that_contradict_the_config_are_refused_all_at_once() -> None:
    config = {
        "zero_optimization": {"stage": 2},
        "gradient_accumulation_steps": 4,
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "fp16": {"enabled": True},
    }
    with pytest.raises(ValueError) as refused:
        resolve_for_trainer(config, _training_arguments(), _model())
    message = str(refused.value)
    for line in (
        "ds gradient_accumulation_steps=4 vs hf gradient_accumulation_steps=2",
        "ds train_micro_batch_size_per_gpu=8 vs hf per_device_train_batch_size=4",
        "ds optimizer.params.lr=0.001 vs hf learning_rate=0.0003",
        "ds fp16.enabled=True vs hf fp16|fp16_full_eval=False",
    ):
        assert line in message
    assert "set these DeepSpeed config values to 'auto'" in message
    # auto_find_batch_size: the batch sizes are the finder's, as in transformers
    del config["gradient_accumulation_steps"], config["optimizer"], config["fp16"]
    resolve_for_trainer(config, _training_arguments(auto_find_batch_size=True), _model())
    with pytest.raises(ValueError, match="ds scheduler.params.total_num_steps=10 vs hf num_training_steps"):
        check_scheduler_step_counts({"params": {"total_num_steps": 10}}, {"total_num_steps": 12})


def test_hidden_size_autos_without_a_hidden_size_are_refused() -> None:
    config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": "auto"}}
    with pytest.raises(ValueError, match="hidden_size.*give those keys numbers"):
        resolve_for_trainer(config, _training_arguments(), _model(None))


def test_a_model_deepspeed_already_partitioned_is_refused_with_the_fix() -> None:
    model = torch.nn.Linear(2, 2)
    refuse_partitioned_model(model)
    model.weight.ds_id = 0  # what deepspeed.zero.Init leaves on every parameter
    with pytest.raises(ValueError, match="ZeroTrainingArguments"):
        refuse_partitioned_model(model)


def _run_trainer(out: Path, launch: bool, *cases: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_ZERO") and k != "ACCELERATE_USE_ZERO"}
    env["ACCELERATE_USE_CPU"] = "1"
    script = [str(SCRIPTS / "deepspeed_trainer_run.py"), str(out), *cases]
    if launch:
        launcher = [sys.executable, "-m", "accelerate_zero.launch", "launch", "--multi_gpu", "--num_processes", "2"]
        command = [*launcher, "--main_process_port", str(_free_port()), "--mixed_precision", "no", *script]
    else:
        command = [sys.executable, *script]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]


def _report(out: Path, case: str) -> dict:
    return json.loads((out / f"{case}.json").read_text())


@pytest.mark.distributed
def test_stock_zero3_config_trains_as_the_native_run_without_deepspeed(tmp_path: Path) -> None:
    """transformers' stock ds_config_zero3.json ("auto"s, CPU offload of both) through an unchanged Trainer script
    (ZeroTrainingArguments for TrainingArguments), on 2 processes where ``import deepspeed`` fails: the losses
    and weights of ZeroTrainer given the same settings our way, bit for bit. Then, with DeepSpeed importable,
    plain ``TrainingArguments(deepspeed=...)`` trains the same on one process. In the same launch, the stock
    ds_config_zero2.json (CPU offload of the optimizer) and ds_config_zero3_bf16.json (its ``bfloat16`` section
    "auto", off as these arguments' bf16) likewise."""
    pytest.importorskip("transformers")
    zero2, bf16 = "transformers_ds_config_zero2", "transformers_ds_config_zero3_bf16"
    others = [f"native:{zero2}", f"config:{zero2}", f"config:{bf16}"]
    single = tmp_path / "single"
    single.mkdir()
    with ThreadPoolExecutor(max_workers=2) as runs:  # side by side: a launch keeps about one of two cores busy
        # The one-process run below starts now where DeepSpeed is installed; it is asserted on after the launch's.
        single_run = runs.submit(_run_trainer, single, False, "native", "plain") if find_spec("deepspeed") else None
        runs.submit(_run_trainer, tmp_path, True, "--without-deepspeed", "native", "config", *others).result()
    pairs = {  # (native, config) report names, and the settings both ran with
        ("native", "config"): {"stage": 3, "offload": "cpu"},
        (f"native-{zero2}", f"config-{zero2}"): {"stage": 2, "offload": "none"},
        ("native", f"config-{bf16}"): {"stage": 3, "offload": "cpu"},
    }
    for (native_name, config_name), settings in pairs.items():
        native, config = _report(tmp_path, native_name), _report(tmp_path, config_name)
        assert config["arguments"] == "ZeroTrainingArguments"
        assert config["settings"] == native["settings"] == settings, config_name
        assert len(config["losses"]) == 5 and config["losses"] == native["losses"], config_name
        assert config["weights"].keys() == native["weights"].keys()
        for name, values in native["weights"].items():
            assert torch.equal(torch.tensor(config["weights"][name]), torch.tensor(values)), (config_name, name)
    pytest.importorskip("deepspeed")  # plain TrainingArguments(deepspeed=...) needs it to be built at all
    assert single_run is not None
    single_run.result()
    native, plain = _report(single, "native"), _report(single, "plain")
    assert plain["arguments"] == "ZeroTrainingArguments"  # rebuilt from the plain arguments
    assert plain["losses"] == native["losses"] and plain["weights"] == native["weights"]


# ---------------------------------------------------------------- accelerate-zero launch --config_file accel.yaml
ACCELERATE_YAML = """compute_environment: LOCAL_MACHINE
debug: false
deepspeed_config:
  gradient_accumulation_steps: 4
  offload_optimizer_device: cpu
  offload_param_device: cpu
  zero3_init_flag: true
  zero3_save_16bit_model: true
  zero_stage: 3
distributed_type: DEEPSPEED
downcast_bf16: 'no'
enable_cpu_affinity: false
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""


def _accelerate_yaml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "default_config.yaml"
    path.write_text(text)
    return str(path)


def test_an_accelerate_deepspeed_yaml_is_read_as_its_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The file `accelerate config` writes for DeepSpeed ZeRO-3 with CPU offload: our settings, the accumulation
    as the Accelerator's default, the zero3 flags accepted on a line that says why, and Accelerate handed the same
    file as a plain data-parallel run (which its own loader reads)."""
    import yaml
    from accelerate.commands.config import load_config_from_file

    from accelerate_zero.launch import plugin_from_arguments

    monkeypatch.delenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", raising=False)
    path = _accelerate_yaml(tmp_path, ACCELERATE_YAML)
    plugin, launch_args = plugin_from_arguments(["--config_file", path, "train.py"])
    assert (plugin.stage, plugin.offload_optimizer, plugin.offload_params) == (3, "cpu", "cpu")
    assert os.environ["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] == "4"
    assert "--zero3_init_flag true" in capsys.readouterr().err
    handed = yaml.safe_load(Path(launch_args.config_file).read_text())
    original = yaml.safe_load(ACCELERATE_YAML)
    assert handed.pop("distributed_type") == "MULTI_GPU" and "deepspeed_config" not in handed
    assert handed == {k: v for k, v in original.items() if k not in ("distributed_type", "deepspeed_config")}
    assert load_config_from_file(launch_args.config_file).distributed_type == "MULTI_GPU"
    assert launch_args.zero_stage is None and launch_args.zero3_init_flag is None  # nothing for Accelerate to act on
    # A flag on the command line wins over the file, as under accelerate launch.
    stage2 = ACCELERATE_YAML.replace("offload_param_device: cpu", "offload_param_device: none")
    path = _accelerate_yaml(tmp_path, stage2)
    assert plugin_from_arguments(["--config_file", path, "--zero_stage", "2", "t.py"])[0].stage == 2


def test_an_accelerate_yaml_naming_a_deepspeed_json_reads_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate_zero.launch import plugin_from_arguments

    monkeypatch.delenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", raising=False)
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 2}))
    text = f"deepspeed_config:\n  deepspeed_config_file: {config}\n  zero3_init_flag: false\n"
    text += "distributed_type: DEEPSPEED\nnum_processes: 2\nmixed_precision: 'no'\n"
    plugin, launch_args = plugin_from_arguments(["--config_file", _accelerate_yaml(tmp_path, text), "train.py"])
    assert plugin.stage == 2 and os.environ["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] == "2"
    assert launch_args.deepspeed_config_file is None


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ("zero_stage: 3\n  gradient_clipping: 1.0", "--gradient_clipping: clip in the script"),
        ("zero_stage: 3\n  zero_stag: 2", r"deepspeed_config has key\(s\) \['zero_stag'\]"),
        ("zero_stage: 3\n  deepspeed_multinode_launcher: standard", "--num_machines"),
        ("zero_stage: 3\n  zero3_init_flag: maybe", "true or false"),
    ],
)
def test_an_accelerate_yaml_key_without_a_meaning_here_is_refused(tmp_path: Path, block: str, message: str) -> None:
    from accelerate_zero.launch import plugin_from_arguments

    text = f"deepspeed_config:\n  {block}\ndistributed_type: DEEPSPEED\nnum_processes: 2\n"
    with pytest.raises(ValueError, match=message):
        plugin_from_arguments(["--config_file", _accelerate_yaml(tmp_path, text), "train.py"])


# ---------------------------------------------------------------- Lightning's DeepSpeed preset names
@pytest.mark.parametrize("registry", ["trainer", "fabric"])
def test_lightnings_deepspeed_offload_presets_have_our_names(registry: str) -> None:
    """strategy="zero2_offload" / "zero3_offload" / "zero3_offload_nvme" set what Lightning's
    deepspeed_stage_2_offload, deepspeed_stage_3_offload and deepspeed_stage_3_offload_nvme set; the nvme one's
    directory is the system's temporary directory, which exists on a fresh machine (Lightning's is /local_nvme)."""
    import tempfile

    import lightning_zero  # noqa: F401  (registers the names)

    if registry == "trainer":
        from lightning.pytorch.strategies import StrategyRegistry as names
    else:
        from lightning.fabric.strategies import STRATEGY_REGISTRY as names
    expected = {
        "zero2_offload": (2, "cpu", "none", None),
        "zero3_offload": (3, "cpu", "cpu", None),
        "zero3_offload_nvme": (3, "nvme", "nvme", tempfile.gettempdir()),
    }
    for name, settings in expected.items():
        config = names.get(name).zero_config
        assert (config.stage, config.offload_optimizer, config.offload_params, config.offload_dir) == settings, name
    assert Path(tempfile.gettempdir()).is_dir()
