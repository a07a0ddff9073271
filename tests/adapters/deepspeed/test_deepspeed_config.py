"""A DeepSpeed config read as our settings: what has a meaning here mapped, everything else refused at once
(before any process starts), each key with what to do instead; the launcher takes the JSON file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

from accelerate_zero.launch import plugin_from_arguments
from tests.paths import TESTS
from tests.rank_pool import free_port, run_distributed
from zero_core.deepspeed import from_deepspeed

# What DeepSpeed's docs and Hugging Face's examples give ZeRO-3 users (values chosen to differ from ours).
ZERO3 = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": 4,
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": 5e8,
        "stage3_prefetch_bucket_size": 1e7,
        "stage3_param_persistence_threshold": 1e5,
        "stage3_gather_16bit_weights_on_model_save": True,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True, "ratio": 0.5},
        "offload_param": {"device": "cpu", "pin_memory": True},
    },
}


def test_a_zero3_config_maps_to_our_settings() -> None:
    translated = from_deepspeed(ZERO3)
    assert translated.settings == {
        "stage": 3,  # reduce_bucket_size sizes DeepSpeed's buffers, not our units: accepted, not mapped
        "prefetch": "auto",
        "prefetch_cap_mb": pytest.approx(1e7 * 4 / 2**20),
        "persistence_threshold": 100000,
        "offload_optimizer": "nvme",
        "offload_dir": "/local_nvme",
        "offload_fraction": 0.5,
        "offload_params": "cpu",
        "skip_nonfinite_steps": True,  # DeepSpeed's ZeRO-3 skips a step whose gradients hold inf or NaN
    }
    assert translated.precision == "bf16"
    assert translated.loop == {"gradient_accumulation_steps": 4}  # "auto" leaves it to the framework


def test_every_key_that_would_train_otherwise_is_refused_at_once_with_what_to_do() -> None:
    config = {
        "zero_optimization": {
            "stage": 2,
            "overlap_comm": False,  # a knob: accepted without effect
            "sub_group_size": 1e9,
            "zero_quantized_nontrainable_weights": True,  # not built
            "offload_param": {"device": "disk"},
            "offload_optimizer": {"device": "nvme", "nvme_path": "/a"},
            "reduce_bucket_size": "big",  # a knob, but not a value DeepSpeed takes
        },
        "flops_profiler": {"enabled": True},  # reporting: accepted without effect
        "sparse_attention": {"enabled": True},
        "zero_optimisation": {"stage": 3},  # a typo
    }
    with pytest.raises(ValueError) as refused:
        from_deepspeed(config)
    message = str(refused.value)
    assert message.startswith("the DeepSpeed config: 5 key(s) cannot be honoured here, so nothing was started: ")
    for expected in (
        "zero_optimization.zero_quantized_nontrainable_weights=True (frozen weights kept in int8 at rest are not built",
        'zero_optimization.offload_param.device=\'disk\' ("none", "cpu" or "nvme")',
        "zero_optimization.reduce_bucket_size='big' (a number >= 0, or \"auto\")",
        "sparse_attention={'enabled': True} (use the model's own attention)",
        "zero_optimisation={'stage': 3} (not a DeepSpeed key; did you mean 'zero_optimization'?)",
    ):
        assert expected in message
    for accepted in ("overlap_comm", "sub_group_size", "flops_profiler"):
        assert accepted not in message
    del config["zero_optimisation"], config["sparse_attention"]
    config["zero_optimization"].pop("zero_quantized_nontrainable_weights")
    config["zero_optimization"].update(reduce_bucket_size=5e8, offload_param={"device": "cpu"})
    translated = from_deepspeed(config)
    assert translated.without_effect == {
        "zero_optimization.overlap_comm": "collectives always run on their own streams, overlapped with compute",
        "zero_optimization.sub_group_size": "the offloaded step already runs unit by unit",
        "zero_optimization.reduce_bucket_size": "units are our buffers: whole modules (wrap classes) or bucket_size_mb",
        "flops_profiler": "reporting: the framework's logger, profiler and progress bar report here",
    }
    with pytest.raises(ValueError, match="the integer 1, 2 or 3; for stage 0 use plain DDP"):
        from_deepspeed({"zero_optimization": {"stage": 0}})
    # DeepSpeed's default stage is 0 (no ZeRO): a config without one is not run at some stage of ours.
    for no_stage in ({"bf16": {"enabled": True}}, {"zero_optimization": {"overlap_comm": True}}):
        with pytest.raises(ValueError, match=r"zero_optimization.stage is not set \(DeepSpeed then trains without"):
            from_deepspeed(no_stage)
        assert "stage" not in from_deepspeed(no_stage, stage_given=True).settings  # the stage comes from elsewhere
    # ZeRO-Infinity: both sections may name the NVMe path; ours is one offload_dir, so they must agree.
    infinity = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/a"}}
    settings = from_deepspeed(
        {"zero_optimization": {**infinity, "offload_param": {"device": "nvme", "nvme_path": "/a"}}}
    )
    assert (settings.settings["offload_params"], settings.settings["offload_dir"]) == ("nvme", "/a")
    with pytest.raises(ValueError, match=r"offload_param.nvme_path='/b' \(the other offload section's nvme_path"):
        from_deepspeed({"zero_optimization": {**infinity, "offload_param": {"device": "nvme", "nvme_path": "/b"}}})
    # DeepSpeed reads a null offload_param as none.
    assert "offload_params" not in from_deepspeed({"zero_optimization": {"stage": 3, "offload_param": None}}).settings


def test_the_launcher_takes_a_deepspeed_json_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", raising=False)
    monkeypatch.delenv("ACCELERATE_ZERO_DEEPSPEED_CONFIG_FILE", raising=False)
    file = tmp_path / "ds_config.json"
    file.write_text(json.dumps(ZERO3))
    plugin, args = plugin_from_arguments(["--zero_config_file", str(file), "train.py"])
    assert (plugin.stage, plugin.offload_optimizer, plugin.offload_fraction) == (3, "nvme", 0.5)
    assert args.mixed_precision == "bf16"  # the config's precision becomes the launch's
    assert os.environ["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] == "4"  # Accelerator's default from then on
    # The file reaches each process, which builds its sections and clips as DeepSpeed's engine does there.
    assert os.environ["ACCELERATE_ZERO_DEEPSPEED_CONFIG_FILE"] == str(file.resolve())
    with pytest.raises(ValueError, match="asks for bf16, --mixed_precision says fp16: give one"):
        plugin_from_arguments(["--zero_config_file", str(file), "--mixed_precision", "fp16", "train.py"])
    file.write_text(json.dumps({"zero_optimization": {"overlap_comm": True}}))  # the stage from a flag
    assert plugin_from_arguments(["--zero_config_file", str(file), "--zero_stage", "2", "train.py"])[0].stage == 2
    with pytest.raises(ValueError, match="zero_optimization.stage is not set"):
        plugin_from_arguments(["--zero_config_file", str(file), "train.py"])
    file.write_text("{not json")
    with pytest.raises(ValueError, match=r"ds_config.json: not valid JSON at line 1, column 2 \(Expecting property"):
        plugin_from_arguments(["--zero_config_file", str(file), "train.py"])


# A Lightning DeepSpeed user's config: the strategy maps the ZeRO part, the Trainer gets the loop part.
LIGHTNING_DS = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 0.5,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True},
}


def _fit(strategy, **trainer_args):  # type: ignore[no-untyped-def]
    import lightning.pytorch as pl

    from tests.lightning_module import TinyLM

    module = TinyLM(batchnorm=False, dataset_size=32)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=4, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, **trainer_args,
    )  # fmt: skip
    trainer.fit(module)
    weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return trainer, weights


def _lightning_with_config(rank: int, world_size: int) -> dict:
    from lightning_zero import ZeroStrategy

    with_config, ours = _fit(ZeroStrategy(config=LIGHTNING_DS), precision="bf16-mixed")
    native, theirs = _fit(
        ZeroStrategy(stage=2), precision="bf16-mixed", gradient_clip_val=0.5, accumulate_grad_batches=2
    )
    try:
        _fit(ZeroStrategy(config=LIGHTNING_DS), precision="32-true")
        refused = ""
    except ValueError as error:
        refused = str(error)
    return {
        "loop": (with_config.gradient_clip_val, with_config.accumulate_grad_batches),
        "same weights": all(torch.equal(ours[k], theirs[k]) for k in theirs),
        "precision refused": refused,
    }


# The tests that read the launch's reports, and the cases of the second (tests/scripts/deepspeed_same_config.py's
# INF_CASES: bf16.check_grad_overflow true, left out, false, then fp32; rank 1's loss inf in step 1).
LAUNCH_READERS = {
    "test_the_same_config_file_trains_as_deepspeed_itself",
    "test_a_step_with_an_inf_gradient_is_skipped_as_deepspeed_skips_it",
}
INF_CASES = ("1bf16inf", "2bf16inf", "3bf16inf", "2inf")


@pytest.fixture(scope="module")
def same_config_launch(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Path, Future[subprocess.CompletedProcess]] | None]:
    """The DeepSpeed launch of ``test_the_same_config_file_trains_as_deepspeed_itself``, started in the background
    (where that test is selected and DeepSpeed is installed) by the Lightning test before it, which runs beside
    it: each keeps about one of two cores busy."""
    selected = {getattr(item, "originalname", None) for item in request.session.items if item.module is request.module}
    if not selected & LAUNCH_READERS or find_spec("deepspeed") is None:
        yield None
        return
    out = tmp_path_factory.mktemp("same-config")
    script = TESTS / "scripts" / "deepspeed_same_config.py"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += ["--master_port", str(free_port()), str(script), str(out), "1", "2", "3", "3bf16", "2tbs", *INF_CASES]
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    with ThreadPoolExecutor(max_workers=1) as background:
        run = background.submit(subprocess.run, command, env=env, capture_output=True, text=True, timeout=600)
        yield out, run


@pytest.mark.usefixtures("same_config_launch")  # starts the next test's launch, to run beside this one
def test_the_trainer_strategy_takes_a_deepspeed_config_and_trains_as_the_native_settings() -> None:
    (result,) = run_distributed(_lightning_with_config, 1)
    assert result["loop"] == (0.5, 2)  # the config's clipping and accumulation became the Trainer's
    assert result["same weights"]
    assert "asks for bf16, Trainer(precision='32-true')" in result["precision refused"]
    assert "pass Trainer(precision='bf16-mixed')" in result["precision refused"]


def test_fabric_refuses_the_configs_loop_keys_and_a_contradicting_setting() -> None:
    from lightning_zero import ZeroStrategy
    from lightning_zero.fabric import ZeroFabricStrategy

    with pytest.raises(ValueError, match=r"gradient_clipping=1.0: call fabric.clip_gradients"):
        ZeroFabricStrategy(config={"gradient_clipping": 1.0, "zero_optimization": {"stage": 3}})
    with pytest.raises(ValueError, match="stage=3 against the config's 2"):
        ZeroStrategy(stage=3, config={"zero_optimization": {"stage": 2}})
    assert ZeroStrategy(stage=2, config={"zero_optimization": {"overlap_comm": True}}).zero_config.stage == 2
    assert ZeroFabricStrategy(config={"zero_optimization": {"stage": 1}}).zero_config.stage == 1


@pytest.mark.distributed  # a process of its own for Accelerate's once-per-process state
def test_zero_plugin_from_deepspeed_and_the_accelerator_agree_or_refuse() -> None:
    """Why a process of its own (one case): Accelerate makes its state once per process, and the accumulation is
    checked against that state."""
    from accelerate_zero import ZeroAccelerator, ZeroPlugin

    plugin = ZeroPlugin.from_deepspeed(ZERO3)
    assert (plugin.stage, plugin.offload_optimizer, plugin.offload_dir) == (3, "nvme", "/local_nvme")
    with pytest.raises(ValueError, match=r"pass ZeroAccelerator\(mixed_precision='bf16', ...\) \(got 'no'\)"):
        ZeroAccelerator(zero_plugin=plugin, cpu=True, gradient_accumulation_steps=4)
    # Accelerate's state is made once per process: the accumulation (checked against it) in a process of its own.
    code = (
        "from accelerate_zero import ZeroAccelerator, ZeroPlugin\n"
        "from tests.adapters.deepspeed.test_deepspeed_config import ZERO3\n"
        "ZeroAccelerator(zero_plugin=ZeroPlugin.from_deepspeed(ZERO3), cpu=True, mixed_precision='bf16')\n"
    )
    env = {**os.environ, "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "2"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert "pass ZeroAccelerator(gradient_accumulation_steps=4, ...) (got 2)" in result.stderr, result.stderr[-2000:]
    # Clipping is DeepSpeed's engine's under Accelerate: the config's number, else (absent, or "auto" as
    # Accelerate fills it) DeepSpeed 0.19's default 1.0, applied in each optimizer step; ZeroTrainer clips itself.
    for given, clip in ((0.25, 0.25), ("auto", 1.0), (None, 1.0), (0, 0)):
        config = {**ZERO3, "gradient_clipping": given} if given is not None else ZERO3
        assert ZeroPlugin.from_deepspeed(config).deepspeed_loop.loop["gradient_clipping"] == clip
    assert "gradient_clipping" not in ZeroPlugin.from_deepspeed(ZERO3, engine_clips=False).deepspeed_loop.loop


def test_the_same_config_file_trains_as_deepspeed_itself(same_config_launch: tuple | None) -> None:
    """The switch from DeepSpeed to ``ZeroStrategy(config=file)`` keeps the training: DeepSpeed's own engine and
    our Lightning strategy, given one ds_config.json (accumulation 2, clipping 0.5), on the same data. In fp32
    the final weights are equal to rounding at stages 1-3, and the losses equal at stage 1 and within 1e-5 at
    stages 2 and 3, which compute other sums or the same in another order: DeepSpeed's ZeRO-2 reduces each
    micro-batch's gradients and adds the reduced ones, where we add a rank's micro-batches and reduce once
    (with one micro-batch a step its losses and weights are bit-equal to ours); its ZeRO-3 rounds apart from
    ours even then (not traced further). How far apart depends on the CPU's kernels: the losses were equal with
    torch's portable kernels (ATEN_CPU_CAPABILITY=default) and 1e-7 apart with its AVX2 ones. In bf16 (DeepSpeed
    runs the whole module in bf16, we compute in bf16 under autocast) the first loss is equal and the rest within
    1% (0.5% measured)."""
    pytest.importorskip("deepspeed")
    assert same_config_launch is not None
    tmp_path, launch = same_config_launch
    result = launch.result()
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]
    for case in ("1", "2", "3", "3bf16", "2tbs"):
        report = json.loads((tmp_path / f"{case}.json").read_text())
        deepspeed_losses, our_losses = torch.tensor(report["deepspeed"]), torch.tensor(report["ours"])
        assert len(our_losses) == len(deepspeed_losses) == 8  # 4 steps of 2 micro-batches
        if not case.endswith("bf16"):  # in bf16 Adam turns rounding differences into steps of lr: losses only
            for name, (theirs, ours) in report["weights"].items():
                theirs, ours = torch.tensor(theirs), torch.tensor(ours)
                assert (theirs - ours).abs().max() <= 1e-6 * theirs.abs().max(), (case, name)
        if case.endswith("bf16"):
            assert our_losses[0] == deepspeed_losses[0]
            torch.testing.assert_close(our_losses, deepspeed_losses, rtol=1e-2, atol=0)
        elif case == "1":  # the same sums in the same order
            assert torch.equal(our_losses, deepspeed_losses), case
        else:  # the same sums in another order (the docstring)
            torch.testing.assert_close(our_losses, deepspeed_losses, rtol=1e-5, atol=0, msg=case)
    # train_batch_size in place of gradient_accumulation_steps: DeepSpeed derives the accumulation (2 micro-batches
    # of 2 on 2 ranks make 8), and so does ZeroStrategy(config=), bit for bit the run that names it.
    derived, named = (json.loads((tmp_path / f"{case}.json").read_text()) for case in ("2tbs", "2"))
    assert derived["ours"] == named["ours"] and derived["deepspeed"] == named["deepspeed"]
    assert all(derived["weights"][name][1] == named["weights"][name][1] for name in named["weights"])


def test_a_step_with_an_inf_gradient_is_skipped_as_deepspeed_skips_it(same_config_launch: tuple | None) -> None:
    """DeepSpeed's engine and ``ZeroStrategy(config=file)`` on one config whose step 1 gets an inf gradient on one
    rank: both skip that step on both ranks and train on from the same weights. bf16 at stage 1 with
    check_grad_overflow true (refused here before), at stage 2 with the key left out (DeepSpeed's default, true,
    which was off here), at stage 3 with it false (DeepSpeed's stage 3 skips all the same); fp32 at stage 2
    (DeepSpeed skips there too). The losses are recorded before the inf; a step not skipped would turn every
    later loss and weight NaN. fp32: the weights equal to rounding; bf16: the losses as close as without the
    inf (the test above)."""
    pytest.importorskip("deepspeed")
    assert same_config_launch is not None
    tmp_path, launch = same_config_launch
    result = launch.result()
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]
    for case in INF_CASES:
        report = json.loads((tmp_path / f"{case}.json").read_text())
        assert report["applied"]["deepspeed"] == report["applied"]["ours"] == [True, False, True, True], case
        deepspeed_losses, our_losses = torch.tensor(report["deepspeed"]), torch.tensor(report["ours"])
        assert len(our_losses) == 8 and torch.isfinite(our_losses).all() and torch.isfinite(deepspeed_losses).all()
        for name, (theirs, ours) in report["weights"].items():
            theirs, ours = torch.tensor(theirs), torch.tensor(ours)
            assert torch.isfinite(ours).all() and torch.isfinite(theirs).all(), (case, name)
            if "bf16" not in case:
                assert (theirs - ours).abs().max() <= 1e-6 * theirs.abs().max(), (case, name)
        assert our_losses[0] == deepspeed_losses[0], case
        tolerance = 1e-2 if "bf16" in case else 1e-5
        torch.testing.assert_close(our_losses, deepspeed_losses, rtol=tolerance, atol=0, msg=case)


def test_a_configs_clipping_and_a_step_in_backward_are_refused_together_before_any_work() -> None:
    from accelerate_zero import ZeroPlugin
    from accelerate_zero.accelerator import check_step_in_backward_clipping

    early = ZeroPlugin(stage=2, offload_optimizer="cpu", offload_step_in_backward=True)
    with pytest.raises(ValueError, match=r'clips the gradient norm at 1.0 in each step .* set "gradient_clipping": 0'):
        check_step_in_backward_clipping(
            early, ZeroPlugin.from_deepspeed(ZERO3).deepspeed_loop.loop["gradient_clipping"]
        )
    check_step_in_backward_clipping(early, None)  # no config: the loop clips, and is refused there if it does
    check_step_in_backward_clipping(ZeroPlugin(stage=2, offload_optimizer="cpu"), 1.0)
