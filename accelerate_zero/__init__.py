"""ZeRO stages 1-3 for Accelerate: ``ZeroAccelerator``, ``ZeroPlugin``, ``ZeroTrainer`` (Hugging Face's
``Trainer`` with ZeRO) and the ``accelerate-zero launch`` command. Does not import Lightning; transformers
is imported only when ``ZeroTrainer`` is first used."""

from typing import Any

from .accelerator import ZeroAccelerator
from .plugin import ZeroPlugin

__all__ = ["ZeroAccelerator", "ZeroPlugin", "ZeroTrainer", "ZeroTrainingArguments"]


def __getattr__(name: str) -> Any:
    if name == "ZeroTrainer":  # lazily: transformers is an optional dependency
        from .trainer import ZeroTrainer

        return ZeroTrainer
    if name == "ZeroTrainingArguments":  # TrainingArguments whose deepspeed= ZeroTrainer reads
        from .training_arguments import ZeroTrainingArguments

        return ZeroTrainingArguments
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
