"""Sharded checkpoints: save/resume at any world size and stage, consolidation."""

from .consolidate import consolidate_checkpoint, load_full_checkpoint
from .storage import CheckpointError

__all__ = ["CheckpointError", "consolidate_checkpoint", "load_full_checkpoint"]
