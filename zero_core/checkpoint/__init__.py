"""Sharded checkpoints: save/resume at any world size and stage, consolidation."""

from .checkpoint_error import CheckpointError
from .consolidate import consolidate_checkpoint, lightning_checkpoint, load_full_checkpoint
from .directory import is_sharded_checkpoint, remove_checkpoint

__all__ = [
    "CheckpointError",
    "consolidate_checkpoint",
    "is_sharded_checkpoint",
    "lightning_checkpoint",
    "load_full_checkpoint",
    "remove_checkpoint",
]
