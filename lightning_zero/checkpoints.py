"""Reading our sharded checkpoint directories where Lightning expects a checkpoint file."""

from __future__ import annotations

import io
import os

import torch

from zero_core.checkpoint import is_sharded_checkpoint, lightning_checkpoint


def consolidated(path: str | os.PathLike) -> io.BytesIO | str | os.PathLike:
    """``path`` as ``LightningModule.load_from_checkpoint`` (or ``torch.load``) reads it: a sharded
    directory that ``ZeroStrategy`` wrote becomes a Lightning checkpoint in memory (full tensors, verified,
    no process group needed); a file is returned as it is. So one line serves both::

        model = LitModel.load_from_checkpoint(lightning_zero.consolidated(trainer.checkpoint_callback.best_model_path))

    For a file on disk instead: ``zero-consolidate DIR model.ckpt``.
    """
    if not is_sharded_checkpoint(path):  # a file: a consolidated checkpoint, or another strategy's
        return path
    buffer = io.BytesIO()
    torch.save(lightning_checkpoint(path), buffer)
    buffer.seek(0)
    return buffer
