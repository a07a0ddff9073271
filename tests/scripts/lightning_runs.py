"""Runs Lightning trainings described in a JSON file, in one set of processes.

    python tests/scripts/lightning_runs.py RUNS.json OUT_DIR DEVICES

Launched as a plain script: Lightning's own launcher starts the other
processes (for ``num_nodes`` > 1, once per node with ``NODE_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT`` set). Rank 0 writes OUT_DIR/<name>.pt per run: logged losses, final
full weights, and whatever the run checked.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import BackboneFinetuning, ModelCheckpoint  # noqa: E402

import lightning_zero  # noqa: E402, F401  (registers the strategies)
from lightning_zero import ZeroPrecision, ZeroStrategy  # noqa: E402
from tests.lightning_module import (  # noqa: E402
    BackboneTinyLM,
    ManualTinyLM,
    SkipOnNanTinyLM,
    TinyLM,
    TwoStepsTinyLM,
    WholeTensorTinyLM,
)
from tests.models import SEQ, Block  # noqa: E402


def make_strategy(name: str, shard_group_size: int | None = None, settings: dict | None = None):  # type: ignore[no-untyped-def]
    if name.startswith("zero") and name != "zero_auto":  # zero_auto: by its registered name
        return ZeroStrategy(
            stage=int(name[-1]), wrap_policy=Block, shard_group_size=shard_group_size, **(settings or {})
        )
    return name


def full_weights(trainer: pl.Trainer, module: TinyLM) -> dict[str, torch.Tensor]:
    strategy = trainer.strategy
    if isinstance(strategy, ZeroStrategy):
        return strategy.engine.full_state_dict()
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def _refused_callback(name: str) -> pl.Callback:
    from lightning.pytorch.callbacks import EMAWeightAveraging, ModelPruning, StochasticWeightAveraging

    return {
        "swa": lambda: StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1),
        "ema": lambda: EMAWeightAveraging(),
        "pruning": lambda: ModelPruning("l1_unstructured", amount=0.5),
    }[name]()


def run(spec: dict, out: Path, devices: int) -> None:
    module_class = (
        ManualTinyLM
        if spec.get("manual")
        else SkipOnNanTinyLM
        if spec.get("skip_on_nan")
        else TwoStepsTinyLM
        if spec.get("two_steps")
        else BackboneTinyLM
        if spec.get("unfreeze_backbone_at")
        else WholeTensorTinyLM
        if spec.get("whole_tensor")
        else TinyLM
    )
    named = {"optimizer_name": spec["whole_tensor"]} if spec.get("whole_tensor") else {}
    module = module_class(
        **named,
        batchnorm=spec.get("batchnorm", True),
        batch_size=spec.get("batch_size", 4),
        dataset_size=spec.get("dataset_size", 96),
    )
    if spec.get("example_input"):  # what memory_budget measures: one batch as forward takes it
        module.example_input_array = torch.zeros(spec.get("batch_size", 4), SEQ, dtype=torch.long)
    callbacks = []
    if spec.get("callback"):  # a callback ZeroStrategy refuses at setup
        callbacks.append(_refused_callback(spec["callback"]))
    if spec.get("unfreeze_backbone_at"):
        callbacks.append(BackboneFinetuning(unfreeze_backbone_at_epoch=spec["unfreeze_backbone_at"]))
    if spec.get("checkpoint_epochs"):
        callbacks.append(ModelCheckpoint(dirpath=out / spec["name"], every_n_epochs=1, save_top_k=-1, save_last=True))
    if spec.get("top_k"):
        callbacks.append(
            ModelCheckpoint(
                dirpath=out / f"{spec['name']}-topk",
                monitor="train_loss",
                every_n_train_steps=1,
                save_top_k=spec["top_k"],
            )
        )
    plugins = [ZeroPrecision(spec["plugin_precision"])] if spec.get("plugin_precision") else []
    if spec.get("async_io"):  # Lightning's own plugin for saving in the background
        from lightning.pytorch.plugins.io import AsyncCheckpointIO

        plugins.append(AsyncCheckpointIO())
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=spec.get("num_nodes", 1),
        strategy=make_strategy(spec["strategy"], spec.get("shard_group_size"), spec.get("settings")),
        precision=spec.get("precision"),
        plugins=plugins,
        max_steps=spec["max_steps"],
        accumulate_grad_batches=spec.get("accumulate", 1),
        gradient_clip_val=spec.get("clip"),
        gradient_clip_algorithm=spec.get("clip_algorithm", "norm"),
        limit_val_batches=spec.get("limit_val_batches", 0),
        val_check_interval=spec.get("val_check_interval"),
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        default_root_dir=out,
        enable_progress_bar=False,
        enable_model_summary=spec.get("summary", False),
        num_sanity_val_steps=0,
        sync_batchnorm=spec.get("sync_batchnorm", False),
    )
    ckpt_path = spec.get("ckpt_path")
    if spec.get("expect_error"):
        try:
            trainer.fit(module)
            error = None
        except Exception as raised:  # noqa: BLE001 - reported to the test
            error = f"{type(raised).__name__}: {raised}"
        if trainer.global_rank == 0:
            torch.save({"error": error}, out / f"{spec['name']}.pt")
        return
    trainer.fit(module, ckpt_path=str(out / ckpt_path) if ckpt_path else None)
    result = {"losses": module.losses, "weights": full_weights(trainer, module), "global_step": trainer.global_step}
    result["lrs"] = [group["lr"] for group in trainer.optimizers[0].param_groups]
    result["world_size"] = trainer.world_size
    result["norms"] = getattr(module, "norms", None)
    if isinstance(trainer.strategy, ZeroStrategy):
        result["shard_group_size"] = trainer.strategy.engine.shard_group_size
        fitted = trainer.strategy.engine.fit
        result["fit"] = None if fitted is None else {"summary": fitted.summary(), "config": fitted.config}
    # A resumed BaseFinetuning callback ends its restart in on_fit_start; one left restarting would
    # redo it in the next fit.
    result["restarting"] = [c._restarting for c in callbacks if isinstance(c, BackboneFinetuning)]
    if spec.get("summary"):
        from lightning.pytorch.utilities.model_summary import ModelSummary

        summary = ModelSummary(module)
        result["summary_total"] = summary.total_parameters
        result["summary_trainable"] = summary.trainable_parameters
    if spec.get("evaluate"):
        result["test"] = trainer.test(module, verbose=False)
        result["predictions"] = torch.cat(trainer.predict(module))
        result["validate"] = trainer.validate(module, verbose=False)
    if spec.get("save_to"):
        trainer.save_checkpoint(out / spec["save_to"])
    if trainer.global_rank == 0:
        torch.save(result, out / f"{spec['name']}.pt")


def main() -> None:
    runs = json.loads(Path(sys.argv[1]).read_text())
    out, devices = Path(sys.argv[2]), int(sys.argv[3])
    for spec in runs:
        run(spec, out, devices)


if __name__ == "__main__":
    torch.set_num_threads(1)
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
