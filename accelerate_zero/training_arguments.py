"""``ZeroTrainingArguments``: ``TrainingArguments`` whose ``deepspeed=`` config ``ZeroTrainer`` runs on the ZeRO
engine, with or without DeepSpeed installed.

Why a subclass: transformers acts on ``TrainingArguments(deepspeed=...)`` the moment the arguments are built. It
hands the config to DeepSpeed's classes (so without DeepSpeed installed the arguments cannot even be built),
registers it globally (with a stage-3 config, every later ``from_pretrained`` then loads the model through
``deepspeed.zero.Init``, partitioned by DeepSpeed), and sets up Accelerate's state for DeepSpeed. This class
takes the same arguments, keeps the config for ``ZeroTrainer`` (``zero_deepspeed_config``) and gives
transformers ``deepspeed=None``, so none of that happens. Change one import and nothing else:

    from accelerate_zero import ZeroTrainingArguments as TrainingArguments
"""

from __future__ import annotations

from typing import Any

from transformers import TrainingArguments


class ZeroTrainingArguments(TrainingArguments):
    """``TrainingArguments`` (every argument the same) whose ``deepspeed=`` (a JSON path or a dict, "auto"s and
    all) is read by ``ZeroTrainer`` onto the ZeRO engine instead of DeepSpeed. After construction the config is
    ``zero_deepspeed_config`` and ``deepspeed`` is None: transformers reads ``deepspeed`` as "DeepSpeed runs
    this", which it does not."""

    zero_deepspeed_config: dict[str, Any] | str | None

    def __post_init__(self) -> None:
        self.zero_deepspeed_config = self.deepspeed
        self.deepspeed = None  # before transformers' own __post_init__ acts on it
        super().__post_init__()
