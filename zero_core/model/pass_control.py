"""What the model layer needs of the step runtime, as a Protocol: model code runs outside a pass
and never imports the passes layer (arrows point one way)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol


class PassControl(Protocol):
    @property
    def require_grad_sync(self) -> bool:
        """The next backward reduces the gradients (False inside ``no_sync``)."""
        ...

    @property
    def suspended(self) -> bool:
        """Inside ``suspend()``: full parameters were swapped in by the caller."""
        ...

    def quiesce(self) -> None:
        """The entry barrier before model state is read or written outside a pass."""
        ...

    def suspend(self) -> AbstractContextManager[None]:
        """No gather or reshard while the caller holds full parameters in place."""
        ...
