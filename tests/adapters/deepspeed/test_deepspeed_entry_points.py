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
from tests.paths import TESTS
from tests.rank_pool import free_port

CONFIGS = TESTS / "deepspeed_configs"
SCRIPTS = TESTS / "scripts"


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


@pytest.mark.parametrize("route", ["arguments", "plugin", "launcher"])
def test_a_contradicting_config_is_refused_naming_the_file_whichever_way_it_arrives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, route: str
) -> None:
    """Issue 51: the DeepSpeed config given as ZeroTrainingArguments(deepspeed=path), as
    ZeroPlugin.from_deepspeed(path), or by accelerate-zero launch (each launched process finds the path in its
    environment) is checked against the TrainingArguments as transformers checks it, when ZeroTrainer is built:
    every mismatch at once, the file named, each key, and what to do. Before, the last two were not checked at all
    (the config's batch and accumulation numbers trained as the arguments said) and the first named no file."""
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from accelerate_zero import ZeroPlugin, ZeroTrainer, ZeroTrainingArguments
    from accelerate_zero.plugin import DEEPSPEED_CONFIG_ENV

    path = tmp_path / "ds_config.json"
    config = {"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 4, "gradient_clipping": 1.0}
    config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": "auto"}}
    path.write_text(json.dumps(config))
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16))
    values = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", gradient_accumulation_steps=2)
    values.update(max_grad_norm=0.5, learning_rate=1e-2)
    plugin = None
    if route == "arguments":
        arguments = ZeroTrainingArguments(**values, deepspeed=str(path))
    else:
        arguments = TrainingArguments(**values)
        if route == "plugin":
            plugin = ZeroPlugin.from_deepspeed(str(path))
        else:
            monkeypatch.setenv(DEEPSPEED_CONFIG_ENV, str(path))
    with pytest.raises(ValueError) as refused:
        ZeroTrainer(model=model, args=arguments, zero_plugin=plugin)
    message = str(refused.value)
    for line in (
        f"values in {path} that mismatch TrainingArguments",
        "- ds gradient_accumulation_steps=4 vs hf gradient_accumulation_steps=2",
        "- ds gradient_clipping=1.0 vs hf max_grad_norm=0.5",
        "- ds optimizer.params.lr=0.001 vs hf learning_rate=0.01",
        f"set these DeepSpeed config values to 'auto' in {path}",
    ):
        assert line in message, message


@pytest.mark.parametrize("flags", [(), ("--zero_persistence_threshold", "7")])
def test_the_launchers_config_is_filled_from_the_model_as_transformers_fills_it(
    monkeypatch: pytest.MonkeyPatch, flags: tuple[str, ...]
) -> None:
    """``accelerate-zero launch --zero_config_file ds_config_zero3.json``: in each process ZeroTrainer fills the
    file's hidden-size "auto"s from the model as transformers does (the persistence threshold 10 x hidden size,
    the prefetch bucket 0.9 x its square), and its sections' "auto"s from the arguments; a flag given beside the
    file still wins over it."""
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from accelerate_zero import ZeroTrainer
    from accelerate_zero.launch import plugin_from_arguments
    from accelerate_zero.plugin import DEEPSPEED_CONFIG_ENV

    for name in [n for n in os.environ if n.startswith("ACCELERATE_ZERO_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv(DEEPSPEED_CONFIG_ENV, "")  # the launcher sets it below: undone after the test
    launched, _ = plugin_from_arguments(["--zero_config_file", str(CONFIGS / f"{ZERO3}.json"), *flags, "train.py"])
    for name, value in launched.environment().items():  # as the launched processes find them
        monkeypatch.setenv(name, value)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16))
    arguments = TrainingArguments(output_dir="out", use_cpu=True, report_to="none", learning_rate=3e-3)
    trainer = ZeroTrainer(model=model, args=arguments)
    assert trainer.zero_plugin.persistence_threshold == (7 if flags else 10 * 16)
    assert trainer.zero_plugin.prefetch_cap_mb == int(0.9 * 16 * 16) * 4 / 2**20
    assert trainer.zero_plugin.offload_params == "cpu"
    assert trainer.zero_plugin.deepspeed_loop.optimizer["params"]["lr"] == 3e-3


