"""Lightning callbacks that read or rewrite the model's parameters outside the training step in ways
ZeRO's shards cannot serve: refused when the strategy sets up, before any training, as Lightning refuses
them for its FSDP and DeepSpeed strategies (otherwise they fail, or silently diverge, epochs later)."""

from __future__ import annotations

from collections.abc import Iterable

from lightning.pytorch import callbacks as lightning_callbacks
from lightning.pytorch.callbacks import Callback

# Callback class name -> what it does to the parameters. By name: WeightAveraging (and its
# EMAWeightAveraging) is recent in Lightning; an older Lightning has none to refuse.
_REFUSED = {
    "StochasticWeightAveraging": "keeps an averaged copy of the parameters and writes it back into them",
    "WeightAveraging": "keeps an averaged copy of the parameters and writes it back into them",
    "ModelPruning": "replaces parameters by masked copies of themselves",
}
_REFUSED_CLASSES = tuple(
    (getattr(lightning_callbacks, name), why) for name, why in _REFUSED.items() if hasattr(lightning_callbacks, name)
)


def refuse_unsupported_callbacks(callbacks: Iterable[Callback]) -> None:
    for callback in callbacks:
        for cls, why in _REFUSED_CLASSES:
            if isinstance(callback, cls):
                raise ValueError(
                    f"{type(callback).__name__} does not work with ZeroStrategy: it {why}, and ZeRO shards "
                    "them (stage 3 frees them between uses; in every stage the optimizer updates its own "
                    "copy on the shards). Lightning refuses it for FSDP and DeepSpeed too. Remove it from "
                    "the Trainer's callbacks."
                )
