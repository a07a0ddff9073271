"""``ZeroStrategy(config=...)`` and ``ZeroFabricStrategy(config=...)``: the DeepSpeed config a user of
``strategy="deepspeed_stage_3"`` passes, read as our settings (``zero_core.deepspeed``: what has no
equivalent is refused when the strategy is built, before any process starts).

What DeepSpeed's engine did with the loop keys, the framework does here: under the Trainer,
``gradient_clipping`` and ``gradient_accumulation_steps`` become the Trainer's own (a different value given
to the Trainer is refused); under Fabric the loop is the user's, so they are refused with what to call.
The config's precision must agree with the framework's precision flag, which decides it.

Its ``optimizer`` and ``scheduler`` sections are built under the Trainer as Lightning's DeepSpeed strategy lets
DeepSpeed build them: where ``configure_optimizers`` returns no optimizer, the config's over the module's
trainable parameters, its schedule stepped after every optimizer step (``configured_optimizers``). Lightning
has no value for their "auto"s, so those are refused when the strategy is built; under Fabric the loop builds
its own optimizer, so the sections are refused there with the builders that make the same one.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers, _MockOptimizer
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from zero_core.deepspeed import (
    DeepSpeedSettings,
    GlobalBatch,
    auto_keys,
    build_optimizer,
    build_scheduler,
    from_deepspeed,
    muon_clipping_problem,
)

Config = Mapping[str, Any] | str | os.PathLike | None
# A DeepSpeed config's precision -> the framework's flags that mean it (the first one suggested).
_FLAGS = {"fp32": ("32-true",), "bf16": ("bf16-mixed", "bf16-true"), "fp16": ("16-mixed",)}


def settings_with_config(config: Config, explicit: dict[str, Any]) -> tuple[dict[str, Any], DeepSpeedSettings | None]:
    """The settings: the config's, then the keyword arguments (which must not contradict it)."""
    if config is None:
        return explicit, None
    translated = from_deepspeed(config, stage_given="stage" in explicit)
    clashes = [
        f"{name}={explicit[name]!r} against the config's {value!r}"
        for name, value in translated.settings.items()
        if name in explicit and explicit[name] != value
    ]
    if clashes:
        raise ValueError(
            f"{translated.source} and the keyword arguments disagree: {'; '.join(clashes)}. Give each once."
        )
    refuse_autos(translated)
    if translated.without_effect:
        rank_zero_info(translated.without_effect_line())  # never silent: what the config sets that changes nothing
    return {**translated.settings, **explicit}, translated


def check_precision(translated: DeepSpeedSettings | None, flag: str, owner: str) -> None:
    if translated is None or translated.precision is None or flag in _FLAGS[translated.precision]:
        return
    on_cpu = ""
    if translated.precision == "fp16" and flag.startswith("bf16"):
        # Lightning itself turns 16-mixed into bf16-mixed on a CPU (with a warning): the flag given may be 16-mixed.
        on_cpu = (
            '; on a CPU Lightning runs 16-mixed as bf16-mixed, so there set "fp16": {"enabled": false} (or "auto") '
            "in the config to train in the Trainer's precision"
        )
    raise ValueError(
        f"{translated.source} asks for {translated.precision}, {owner}(precision={flag!r}) for another: "
        f"pass {owner}(precision={_FLAGS[translated.precision][0]!r}) (the framework's flag decides here){on_cpu}."
    )


def apply_to_trainer(translated: DeepSpeedSettings | None, trainer: Any, ranks: int) -> GlobalBatch | None:
    """The config's clipping and accumulation as the Trainer's own, unless the Trainer was given others. With
    ``train_batch_size`` and no ``gradient_accumulation_steps``, the accumulation is derived as DeepSpeed derives
    it over ``ranks`` data-parallel ranks; the batch returned is checked against the DataLoader's batch size when
    training starts (``check_train_dataloader``)."""
    loop = translated.loop if translated is not None else {}
    source = translated.source if translated is not None else ""
    clip = loop.get("gradient_clipping")
    if clip is not None and clip != 0 and str(trainer.gradient_clip_algorithm) == "value":
        raise ValueError(
            f"{source} clips the gradient norm at {clip}, Trainer(gradient_clip_algorithm='value') "
            "clips values: leave the algorithm at 'norm' or drop gradient_clipping from the config."
        )
    if clip is not None and clip != 0:
        if trainer.gradient_clip_val not in (None, 0, clip):
            raise ValueError(
                f"{source} clips at {clip}, Trainer(gradient_clip_val={trainer.gradient_clip_val}): give it once."
            )
        trainer.gradient_clip_val = float(clip)  # by norm, as DeepSpeed clips
    # Lightning's DeepSpeed strategy hands gradient_clip_val to DeepSpeed, which clips a Muon update with it.
    if translated is not None and (problem := muon_clipping_problem(translated.optimizer, trainer.gradient_clip_val)):
        raise ValueError(f"{source} with Trainer(gradient_clip_val={trainer.gradient_clip_val}): {problem}.")
    steps = loop.get("gradient_accumulation_steps")
    if steps is not None:
        if trainer.accumulate_grad_batches not in (1, steps):
            raise ValueError(
                f"{source} accumulates {steps} micro-batches, Trainer(accumulate_grad_batches="
                f"{trainer.accumulate_grad_batches}): give it once."
            )
        trainer.accumulate_grad_batches = int(steps)
    if translated is None:
        return None
    # train_batch_size: the Trainer's accumulation, where one other than its default 1 was given, stands (and must
    # agree); else the config's, else the one DeepSpeed derives. The micro-batch is the DataLoader's batch size.
    given = trainer.accumulate_grad_batches if trainer.accumulate_grad_batches != 1 else None
    batch = translated.global_batch(ranks, given, f"Trainer(accumulate_grad_batches={given})")
    if batch is not None:
        trainer.accumulate_grad_batches = batch.accumulation
    return batch