def test_a_launched_gradient_clipping_must_equal_max_grad_norm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Accelerate's DeepSpeed gradient_clipping given to the launcher (an Accelerate YAML's deepspeed_config block,
    or the flag) reaches each process; under ZeroTrainer it must equal max_grad_norm, as transformers requires of
    the DeepSpeed config it writes it into, and is refused naming both otherwise (Trainer would clip at its own)."""
    pytest.importorskip("transformers")
    from transformers import TrainingArguments

    from accelerate_zero import ZeroTrainer
    from accelerate_zero.plugin import DEEPSPEED_CLIPPING_ENV

    monkeypatch.setenv(DEEPSPEED_CLIPPING_ENV, "1.0")
    values = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match=r"gradient_clipping 1.0 .*max_grad_norm=0.5\) clips at another norm"):
        ZeroTrainer(model=torch.nn.Linear(2, 2), args=TrainingArguments(**values, max_grad_norm=0.5))
    ZeroTrainer(model=torch.nn.Linear(2, 2), args=TrainingArguments(**values, max_grad_norm=1.0))


def test_a_launched_accumulation_must_equal_the_trainers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TRL's deepspeed_zero1.yaml names gradient_accumulation_steps 1 in its block: a Trainer whose arguments
    accumulate 2 is refused, as transformers refuses it under DeepSpeed, instead of training silently with 2."""
    pytest.importorskip("transformers")
    from transformers import TrainingArguments

    from accelerate_zero import ZeroTrainer
    from accelerate_zero.deepspeed_flags import ACCUMULATION_VARIABLE

    monkeypatch.setenv(ACCUMULATION_VARIABLE, "1")
    values = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with pytest.raises(
        ValueError, match=r"gradient_accumulation_steps 1 .*gradient_accumulation_steps=2\) accumulates"
    ):
        ZeroTrainer(model=torch.nn.Linear(2, 2), args=TrainingArguments(**values, gradient_accumulation_steps=2))
    ZeroTrainer(model=torch.nn.Linear(2, 2), args=TrainingArguments(**values, gradient_accumulation_steps=1))


def test_a_trainingarguments_config_beside_another_launched_one_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two DeepSpeed configs, one in the arguments and another given to accelerate-zero launch: one is refused,
    naming both; the same file twice trains (one config)."""
    pytest.importorskip("transformers")
    from accelerate_zero import ZeroPlugin, ZeroTrainer, ZeroTrainingArguments
    from accelerate_zero.plugin import DEEPSPEED_CONFIG_ENV

    launched, given = tmp_path / "launched.json", tmp_path / "given.json"
    launched.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    given.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    for name, value in ZeroPlugin.from_deepspeed(str(launched)).environment().items():  # as the launcher exports
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(DEEPSPEED_CONFIG_ENV, str(launched))
    arguments = ZeroTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", deepspeed=str(given))
    with pytest.raises(
        ValueError, match=rf"deepspeed={given}\) and accelerate-zero launch's DeepSpeed config {launched}"
    ):
        ZeroTrainer(model=torch.nn.Linear(2, 2), args=arguments)
    arguments = ZeroTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", deepspeed=str(launched))
    assert ZeroTrainer(model=torch.nn.Linear(2, 2), args=arguments).zero_plugin.stage == 2


def test_a_trainer_config_refusal_names_the_file() -> None:
    """Issue 51: the refusals of transformers' rules name the file the user gave, not "the DeepSpeed config"."""
    path = str(CONFIGS / "transformers_ds_config_zero3.json")
    with pytest.raises(ValueError, match=rf"{path} sets zero_optimization.reduce_bucket_size.*numbers in {path}"):
        resolve_for_trainer(path, _training_arguments(), _model(None))
    with pytest.raises(ValueError, match=r"(?s)total_num_steps=10 vs hf num_training_steps.*'auto' in ds.json"):
        check_scheduler_step_counts({"params": {"total_num_steps": 10}}, {"total_num_steps": 12}, "ds.json")
    # An "auto" transformers fills from nothing: refused when the trainer is built, not at the first step.
    config = {"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"amsgrad": "auto"}}}
    with pytest.raises(ValueError, match="sets optimizer.params.amsgrad to 'auto'.*write the value in ds.json"):
        resolve_for_trainer(config, _training_arguments(), _model(), "ds.json")


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


def test_a_launched_process_refuses_deepspeed_only_when_transformers_hands_it_the_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The finder each process of accelerate-zero launch puts first on sys.meta_path: ``import deepspeed`` goes
    ahead (its ops, say), except while transformers is handing DeepSpeed the run: Accelerate asked to set up
    DeepSpeed's process group (plain TrainingArguments(deepspeed=...) off the CPU), or a stage-3 config
    registered by plain TrainingArguments (the distributed test below covers that one end to end)."""
    from accelerate_zero.launched import DeepSpeedHandoffRefusal

    finder = DeepSpeedHandoffRefusal()
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    assert finder.find_spec("deepspeed") is None
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert finder.find_spec("deepspeed.comm") is None  # reached only through the package's own import
    with pytest.raises(ImportError, match="DeepSpeed's own distributed state.*accelerate_zero.ZeroTrainingArguments"):
        finder.find_spec("deepspeed")


def _run_trainer(out: Path, launch: bool, *cases: str, launcher: tuple[str, ...] = ()) -> None:
    """Why a process of its own: `accelerate-zero launch` with a DeepSpeed config is the entry point under test."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_ZERO") and k != "ACCELERATE_USE_ZERO"}
    env["ACCELERATE_USE_CPU"] = "1"
    script = [str(SCRIPTS / "deepspeed_trainer_run.py"), str(out), *cases]
    if launch:
        command = [sys.executable, "-m", "accelerate_zero.launch", "launch", *launcher]
        command += ["--multi_gpu", "--num_processes", "2", "--main_process_port", str(free_port())]
        command += ["--mixed_precision", "no", *script]
    else:
        command = [sys.executable, *script]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]


