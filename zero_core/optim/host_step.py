"""The optimizer step of offloaded units runs on the host: torch's fused CPU kernel where the user left the
implementation to torch.

torch's default for CPU tensors is the per-tensor loop; its fused CPU Adam/AdamW computes the same update
4-5x faster (benchmarks/host_adam.py: 13 ms against 49-61 ms for 20M elements on 2 cores, 16 against 88-97 ms
for 84M on 16; the weights differ from the loop's by one rounding at most). A group that names ``foreach`` or
``fused`` itself keeps its choice. The flag is set for the step only (``chosen``: restored even when the
step raises), so the groups the user, schedulers and ``state_dict()`` see are the ones the user built.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

# The optimizers whose fused CPU kernel was measured and matches the per-tensor update.
FUSED_ON_HOST = (torch.optim.Adam, torch.optim.AdamW)


class HostStepKernel:
    def __init__(self) -> None:
        self._chosen: list[dict[str, Any]] = []

    def choose(self, optimizer: torch.optim.Optimizer) -> None:
        """For the step about to run: groups whose pieces all live on the host take the fused kernel."""
        self.restore()
        if not isinstance(optimizer, FUSED_ON_HOST):
            return
        for group in optimizer.param_groups:
            left_to_torch = group.get("fused") is None and group.get("foreach") is None
            on_host = bool(group["params"]) and all(p.device.type == "cpu" for p in group["params"])
            if left_to_torch and on_host and not group.get("differentiable", False):
                group["fused"] = True
                self._chosen.append(group)

    @contextlib.contextmanager
    def chosen(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """The fused kernel for what runs inside; the user's flags back whatever happens there."""
        self.choose(optimizer)
        try:
            yield
        finally:
            self.restore()

    def restore(self) -> None:
        """The groups as the user built them (after the step, or before the next forward if it raised)."""
        for group in self._chosen:
            group["fused"] = None
        self._chosen = []
