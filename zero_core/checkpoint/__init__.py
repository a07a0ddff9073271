"""Sharded checkpoints: save/resume at any world size and stage, consolidation."""

from .consolidate import consolidate_checkpoint, lightning_checkpoint, load_full_checkpoint
from .directory import is_sharded_checkpoint, remove_checkpoint
from .errors import CheckpointError

__all__ = [
    "CheckpointError",
    "consolidate_checkpoint",
    "is_sharded_checkpoint",
    "lightning_checkpoint",
    "load_full_checkpoint",
    "remove_checkpoint",
]
