"""Muon for the hidden matrices and AdamW for the rest, in one optimizer: the recipe torch's and DeepSpeed's docs
give, for the entry points that take one optimizer (a DeepSpeed config's ``"type": "Muon"``, Accelerate's
``prepare``, Trainer's ``optimizers=``).

A plain torch optimizer, usable without ZeRO: each group says ``use_muon=True`` (torch's ``Muon``, so 2-D
parameters only, refused by torch otherwise) or ``use_muon=False`` (torch's ``AdamW``), with that optimizer's
own hyperparameters and defaults. Its step runs torch's two optimizers on its groups and its state, so its
numbers are theirs. Under ZeRO the Muon groups are stepped whole at owner ranks and the AdamW groups on each
rank's pieces (``whole_tensor_step.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class MuonWithAuxAdamW(torch.optim.Optimizer):
    """``MuonWithAuxAdamW([{"params": matrices, "use_muon": True, "lr": 0.02}, {"params": rest, "use_muon": False,
    "lr": 3e-4}])``: torch's Muon steps the first group, torch's AdamW the second."""

    def __init__(self, param_groups: Iterable[dict[str, Any]]):
        # torch's two optimizers over a placeholder: their steps run on this optimizer's groups and state.
        placeholder = torch.empty(1, 1)
        self._inner = {True: torch.optim.Muon([placeholder]), False: torch.optim.AdamW([placeholder])}
        super().__init__(list(param_groups), defaults={})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """A group of either kind, checked and completed by that optimizer's own constructor."""
        use_muon = param_group.get("use_muon") if isinstance(param_group, dict) else None
        if not isinstance(use_muon, bool):
            raise ValueError(
                "Each param group of MuonWithAuxAdamW says use_muon=True (torch.optim.Muon: the hidden 2-D "
                "matrices) or use_muon=False (torch.optim.AdamW: embeddings, head, norms, biases)."
            )
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        settings = {key: value for key, value in param_group.items() if key not in ("params", "use_muon")}
        kind = torch.optim.Muon if use_muon else torch.optim.AdamW
        completed = kind([{"params": params}], **settings).param_groups[0]
        super().add_param_group({**completed, "use_muon": use_muon})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for use_muon, inner in self._inner.items():
            groups = [group for group in self.param_groups if group["use_muon"] is use_muon]
            if groups:
                inner.param_groups, inner.state = groups, self.state
                inner.step()
        return loss
