"""One check at a unit's construction: the offload plan and the tensors the storage built agree on whether the
fp32 master is a tensor of its own (the plan's ``master_stands_alone``)."""

from __future__ import annotations

import torch

from ..offload_plan import UnitOffload


def check_master_placement(
    master: torch.Tensor, parameters: list[torch.Tensor], offload: UnitOffload, label: str
) -> None:
    """With the optimizer state in files, the plan rests the master in them only if it is its own memory.
    Where the plan and the tensors disagree (a case the plan's tests did not build), freeing the master would
    free the parameters, or a master left in memory would be counted on disk: refused before any work, with
    the same message on every rank (every rank builds the same units)."""
    if not offload.state_in_file:
        return
    address = master.untyped_storage().data_ptr()
    own_memory = address != 0 and all(address != t.untyped_storage().data_ptr() for t in parameters)
    if offload.master_in_file != own_memory:
        raise RuntimeError(
            f"ZeRO: internal error: the offload plan puts {label}'s fp32 master "
            f"{'in' if offload.master_in_file else 'outside'} the optimizer state's file, but it was built "
            f"{'as the memory of the parameters' if offload.master_in_file else 'as a tensor of its own'}. "
            "Please report it with your config; offload_optimizer='cpu' avoids it."
        )
