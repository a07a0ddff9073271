"""``ZeroTrainer``: Hugging Face's ``transformers.Trainer`` with ZeRO in place of DDP.

Only Trainer's own extension points are overridden: the accelerator it builds
(``create_accelerator_and_postprocess``: a ``ZeroAccelerator`` with the same
arguments, so ``prepare`` shards the model and rebuilds its optimizer), the
model save (``_save``: the full weights gathered on every process, written by
the saving one) and the optimizer's part of a checkpoint
(``_save_optimizer_and_scheduler`` / ``_load_optimizer_and_scheduler``: a
sharded directory beside Trainer's own files, loadable at another number of
processes or stage). Training, evaluation and prediction are Trainer's own.

Imported lazily by ``accelerate_zero`` (``from accelerate_zero import ZeroTrainer``), so importing the package
does not import transformers.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainingArguments
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

import zero_core.deepspeed as deepspeed_reader  # its optimizer and scheduler builders
from zero_core import ZeroEngine

from .accelerator import ZeroAccelerator
from .plugin import ZeroPlugin
from .trainer_deepspeed import (
    auto_values,
    check_scheduler_step_counts,
    refuse_partitioned_model,
    resolve_for_trainer,
    scheduler_step_counts,
)
from .training_arguments import ZeroTrainingArguments

TRAINER_LOOP_KEYS = ("gradient_clipping", "gradient_accumulation_steps")
OPTIMIZER_DIR = "optimizer_zero"  # beside Trainer's model, scheduler, RNG and trainer_state.json files


class ZeroTrainer(Trainer):
    """``ZeroTrainer(model=..., args=TrainingArguments(...), ...)``: every argument is ``Trainer``'s, plus
    ``zero_plugin`` (default: the settings ``accelerate-zero launch`` exports, as for ``ZeroAccelerator``).

    ``save_model()`` and ``model.save_pretrained()`` gather the full weights, so under stage 3 every
    process calls them (as under DeepSpeed ZeRO-3); checkpoints hold the optimizer as a sharded
    directory (``optimizer_zero/``) instead of ``optimizer.pt``, and ``resume_from_checkpoint`` reads it
    at any number of processes and stage.

    ``TrainingArguments(deepspeed="ds_config.json")`` (a path or a dict) runs on the ZeRO engine: its "auto"s
    filled in and its numbers checked against the arguments as transformers does, its optimizer and scheduler
    sections built. Build the arguments with ``ZeroTrainingArguments`` (the same arguments; needed where
    DeepSpeed is not installed, and for a stage-3 config loaded by ``from_pretrained`` after them); plain
    ``TrainingArguments(deepspeed=...)`` is rebuilt as one.
    """

    def __init__(self, *args: Any, zero_plugin: ZeroPlugin | None = None, **kwargs: Any) -> None:
        # Trainer's arguments by name, so that the TrainingArguments and the model can be read (and the
        # arguments replaced) whichever way they were passed.
        given = {**dict(zip(list(inspect.signature(Trainer.__init__).parameters)[1:], args)), **kwargs}
        given["args"] = _arguments_for_zero(given.get("args"), given.get("model"))
        config = getattr(given["args"], "zero_deepspeed_config", None)
        self._deepspeed = None  # the DeepSpeed config's reading, when TrainingArguments(deepspeed=...) gave one
        if config is not None:
            zero_plugin = self._plugin_from_deepspeed(config, given, zero_plugin)
        self.zero_plugin = zero_plugin  # read by create_accelerator_and_postprocess, inside Trainer.__init__
        self._accelerator_arguments: dict[str, Any] | None = None
        super().__init__(**given)

    def _plugin_from_deepspeed(self, config: Any, given: dict[str, Any], zero_plugin: ZeroPlugin | None) -> ZeroPlugin:
        """``TrainingArguments(deepspeed=...)``: the config, its "auto"s filled in as transformers fills them, as
        the ZeRO settings; its optimizer and scheduler sections kept for ``create_optimizer``/``create_scheduler``."""
        if zero_plugin is not None:
            raise ValueError(
                "ZeroTrainer was given both zero_plugin= and TrainingArguments(deepspeed=...): give the ZeRO "
                "settings once."
            )
        resolved = resolve_for_trainer(config, given["args"], given.get("model"))
        # The loop keys are the Trainer's, which they now equal (checked above, as transformers checks them):
        # Trainer clips at max_grad_norm and accumulates gradient_accumulation_steps itself (its Accelerator
        # accumulates none), so the plugin is not told them.
        plugin = ZeroPlugin.from_deepspeed(
            {k: v for k, v in resolved.items() if k not in TRAINER_LOOP_KEYS}, engine_clips=False
        )
        self._deepspeed = plugin.deepspeed_loop
        optimizer, scheduler = given.get("optimizers") or (None, None)
        for section, passed in (("optimizer", optimizer), ("scheduler", scheduler)):
            if passed is not None and getattr(self._deepspeed, section) is not None:
                raise ValueError(
                    f"ZeroTrainer was given optimizers=(...) with a {section}, and the DeepSpeed config has a "
                    f'"{section}" section: drop one of them (transformers refuses both under DeepSpeed too).'
                )
        return plugin

    # ----------------------------------------------------------- accelerator
    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        arguments = super()._build_accelerator_args(**kwargs)
        if arguments.get("deepspeed_plugin") is not None or arguments.get("fsdp_plugin") is not None:
            raise ValueError(
                "ZeroTrainer shards the model itself: leave out TrainingArguments' fsdp= and launch without DeepSpeed "
                "(the ZeRO settings come from accelerate-zero launch, zero_plugin= or TrainingArguments(deepspeed=))."
            )
        # The DDP kwargs handler Trainer adds configures a wrapper ZeroAccelerator never builds: harmless.
        self._accelerator_arguments = dict(arguments)
        return arguments

    def create_accelerator_and_postprocess(self) -> None:
        """Trainer's own setup (its arguments for the accelerator, its checks), then the accelerator it built
        replaced by a ``ZeroAccelerator`` built from the same arguments plus the ZeRO settings."""
        super().create_accelerator_and_postprocess()
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError(
                "ZeroTrainer was launched with DeepSpeed or FSDP enabled; launch it with "
                "accelerate-zero launch (or plain accelerate launch without --use_deepspeed/--use_fsdp)."
            )
        if self._accelerator_arguments is None:  # set by _build_accelerator_args, on transformers 5
            import transformers

            raise RuntimeError(
                f"transformers {transformers.__version__} built its Accelerator without _build_accelerator_args, "
                "which ZeroTrainer builds on (tested with transformers 5.24): upgrade transformers."
            )
        self.accelerator = ZeroAccelerator(zero_plugin=self.zero_plugin, **self._accelerator_arguments)
        self.accelerator.config_clipping = None  # Trainer clips at max_grad_norm itself (checked against a config)
        self.gather_function = self.accelerator.gather_for_metrics
        if "use_gather_object" in inspect.signature(self.gather_function).parameters:
            self.gather_function = functools.partial(
                self.gather_function, use_gather_object=self.args.eval_use_gather_object
            )

    # ------------------------------------------------ optimizer and scheduler
    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """The DeepSpeed config's optimizer section, when it has one, over every trainable parameter (one group,
        as transformers hands them to DeepSpeed); otherwise Trainer's own."""
        section = self._deepspeed.optimizer if self._deepspeed is not None else None
        if section is None or self.optimizer is not None:
            return super().create_optimizer(model)
        parameters = [p for p in (self.model if model is None else model).parameters() if p.requires_grad]
        self.optimizer = deepspeed_reader.build_optimizer(section, parameters, auto_values(self.args))
        return self.optimizer

    def create_scheduler(
        self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None
    ) -> torch.optim.lr_scheduler.LRScheduler:
        """The DeepSpeed config's scheduler section, when it has one, its step counts "auto" from the run's
        length as transformers fills them; otherwise Trainer's own."""
        section = self._deepspeed.scheduler if self._deepspeed is not None else None
        if section is None or self.lr_scheduler is not None:
            return super().create_scheduler(num_training_steps, optimizer)
        counts = scheduler_step_counts(self.args, num_training_steps)
        check_scheduler_step_counts(section, counts)
        auto = auto_values(self.args, counts)
        self.lr_scheduler = deepspeed_reader.build_scheduler(section, optimizer or self.optimizer, auto)
        self._created_lr_scheduler = True  # as Trainer's own create_scheduler marks it
        return self.lr_scheduler

    @property
    def zero_engine(self) -> ZeroEngine | None:
        """The engine sharding the model once training has prepared it (None before)."""
        return getattr(self.accelerator, "engine", None)

    # ------------------------------------------------------------- saving
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Every process gathers the full weights (stage 3 needs them all); Trainer's ``_save`` writes them
        from the saving process and returns on the others."""
        if state_dict is None and self.zero_engine is not None:
            state_dict = self.accelerator.get_state_dict(self.model)
        super()._save(output_dir, state_dict=state_dict)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Every process writes its optimizer shard into ``optimizer_zero/`` (Trainer's ``optimizer.pt`` would
        hold the saving process's share only); the scheduler as Trainer saves it."""
        engine = self.zero_engine
        if engine is None:
            super()._save_optimizer_and_scheduler(output_dir)
            return
        engine.save_checkpoint(Path(output_dir) / OPTIMIZER_DIR, include_model=False)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """The optimizer from ``optimizer_zero/`` (any number of processes, any stage; the weights were loaded
        from the checkpoint's model file by Trainer before sharding), the scheduler as Trainer loads it."""
        engine = self.zero_engine
        if checkpoint is None or engine is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        folder = Path(checkpoint)
        if not (folder / OPTIMIZER_DIR).is_dir():
            if (folder / OPTIMIZER_NAME).is_file():
                raise ValueError(
                    f"{checkpoint} holds Trainer's {OPTIMIZER_NAME}, not a ZeroTrainer checkpoint "
                    f"({OPTIMIZER_DIR}/): resume it with the Trainer that wrote it, or start from its weights "
                    "(ZeroTrainer(model=AutoModel.from_pretrained(checkpoint)))."
                )
            return  # as Trainer: a checkpoint without optimizer state (save_only_model) resumes the weights only
        engine.load_checkpoint(folder / OPTIMIZER_DIR, load_model=False)
        scheduler_file = folder / SCHEDULER_NAME
        if scheduler_file.is_file():
            self.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))


def _arguments_for_zero(args: Any, model: Any) -> Any:
    """Plain ``TrainingArguments(deepspeed=...)`` (buildable where DeepSpeed is installed) rebuilt as
    ``ZeroTrainingArguments`` with the same values, so that transformers' DeepSpeed setup is undone; a model
    DeepSpeed already partitioned (``from_pretrained`` after such arguments, with a stage-3 config) is refused."""
    if not getattr(args, "deepspeed", None) or isinstance(args, ZeroTrainingArguments):
        return args
    refuse_partitioned_model(model)
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()  # transformers' global "ZeRO-3 is on": DeepSpeed does not run in this process
    kind = ZeroTrainingArguments
    if type(args) is not TrainingArguments:  # Seq2SeqTrainingArguments and the like keep their own fields
        kind = type(f"Zero{type(args).__name__}", (ZeroTrainingArguments, type(args)), {})
    return kind(**{f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init})
