"""The host step of one unit (offload_step_in_backward) takes the kernel its whole param group takes in
optimizer.step(): the fused one only when every piece of the group is on the host."""

from __future__ import annotations

import torch

from zero_core.optim.host_step import step_of_pieces

GRADIENTS = [torch.randn(100_000, generator=torch.Generator().manual_seed(step)) for step in range(5)]


def _stepped(whole_group_extra: list[torch.Tensor], **optimizer_settings: object) -> torch.Tensor:
    piece = torch.nn.Parameter(torch.randn(100_000, generator=torch.Generator().manual_seed(9)))
    optimizer = torch.optim.AdamW([piece], lr=1e-2, **optimizer_settings)
    step = step_of_pieces(optimizer, [[piece]], [[piece, *whole_group_extra]])
    for gradient in GRADIENTS:
        piece.grad = gradient.clone()
        step()
    return piece.detach()


def test_a_unit_steps_with_the_kernel_its_whole_group_takes() -> None:
    fused, loop = _stepped([], fused=True), _stepped([], foreach=False)
    assert not torch.equal(fused, loop)  # the two kernels round differently: the check below can tell them apart
    assert torch.equal(_stepped([]), fused)  # every piece of the group on the host: fused, as fused_on_host
    on_the_device = torch.empty(1, device="meta")  # a piece of the same group kept on the device (a fraction)
    assert torch.equal(_stepped([on_the_device]), loop)
    assert torch.equal(_stepped([], foreach=False), loop)  # the user's own choice is kept
