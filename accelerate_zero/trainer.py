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
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from transformers import Trainer, TrainingArguments
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

import zero_core.deepspeed as deepspeed_reader  # its optimizer and scheduler builders
from zero_core import CheckpointError, ZeroEngine, user_settings

from .accelerator import ZeroAccelerator
from .deepspeed_flags import ACCUMULATION_VARIABLE
from .plugin import DEEPSPEED_CLIPPING_ENV, DEEPSPEED_CONFIG_ENV, ZeroPlugin
from .trainer_deepspeed import (
    auto_values,
    check_scheduler_step_counts,
    config_name,
    refuse_partitioned_model,
    resolve_for_trainer,
    scheduler_step_counts,
)
from .training_arguments import ZeroTrainingArguments

# The loop's own keys (transformers checked them against the arguments): the Trainer does what they say.
TRAINER_LOOP_KEYS = (
    "gradient_clipping",
    "gradient_accumulation_steps",
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
)
OPTIMIZER_DIR = "optimizer_zero"  # beside Trainer's model, scheduler, RNG and trainer_state.json files
OPTIMIZER_UNFINISHED = "optimizer_zero.unfinished"  # there while an asynchronous save writes OPTIMIZER_DIR


class ZeroTrainer(Trainer):
    """``ZeroTrainer(model=..., args=TrainingArguments(...), ...)``: every argument is ``Trainer``'s, plus
    ``zero_plugin`` (default: the settings ``accelerate-zero launch`` exports, as for ``ZeroAccelerator``).

    ``save_model()`` and ``model.save_pretrained()`` gather the full weights, so under stage 3 every
    process calls them (as under DeepSpeed ZeRO-3); checkpoints hold the optimizer as a sharded
    directory (``optimizer_zero/``) instead of ``optimizer.pt``, and ``resume_from_checkpoint`` reads it
    at any number of processes and stage.

    A DeepSpeed config runs on the ZeRO engine as transformers runs ``TrainingArguments(deepspeed=...)``: its
    "auto"s filled in and its numbers checked against the arguments as transformers does, its optimizer and
    scheduler sections built. It may come as ``ZeroTrainingArguments(deepspeed="ds_config.json")`` (a path or a
    dict: the same arguments; needed where DeepSpeed is not installed, and for a stage-3 config loaded by
    ``from_pretrained`` after them; plain ``TrainingArguments(deepspeed=...)`` is rebuilt as one), as
    ``zero_plugin=ZeroPlugin.from_deepspeed(...)``, or from ``accelerate-zero launch`` (``--zero_config_file
    ds.json``, ``--deepspeed_config_file``, an Accelerate YAML's ``deepspeed_config_file``).
    """

    def __init__(self, *args: Any, zero_plugin: ZeroPlugin | None = None, **kwargs: Any) -> None:
        # Trainer's arguments by name, so that the TrainingArguments and the model can be read (and the
        # arguments replaced) whichever way they were passed.
        given = {**dict(zip(list(inspect.signature(Trainer.__init__).parameters)[1:], args)), **kwargs}
        given["args"] = _arguments_for_zero(given.get("args"), given.get("model"))
        self._deepspeed = None  # the DeepSpeed config's reading, however it arrived
        self._deepspeed_where = "the DeepSpeed config"  # how refusals name it: its path, where it has one
        plugin = zero_plugin if zero_plugin is not None else ZeroPlugin()  # as ZeroAccelerator would build it
        config = _deepspeed_config(given["args"], zero_plugin, plugin)
        _check_launched_loop_values(given["args"])
        if config is not None:
            plugin = self._plugin_from_deepspeed(config, given, plugin)
        self.zero_plugin = plugin  # read by create_accelerator_and_postprocess, inside Trainer.__init__
        self._accelerator_arguments: dict[str, Any] | None = None
        super().__init__(**given)
        if plugin.memory_budget is not None:
            _give_budget_sample(self)

    def _plugin_from_deepspeed(self, config: _GivenConfig, given: dict[str, Any], plugin: ZeroPlugin) -> ZeroPlugin:
        """The DeepSpeed config as transformers reads ``TrainingArguments(deepspeed=...)`` (also under
        ``accelerate launch --deepspeed_config_file``): its "auto"s filled from the arguments and the model, a
        number that contradicts them refused; its optimizer and scheduler sections kept for
        ``create_optimizer``/``create_scheduler``."""
        where = config.where
        # The file as given, first: its refusals name it (the filled-in copy below is a dict). The launcher read
        # it already, and its stage may come from a flag.
        file_reading = deepspeed_reader.from_deepspeed(config.source, stage_given=config.launched)
        resolved = resolve_for_trainer(config.source, given["args"], given.get("model"), where)
        # Trainer clips at max_grad_norm where the config sets no number; DeepSpeed would clip a Muon update.
        clip = resolved.get("gradient_clipping", given["args"].max_grad_norm)
        if problem := deepspeed_reader.muon_clipping_problem(resolved.get("optimizer"), clip):
            raise ValueError(f"{where} with TrainingArguments(max_grad_norm={given['args'].max_grad_norm}): {problem}.")
        # The loop keys are the Trainer's, which they now equal (checked above, as transformers checks them):
        # Trainer clips at max_grad_norm and accumulates gradient_accumulation_steps itself (its Accelerator
        # accumulates none), so the plugin is not told them.
        trainer_view = {k: v for k, v in resolved.items() if k not in TRAINER_LOOP_KEYS}
        if config.launched:
            reading = deepspeed_reader.from_deepspeed(trainer_view, stage_given=True)
            plugin = _with_filled_settings(plugin, file_reading, reading)
            object.__setattr__(plugin, "deepspeed_loop", reading)  # read by ZeroAccelerator
        else:
            plugin = ZeroPlugin.from_deepspeed(trainer_view, engine_clips=False)
            reading = plugin.deepspeed_loop
        self._deepspeed = reading
        self._deepspeed_where = where
        optimizer, scheduler = given.get("optimizers") or (None, None)
        for section, passed in (("optimizer", optimizer), ("scheduler", scheduler)):
            if passed is not None and getattr(reading, section) is not None:
                raise ValueError(
                    f"ZeroTrainer was given optimizers=(...) with a {section}, and {where} has a "
                    f'"{section}" section: drop one of them, the {section} from optimizers=(...) or the section from '
                    f"{where} (transformers refuses both under DeepSpeed too)."
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
        model = self.model if model is None else model
        parameters = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = deepspeed_reader.build_optimizer(section, parameters, auto_values(self.args), model=model)
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
        check_scheduler_step_counts(section, counts, self._deepspeed_where)
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

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """With ``asynchronous_checkpoints`` the optimizer's directory is written in the background: Trainer's
        rotation of older checkpoints waits until it is on disk (``_optimizer_written``), so a failed write
        leaves the previous checkpoint in place."""
        engine = self.zero_engine
        if engine is None or not engine.config.asynchronous_checkpoints or self.args.save_only_model:
            super()._save_checkpoint(model, trial)
            return
        # The previous write first, before Trainer makes this save's folder: its rotation must not count the new,
        # unwritten checkpoint among those it keeps.
        engine.wait_for_checkpoint()
        limit, self.args.save_total_limit = self.args.save_total_limit, None  # rotated in _optimizer_written
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        if engine.checkpoint_being_written is None and self.args.should_save:
            # Written before the save returned (asynchronous_checkpoints_fallback: host memory could not stage
            # it): _optimizer_written ran while the rotation was held off, so it rotates now.
            self._rotate_written_checkpoints(Path(self._get_output_dir(trial=trial)))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Every process writes its optimizer shard into ``optimizer_zero/`` (Trainer's ``optimizer.pt`` would
        hold the saving process's share only); the scheduler as Trainer saves it. In the background with
        ``asynchronous_checkpoints``: a marker file says so until the write is on disk, so a checkpoint whose
        run stopped mid-write is refused at resume instead of resuming its weights without their optimizer."""
        engine = self.zero_engine
        if engine is None:
            super()._save_optimizer_and_scheduler(output_dir)
            return
        folder = Path(output_dir)
        if engine.config.asynchronous_checkpoints:
            if self.args.should_save:
                (folder / OPTIMIZER_UNFINISHED).write_text("optimizer_zero/ is being written in the background\n")
            when_done = functools.partial(self._optimizer_written, folder)
            engine.save_checkpoint(folder / OPTIMIZER_DIR, include_model=False, when_done=when_done)
        else:
            engine.save_checkpoint(folder / OPTIMIZER_DIR, include_model=False)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _optimizer_written(self, folder: Path, _: Path, error: BaseException | None) -> None:
        """A background write of ``folder``'s optimizer ended: on success the marker goes and Trainer's rotation
        runs; on failure the checkpoint folder goes (Trainer made it for this save), so the previous checkpoint
        is again the last one ``resume_from_checkpoint=True`` finds."""
        if not self.args.should_save:
            return
        if error is not None:
            shutil.rmtree(folder, ignore_errors=True)
            return
        (folder / OPTIMIZER_UNFINISHED).unlink(missing_ok=True)
        self._rotate_written_checkpoints(folder.parent)

    def _rotate_written_checkpoints(self, run_dir: Path) -> None:
        """Trainer's ``save_total_limit`` rotation of ``run_dir`` (a no-op while ``_save_checkpoint`` holds the
        limit off)."""
        if hasattr(self, "_rotate_checkpoints"):  # before transformers 5: a method
            self._rotate_checkpoints(use_mtime=True, output_dir=str(run_dir))
        else:
            from transformers.trainer_utils import rotate_checkpoints

            rotate_checkpoints(
                output_dir=str(run_dir),
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """Trainer's, then a checkpoint still being written in the background is waited for (its error raised
        on every process)."""
        result = super().train(*args, **kwargs)
        if self.zero_engine is not None:
            self.zero_engine.wait_for_checkpoint()
        return result

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """The optimizer from ``optimizer_zero/`` (any number of processes, any stage; the weights were loaded
        from the checkpoint's model file by Trainer before sharding), the scheduler as Trainer loads it."""
        engine = self.zero_engine
        if checkpoint is None or engine is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        folder = Path(checkpoint)
        if not (folder / OPTIMIZER_DIR).is_dir():
            if (folder / OPTIMIZER_UNFINISHED).is_file():
                raise CheckpointError(
                    f"{checkpoint} is incomplete: its optimizer state ({OPTIMIZER_DIR}/) was still being written "
                    "in the background when its run stopped. Resume from the checkpoint before it "
                    "(resume_from_checkpoint=<its folder>)."
                )
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


class _GivenConfig(NamedTuple):
    """A DeepSpeed config ZeroTrainer was given, and how."""

    source: dict[str, Any] | str  # as given: a path or a dict
    where: str  # how refusals name it
    launched: bool  # accelerate-zero launch's (--zero_config_file, --deepspeed_config_file, a YAML's)


def _give_budget_sample(trainer: Trainer) -> None:
    """memory_budget measures one batch as the model's forward takes it, its ``example_input_array``, which a
    Hugging Face model lacks: the first ``per_device_train_batch_size`` items of the train dataset through the
    Trainer's collator, only the keywords the model's forward takes, as the Trainer's loader gives them. Read
    from the dataset, not the loader: the sampler and the random state are left as they were. An iterable
    dataset gives none (the engine then asks for ``model.example_input_array``)."""
    model, dataset = trainer.model, trainer.train_dataset
    if getattr(model, "example_input_array", None) is not None or dataset is None:
        return
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
        return
    keywords = set(inspect.signature(model.forward).parameters)
    # The collator may rename a label column to "labels" (transformers' default_data_collator does).
    kept = keywords | {"label", "label_ids"}
    items = [dataset[index] for index in range(min(trainer.args.per_device_train_batch_size, len(dataset)))]
    if not items or not all(isinstance(item, Mapping) for item in items):
        return
    batch = trainer.data_collator([{k: v for k, v in item.items() if k in kept} for item in items])
    model.example_input_array = {k: v for k, v in batch.items() if k in keywords}


def _deepspeed_config(args: Any, given_plugin: ZeroPlugin | None, plugin: ZeroPlugin) -> _GivenConfig | None:
    """The DeepSpeed config, whichever way it arrived: ``ZeroTrainingArguments(deepspeed=...)``,
    ``zero_plugin=ZeroPlugin.from_deepspeed(...)``, or the launcher's (a ZeroPlugin built in a process it started
    carries the file's path). Given twice, the two must be the same config."""
    from_arguments = getattr(args, "zero_deepspeed_config", None)
    from_plugin = getattr(plugin, "deepspeed_source", None)
    launched = from_plugin is not None and from_plugin == os.environ.get(DEEPSPEED_CONFIG_ENV)
    if from_arguments is not None and given_plugin is not None and not launched:
        raise ValueError(
            "ZeroTrainer was given both zero_plugin= and TrainingArguments(deepspeed=...): give the ZeRO settings once."
        )
    if from_arguments is not None and launched:
        if deepspeed_reader.read_deepspeed_config(from_arguments) != deepspeed_reader.read_deepspeed_config(
            from_plugin
        ):
            raise ValueError(
                f"TrainingArguments(deepspeed={config_name(from_arguments)}) and accelerate-zero launch's DeepSpeed "
                f"config {from_plugin} differ: give the DeepSpeed config once (drop deepspeed= from the "
                "arguments, or launch without --zero_config_file/--deepspeed_config_file)."
            )
        from_arguments = None  # the same config: the launcher's reading, where its flags won over the file
    if from_arguments is not None:
        return _GivenConfig(from_arguments, config_name(from_arguments), launched=False)
    if from_plugin is not None:
        return _GivenConfig(from_plugin, config_name(from_plugin), launched=launched)
    return None


class _LaunchedLoopValue(NamedTuple):
    """A loop value Accelerate's DeepSpeed launch options give (its flag, an Accelerate YAML's ``deepspeed_config``
    block, or a DeepSpeed JSON config), which the launcher exports to each process."""

    variable: str
    key: str  # DeepSpeed's name, and its flag's
    argument: str  # the TrainingArguments field that must equal it
    parse: Any
    differs: str  # how the arguments' value differs, in the refusal


# transformers writes them into the DeepSpeed config, whose numbers must then equal the arguments; Trainer clips at
# max_grad_norm and accumulates gradient_accumulation_steps itself, so a different launched value is refused, not
# dropped, as transformers refuses it under DeepSpeed.
_LAUNCHED_LOOP_VALUES = (
    _LaunchedLoopValue(DEEPSPEED_CLIPPING_ENV, "gradient_clipping", "max_grad_norm", float, "clips at another norm"),
    _LaunchedLoopValue(
        ACCUMULATION_VARIABLE,
        "gradient_accumulation_steps",
        "gradient_accumulation_steps",
        int,
        "accumulates another number",
    ),
)


def _check_launched_loop_values(args: Any) -> None:
    for value in _LAUNCHED_LOOP_VALUES:
        launched = os.environ.get(value.variable)
        if launched is None or args is None:
            continue
        given = getattr(args, value.argument)
        if value.parse(launched) != given:
            raise ValueError(
                f"accelerate-zero launch was given {value.key} {value.parse(launched)} (--{value.key}, the "
                "deepspeed_config block of its Accelerate YAML, or its DeepSpeed config), and TrainingArguments("
                f"{value.argument}={given}) {value.differs}: give it once, as TrainingArguments({value.argument}="
                f"...), and drop {value.key} from the launch (transformers refuses the two differing under "
                "DeepSpeed too)."
            )


def _with_filled_settings(plugin: ZeroPlugin, file_reading: Any, reading: Any) -> ZeroPlugin:
    """The settings that only transformers' filling decides (the hidden-size "auto"s: prefetch bucket and
    persistence threshold), taken into the launcher's settings, except where a flag gave another value."""
    settings = {setting.text.name: setting for setting in user_settings()}

    def from_the_file(name: str) -> Any:  # what the launcher exported for it, no flag given
        value = file_reading.settings.get(name)
        return settings[name].text.default if value is None else settings[name].text.normalize(value)

    filled = {k: v for k, v in reading.settings.items() if file_reading.settings.get(k) != v}
    unchanged = {k: v for k, v in filled.items() if getattr(plugin, k) == from_the_file(k)}
    return dataclasses.replace(plugin, **unchanged) if unchanged else plugin


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
