"""A DeepSpeed config's ``train_batch_size`` is never dropped: the accumulation derived from it as DeepSpeed derives
it where the framework lets the strategy set it (Lightning's Trainer, Accelerate), and numbers that disagree (with
each other, or with the DataLoader's batch size) refused, naming them and the fix, before any step. DeepSpeed's
own run with the same file is the reference (``test_deepspeed_config.py``'s launch, case ``2tbs``)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import TESTS
from tests.rank_pool import free_port, run_distributed
from zero_core.deepspeed import from_deepspeed

SCRIPTS = TESTS / "scripts"


def _deepspeeds_rule(train: int, micro: int | None, accumulation: int | None, ranks: int) -> tuple[int, int] | None:
    """What DeepSpeed 0.19's own DeepSpeedConfig makes of the three numbers over ``ranks`` data-parallel ranks:
    (micro-batch, accumulation), or None where it refuses the config."""
    from deepspeed.runtime import config as deepspeed_config

    class DataParallel:  # DeepSpeed reads the data-parallel world size from the mpu it is given
        def get_data_parallel_world_size(self) -> int:
            return ranks

        def get_model_parallel_world_size(self) -> int:
            return 1

    values = {"train_batch_size": train, "zero_optimization": {"stage": 2}}
    values.update({"train_micro_batch_size_per_gpu": micro} if micro is not None else {})
    values.update({"gradient_accumulation_steps": accumulation} if accumulation is not None else {})
    rank = deepspeed_config.dist.get_rank
    deepspeed_config.dist.get_rank = lambda: 0  # no process group here; the mpu says the ranks
    try:
        made = deepspeed_config.DeepSpeedConfig(values, mpu=DataParallel())
    except AssertionError:
        return None
    finally:
        deepspeed_config.dist.get_rank = rank
    return made.train_micro_batch_size_per_gpu, made.gradient_accumulation_steps


def test_the_accumulation_is_derived_and_refused_as_deepspeed_derives_and_refuses_it() -> None:
    pytest.importorskip("deepspeed")
    for train, micro, accumulation, ranks in itertools.product(
        (1, 6, 8, 12, 30, 32), (None, 1, 2, 4), (None, 1, 2, 3), (1, 2, 3, 4)
    ):
        config = {"train_batch_size": train, "zero_optimization": {"stage": 2}}
        config.update({"train_micro_batch_size_per_gpu": micro} if micro is not None else {})
        config.update({"gradient_accumulation_steps": accumulation} if accumulation is not None else {})
        theirs = _deepspeeds_rule(train, micro, accumulation, ranks)
        case = (train, micro, accumulation, ranks)
        if theirs is None:
            with pytest.raises(ValueError, match=f"train_batch_size={train} .*{ranks} data-parallel ranks"):
                from_deepspeed(config).global_batch(ranks)
        else:
            batch = from_deepspeed(config).global_batch(ranks)
            assert batch is not None and (batch.micro_batch, batch.accumulation) == theirs, case


def test_a_refusal_names_the_file_the_three_numbers_and_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "ds_config.json"
    numbers = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
    path.write_text(json.dumps({**numbers, "zero_optimization": {"stage": 2}}))
    with pytest.raises(ValueError) as refused:
        from_deepspeed(path).global_batch(2)
    message = str(refused.value)
    assert message.startswith(f"{path}: train_batch_size=32 is not train_micro_batch_size_per_gpu=4 x ")
    assert "gradient_accumulation_steps=2 x 2 data-parallel ranks = 16" in message
    assert "set train_batch_size=16, or change the micro-batch or the accumulation" in message
    assert from_deepspeed({"zero_optimization": {"stage": 2}}).global_batch(2) is None  # nothing to hold it to


def test_a_loader_whose_batch_size_is_not_the_micro_batch_is_refused_alike_on_every_rank() -> None:
    from lightning_zero.deepspeed_config import check_train_dataloader

    class Trainer:
        def __init__(self, batch_size: int) -> None:
            from torch.utils.data import DataLoader

            self.train_dataloader = DataLoader(list(range(8)), batch_size=batch_size)

    batch = from_deepspeed({"train_batch_size": 8, "zero_optimization": {"stage": 2}}).global_batch(2)
    assert batch is not None and (batch.micro_batch, batch.accumulation) == (4, 1)  # DeepSpeed: 8 / 2 ranks
    check_train_dataloader(batch, Trainer(4), lambda value: [value, value])
    with pytest.raises(ValueError, match=r"yields batches of 2 per rank, a global batch of 4: give the loader"):
        check_train_dataloader(batch, Trainer(2), lambda value: [value, value])
    # One rank's loader differs: the gathered values are the same on both ranks, and so is the error.
    with pytest.raises(ValueError, match=r"the ranks' train DataLoaders yield batches of \[4, 2\]"):
        check_train_dataloader(batch, Trainer(4), lambda value: [4, 2])


def _lightning_cases(rank: int, world_size: int) -> dict[str, object]:
    import lightning.pytorch as pl

    from lightning_zero import ZeroStrategy
    from tests.lightning_module import TinyLM

    def fit(config: dict, **trainer_args: object) -> pl.Trainer:
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, strategy=ZeroStrategy(config=config), max_steps=2, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **trainer_args,
        )  # fmt: skip
        trainer.fit(TinyLM(batchnorm=False, dataset_size=32))  # a DataLoader of batch size 4
        return trainer

    def refusal(config: dict, **trainer_args: object) -> str:
        try:
            fit(config, **trainer_args)
        except ValueError as error:
            return str(error)
        return ""

    stage = {"zero_optimization": {"stage": 2}}
    return {
        "derived": fit({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, **stage}).accumulate_grad_batches,
        "trainers_own": fit({"train_batch_size": 12, **stage}, accumulate_grad_batches=3).accumulate_grad_batches,
        "disagreeing": refusal({"train_batch_size": 12, **stage}, accumulate_grad_batches=5),
        "derived_micro": refusal({"train_batch_size": 12, **stage}, accumulate_grad_batches=2),
        "other_loader": refusal({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, **stage}),
    }


@pytest.mark.distributed  # Lightning's Trainer in a process of its own
def test_under_lightnings_trainer_the_accumulation_is_derived_or_the_numbers_refused() -> None:
    (result,) = run_distributed(_lightning_cases, 1)
    assert result["derived"] == 2  # 8 = 4 x 2 x 1 rank
    assert result["trainers_own"] == 3  # Trainer(accumulate_grad_batches=3) stands: 12 = 4 x 3 x 1
    assert "train_batch_size=12 is not a whole multiple of 5 micro-batch(es) accumulated x 1" in result["disagreeing"]
    # 12 = 6 x 2 x 1: DeepSpeed's micro-batch is 6, and the DataLoader's 4 is refused when fitting starts.
    assert (
        "= micro-batch 6 x 2 accumulated x 1 data-parallel ranks, but the train DataLoader yields batches of 4"
        in (result["derived_micro"])
    )
    assert "the train DataLoader yields batches of 4 per rank, a global batch of 16" in result["other_loader"]


def test_fabric_refuses_a_global_batch_it_cannot_hold_the_loop_to() -> None:
    from lightning_zero.fabric import ZeroFabricStrategy

    with pytest.raises(ValueError, match=r"train_batch_size=32: the global batch is the DataLoader's batch_size x"):
        ZeroFabricStrategy(config={"train_batch_size": 32, "zero_optimization": {"stage": 2}})


def test_under_accelerate_the_accumulation_is_derived_and_trains_as_the_native_settings(tmp_path: Path) -> None:
    """One launch (the launcher is under test: its config reaches each process), cases on both ranks.
    Why a process of its own: the launcher carries the config to each process."""
    config = tmp_path / "ds.json"
    numbers = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}
    config.write_text(json.dumps({**numbers, "zero_optimization": {"stage": 2}}))
    command = [sys.executable, "-m", "accelerate_zero.launch", "launch", "--zero_config_file", str(config)]
    command += ["--multi_gpu", "--num_processes", "2", "--main_process_port", str(free_port())]
    command += [str(SCRIPTS / "accelerate_global_batch.py"), str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_ZERO", "ACCELERATE_USE_ZERO"))}
    result = subprocess.run(
        command, env={**env, "ACCELERATE_USE_CPU": "1"}, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for report in reports:
        native = report["native"]
        assert (native["accumulation"], native["steps"], len(native["losses"])) == (2, 3, 6)
        for case in ("launcher", "auto"):  # 8 = 2 x 2 x 2 ranks: 2 accumulated, as with the native setting
            assert report[case]["accumulation"] == 2, case
            assert report[case]["losses"] == native["losses"] and report[case]["weights"] == native["weights"], case
        assert "the DataLoader yields batches of 4 per rank, a global batch of 16" in report["other_loader"]
        assert (
            "train_batch_size=8 is not train_micro_batch_size_per_gpu=2 x gradient_accumulation_steps=4 x 2"
            in report["disagreeing"]
        )
    assert reports[0]["other_loader"] == reports[1]["other_loader"]