def _report(out: Path, case: str) -> dict:
    return json.loads((out / f"{case}.json").read_text())


def _trains_as(native: dict, config: dict, name: str) -> None:
    """The losses and the final weights of the two runs, bit for bit."""
    assert len(config["losses"]) == 5 and config["losses"] == native["losses"], name
    assert config["weights"].keys() == native["weights"].keys()
    for weight, values in native["weights"].items():
        assert torch.equal(torch.tensor(config["weights"][weight]), torch.tensor(values)), (name, weight)


ZERO2 = "transformers_ds_config_zero2"
ZERO3 = "transformers_ds_config_zero3"
BF16 = "transformers_ds_config_zero3_bf16"


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every launch of the Trainer tests below, side by side (a launch keeps about one of two cores busy):

    - ``native``: 2 processes where ``import deepspeed`` fails: the stock files' settings written our way, and the
      files through ``ZeroTrainingArguments(deepspeed=...)`` and ``ZeroPlugin.from_deepspeed``;
    - ``flag``: ``accelerate-zero launch --zero_config_file ds_config_zero2.json``, the script's Trainer without
      deepspeed=; first in it, ``from_pretrained`` after plain ``TrainingArguments(deepspeed=<stage 3>)``;
    - ``yaml``: ``accelerate-zero launch --config_file`` with an Accelerate YAML naming ds_config_zero2.json;
    - ``single``: one process, plain ``TrainingArguments(deepspeed=...)`` (where DeepSpeed is installed)."""
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    folders = {name: tmp_path_factory.mktemp(name) for name in ("native", "flag", "yaml", "single")}
    saved_model = folders["flag"] / "saved-model"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16)).save_pretrained(
        saved_model
    )
    zero2 = str(CONFIGS / f"{ZERO2}.json")
    yaml_file = folders["yaml"] / "default_config.yaml"
    yaml_file.write_text(
        f"compute_environment: LOCAL_MACHINE\ndeepspeed_config:\n  deepspeed_config_file: {zero2}\n"
        "  zero3_init_flag: false\ndistributed_type: DEEPSPEED\nnum_machines: 1\nnum_processes: 2\n"
    )
    native = ["native", "config", f"native:{ZERO2}", f"config:{ZERO2}", f"config:{BF16}", f"plugin:{ZERO2}"]
    deepspeed_installed = find_spec("deepspeed") is not None
    # Plain TrainingArguments(deepspeed=...) can be built only where DeepSpeed is installed.
    flag = ([f"from_pretrained:{ZERO3}={saved_model}"] if deepspeed_installed else []) + [f"launched:{ZERO2}"]
    launches = [
        (folders["native"], True, "--without-deepspeed", *native, ()),
        (folders["flag"], True, *flag, ("--zero_config_file", zero2)),
        (folders["yaml"], True, f"launched:{ZERO2}", ("--config_file", str(yaml_file))),
    ]
    if deepspeed_installed:
        launches.append((folders["single"], False, "native", "plain", ()))
    with ThreadPoolExecutor(max_workers=2) as runs:
        started = [
            runs.submit(_run_trainer, out, launch, *cases, launcher=launcher)
            for out, launch, *cases, launcher in launches
        ]
        for run in started:
            run.result()
    return folders


def test_stock_zero3_config_trains_as_the_native_run_without_deepspeed(trainer_runs: dict[str, Path]) -> None:
    """transformers' stock ds_config_zero3.json ("auto"s, CPU offload of both) through an unchanged Trainer script
    (ZeroTrainingArguments for TrainingArguments), on 2 processes where ``import deepspeed`` fails: the losses
    and weights of ZeroTrainer given the same settings our way, bit for bit. Then, with DeepSpeed importable,
    plain ``TrainingArguments(deepspeed=...)`` trains the same on one process. In the same launch, the stock
    ds_config_zero2.json (CPU offload of the optimizer) and ds_config_zero3_bf16.json (its ``bfloat16`` section
    "auto", off as these arguments' bf16) likewise."""
    out = trainer_runs["native"]
    pairs = {  # (native, config) report names, and the settings both ran with
        ("native", "config"): {"stage": 3, "offload": "cpu"},
        (f"native-{ZERO2}", f"config-{ZERO2}"): {"stage": 2, "offload": "none"},
        ("native", f"config-{BF16}"): {"stage": 3, "offload": "cpu"},
    }
    for (native_name, config_name), settings in pairs.items():
        native, config = _report(out, native_name), _report(out, config_name)
        assert config["arguments"] == "ZeroTrainingArguments"
        assert config["settings"] == native["settings"] == settings, config_name
        _trains_as(native, config, config_name)
    pytest.importorskip("deepspeed")  # plain TrainingArguments(deepspeed=...) needs it to be built at all
    native, plain = _report(trainer_runs["single"], "native"), _report(trainer_runs["single"], "plain")
    assert plain["arguments"] == "ZeroTrainingArguments"  # rebuilt from the plain arguments
    assert plain["losses"] == native["losses"] and plain["weights"] == native["weights"]


@pytest.mark.parametrize("route", ["plugin", "flag", "yaml"])
def test_stock_zero2_config_trains_as_the_native_run_whichever_way_it_arrives(
    trainer_runs: dict[str, Path], route: str
) -> None:
    """Issue 51: the stock ds_config_zero2.json ("auto"s, an AdamW and a WarmupLR section) given to an unchanged
    Trainer script (TrainingArguments without deepspeed=) as ``ZeroTrainer(zero_plugin=ZeroPlugin.from_deepspeed
    (path))``, as ``accelerate-zero launch --zero_config_file path``, and as an Accelerate YAML's
    ``deepspeed_config_file``: read as transformers reads TrainingArguments(deepspeed=...) (its "auto"s from the
    arguments, its sections built), so each trains bit for bit as the native run (stage 2, CPU offload of the
    optimizer, the AdamW and WarmupLR written out), as ZeroTrainingArguments(deepspeed=path) does. Before, each
    stopped at the first step with Accelerate's "You cannot specify an optimizer in the config file and in the
    code at the same time"."""
    native = _report(trainer_runs["native"], f"native-{ZERO2}")
    folder, name = (trainer_runs["native"], "plugin") if route == "plugin" else (trainer_runs[route], "launched")
    ours = _report(folder, f"{name}-{ZERO2}")
    assert ours["arguments"] == "TrainingArguments"
    assert ours["settings"] == native["settings"] == {"stage": 2, "offload": "none"}
    _trains_as(native, ours, route)


def test_from_pretrained_after_plain_stage3_training_arguments_is_refused_before_deepspeed(
    trainer_runs: dict[str, Path],
) -> None:
    """Issue 51: under accelerate-zero launch on 2 processes, ``from_pretrained`` after plain
    ``TrainingArguments(deepspeed=<stage 3>)`` would load inside ``deepspeed.zero.Init`` (on CPU it died there:
    DeepSpeed's own distributed state is never set up). It is refused on every rank as DeepSpeed is imported for
    it, before DeepSpeed runs anything, naming ZeroTrainingArguments; the launch then trains on (the flag case)."""
    pytest.importorskip("deepspeed")  # plain TrainingArguments(deepspeed=...) needs it to be built at all
    outcomes = [_report(trainer_runs["flag"], f"from_pretrained-{rank}") for rank in (0, 1)]
    assert outcomes[0] == outcomes[1]
    assert outcomes[0]["error"] == "ImportError", outcomes[0]
    message = outcomes[0]["message"]
    assert "accelerate_zero.ZeroTrainingArguments" in message and "deepspeed.zero.Init" in message


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
    assert f"{path}: deepspeed_config.zero3_init_flag true (" in capsys.readouterr().err  # the file's key, not a flag
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
        ("zero_stage: 3\n  zero_stag: 2", r"deepspeed_config has key\(s\) \['zero_stag'\]"),
        ("zero_stage: 3\n  deepspeed_multinode_launcher: pdsh", "deepspeed_config.deepspeed_multinode_launcher pdsh"),
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