def check_train_dataloader(batch: GlobalBatch, trainer: Any, gathered: Callable[[int], list[int]]) -> None:
    """When fitting starts: the DataLoader's batch size must be the config's micro-batch, or the global batch
    would not be ``train_batch_size``. ``gathered``: every rank's value (the strategy's all-gather), so each rank
    raises the same error, or none does."""
    observed = _batch_size(trainer.train_dataloader)
    values = gathered(-1 if observed is None else observed)
    if len(set(values)) > 1:
        raise ValueError(
            f"{batch.source}: train_batch_size={batch.train_batch} needs one micro-batch on every rank, and the "
            f"ranks' train DataLoaders yield batches of {values} (by rank; -1: no batch_size): give them one "
            "batch_size."
        )
    batch.check_micro_batch(None if values[0] == -1 else values[0], "the train DataLoader")


def _batch_size(loaders: Any) -> int | None:
    """The batch size of the one train DataLoader (as Lightning's DeepSpeed strategy reads it for the config's
    micro-batch); None where it states none, or where there are several loaders."""
    if isinstance(loaders, DataLoader):
        size = (
            loaders.batch_size if loaders.batch_size is not None else getattr(loaders.batch_sampler, "batch_size", None)
        )
        return size if isinstance(size, int) else None
    return None


def refuse_loop_keys_under_fabric(translated: DeepSpeedSettings | None) -> None:
    where = {
        "gradient_clipping": "call fabric.clip_gradients(model, optimizer, max_norm=...) in the loop",
        "gradient_accumulation_steps": "accumulate in the loop (with fabric.no_backward_sync)",
        # Fabric cannot see the loop's accumulation, so the global batch cannot be held to the config's.
        "train_batch_size": "the global batch is the DataLoader's batch_size x the micro-batches the loop "
        "accumulates x the ranks",
    }
    loop = {k: v for k, v in (translated.loop if translated else {}).items() if k in where}
    sections = [f"{key}: {where}" for key, where in _FABRIC_SECTIONS.items() if getattr(translated, key, None)]
    if loop or sections:
        raise ValueError(
            f"{translated.source}: under Fabric the training loop is yours: "
            + "; ".join([*(f"{k}={v!r}: {where[k]}" for k, v in loop.items()), *sections])
            + " (then drop the key or section from the config)."
        )


_FABRIC_SECTIONS = {
    "optimizer": "build it in the script and pass it to fabric.setup(model, optimizer); "
    "zero_core.deepspeed.build_optimizer(config['optimizer'], model.parameters(), model=model) builds the one "
    "DeepSpeed builds",
    "scheduler": "zero_core.deepspeed.build_scheduler(config['scheduler'], optimizer) builds DeepSpeed's schedule; "
    "call its step() after each optimizer.step(), as DeepSpeed's engine does",
}


def refuse_autos(translated: DeepSpeedSettings) -> None:
    """Hugging Face's Trainer and Accelerate fill the sections' "auto"s from their arguments; Lightning has none."""
    autos = auto_keys(translated.optimizer, "optimizer") + auto_keys(translated.scheduler, "scheduler")
    if autos:
        raise ValueError(
            f'{translated.source} sets {", ".join(autos)} to "auto", which Hugging Face\'s Trainer and Accelerate '
            "fill from their arguments; Lightning has no value for them: write the numbers in the config."
        )


def configured_optimizers(
    translated: DeepSpeedSettings | None, module: pl.LightningModule
) -> tuple[list[Optimizer], list[LRSchedulerConfig]]:
    """What ``configure_optimizers`` returns, parsed as ``Strategy.setup_optimizers`` parses it; with a DeepSpeed
    config's "optimizer" section, that optimizer in place of the none it returned (over the module's trainable
    parameters, as Lightning's DeepSpeed strategy hands DeepSpeed), and with its "scheduler" section, that
    schedule over the optimizer, stepped after every optimizer step (interval "step"), as DeepSpeed steps it."""
    if translated is None or (translated.optimizer is None and translated.scheduler is None):
        return _init_optimizers_and_lr_schedulers(module)
    with warnings.catch_warnings():  # Lightning's "this fit will run with no optimizer": the config's is built
        warnings.filterwarnings("ignore", message=re.escape("`LightningModule.configure_optimizers` returned `None`"))
        optimizers, schedulers = _init_optimizers_and_lr_schedulers(module)
    returned = [optimizer for optimizer in optimizers if not isinstance(optimizer, _MockOptimizer)]
    if translated.optimizer is not None:
        if returned:
            raise ValueError(
                f'{translated.source} has an "optimizer" section and configure_optimizers returned an optimizer too: '
                "return None from configure_optimizers to train with the config's (built here as DeepSpeed builds "
                "it), or drop the section to train with yours."
            )
        trainable = [p for p in module.parameters() if p.requires_grad]
        returned = [build_optimizer(translated.optimizer, trainable, model=module)]
    elif not returned:
        raise ValueError(
            f'{translated.source} has a "scheduler" section but no "optimizer" section, and configure_optimizers '
            "returned no optimizer: return the optimizer from configure_optimizers (the schedule is built over it), "
            'or add an "optimizer" section.'
        )
    if translated.scheduler is not None:
        if schedulers:
            raise ValueError(
                f'{translated.source} has a "scheduler" section and configure_optimizers returned a scheduler too: '
                "return the optimizer alone to train with the config's schedule, or drop the section to train with "
                "yours."
            )
        schedulers = [LRSchedulerConfig(build_scheduler(translated.scheduler, returned[0]), interval="step")]
    return returned, schedulers
