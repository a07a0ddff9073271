"""A DeepSpeed config's ``train_batch_size`` under ``ZeroAccelerator``: the global batch held to
micro-batch x accumulation x data-parallel ranks (``zero_core.deepspeed.batch_size``).

The Accelerator's accumulation is the config's ``gradient_accumulation_steps``, else the one the script gave
(``ZeroAccelerator(gradient_accumulation_steps=)``, a ``GradientAccumulationPlugin`` or the launcher's variable;
any value but the default 1 counts as given), else the one DeepSpeed derives from ``train_batch_size``. The
micro-batch is the config's ``train_micro_batch_size_per_gpu``, else (absent or "auto", which Accelerate fills
from the DataLoader) the batch size of the first DataLoader ``prepare`` sees, as Accelerate reads it (divided
among the processes under ``split_batches``). Where the micro-batch is the config's, the accumulation is settled
when the Accelerator is built; otherwise at that ``prepare``. A DataLoader whose batch size is not the config's
micro-batch, numbers that disagree, and a first ``backward`` with the micro-batch still unknown are refused, the
same on every rank, before any step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch.utils.data import DataLoader

from zero_core.deepspeed import DeepSpeedSettings, GlobalBatch

_GIVEN = "ZeroAccelerator(gradient_accumulation_steps={})"


class ConfigBatch:
    """The config's global batch for one Accelerator: resolved once, then each DataLoader checked against it."""

    def __init__(
        self,
        translated: DeepSpeedSettings | None,
        ranks: int,
        accumulation: int,
        split_batches: bool,
        every_rank: Callable[[int], list[int]],
    ) -> None:
        """``ranks``: the data-parallel ranks; ``accumulation``: the Accelerator's, as Accelerate settled it;
        ``every_rank``: each rank's value of an int (an all-gather), so every rank decides alike."""
        wants = translated is not None and translated.loop.get("train_batch_size") is not None
        self._translated = translated if wants else None
        self._ranks, self._split_batches, self._every_rank = ranks, split_batches, every_rank
        self._given = accumulation if accumulation != 1 else None
        self.accumulation = accumulation
        self.batch: GlobalBatch | None = None
        self._loader_checked = False
        if self._translated is not None and "train_micro_batch_size_per_gpu" in self._translated.loop:
            self._resolve(None)

    def _resolve(self, micro_batch: int | None) -> None:
        assert self._translated is not None
        self.batch = self._translated.global_batch(
            self._ranks, self._given, _GIVEN.format(self._given), micro_batch=micro_batch
        )
        assert self.batch is not None  # the config has a train_batch_size
        self.accumulation = self.batch.accumulation

    def see_prepared(self, objects: Sequence[Any]) -> None:
        """``prepare``'s arguments: the first DataLoader among them, the first time one comes, settles the
        micro-batch (or is checked against the config's)."""
        if self._translated is None or self._loader_checked:
            return
        loaders = [obj for obj in objects if isinstance(obj, DataLoader)]
        if not loaders:
            return
        size = loaders[0].batch_size
        if size is not None and self._split_batches:
            size //= self._ranks
        values = self._every_rank(-1 if size is None else size)
        if len(set(values)) > 1:
            raise ValueError(
                f"{self._translated.source}: train_batch_size needs one micro-batch on every rank, and the ranks' "
                f"first prepared DataLoaders yield batches of {values} (by rank; -1: no batch_size): give them one "
                "batch_size."
            )
        observed = None if values[0] == -1 else values[0]
        if self.batch is None:
            if observed is None:
                raise ValueError(
                    f"{self._translated.source}: train_batch_size={self._translated.loop['train_batch_size']} needs "
                    "the micro-batch, and the DataLoader has no batch_size: set train_micro_batch_size_per_gpu in "
                    "the config, or remove train_batch_size."
                )
            self._resolve(observed)
        assert self.batch is not None
        self.batch.check_micro_batch(observed, "the DataLoader")
        self._loader_checked = True

    def before_backward(self) -> None:
        """A config micro-batch that is "auto" was never settled: no DataLoader went through ``prepare``."""
        if self._translated is not None and self.batch is None:
            raise ValueError(
                f"{self._translated.source}: train_batch_size={self._translated.loop['train_batch_size']} with "
                'train_micro_batch_size_per_gpu "auto" or left out takes the micro-batch from the DataLoader '
                "passed to accelerator.prepare, and none was: prepare the DataLoader, or set "
                "train_micro_batch_size_per_gpu in the config."
            )
