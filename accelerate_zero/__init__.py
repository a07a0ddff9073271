"""ZeRO stages 1-3 for Accelerate: ``ZeroAccelerator``, ``ZeroPlugin`` and the
``accelerate-zero launch`` command. Does not import Lightning."""

from .accelerator import ZeroAccelerator
from .plugin import ZeroPlugin

__all__ = ["ZeroAccelerator", "ZeroPlugin"]
