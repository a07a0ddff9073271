"""``zero_core.MuonWithAuxAdamW`` on its own: torch's Muon and AdamW as two optimizers, in one."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.models import TinyTransformer, batch, lm_loss
from zero_core import MuonWithAuxAdamW


def _split(model: torch.nn.Module) -> tuple[list, list]:
    trainable = [p for p in model.parameters() if p.requires_grad]
    return [p for p in trainable if p.ndim == 2], [p for p in trainable if p.ndim != 2]


def test_it_steps_as_torchs_muon_and_adamw_side_by_side() -> None:
    torch.manual_seed(0)
    ours, theirs = TinyTransformer(), None
    theirs = copy.deepcopy(ours)
    matrices, rest = _split(ours)
    optimizer = MuonWithAuxAdamW(
        [{"params": matrices, "use_muon": True, "lr": 0.02}, {"params": rest, "use_muon": False, "lr": 3e-3}]
    )
    their_matrices, their_rest = _split(theirs)
    muon, adamw = torch.optim.Muon(their_matrices, lr=0.02), torch.optim.AdamW(their_rest, lr=3e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)  # drives both kinds of group
    their_schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (muon, adamw)]
    for step in range(3):
        for model in (ours, theirs):
            ids = batch(step, 0)
            lm_loss(model(ids), ids).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        for other in (muon, adamw):
            other.step()
            other.zero_grad()
        for other in their_schedulers:
            other.step()
    for (name, a), b in zip(ours.state_dict().items(), theirs.state_dict().values()):
        assert torch.equal(a, b), name
    assert optimizer.param_groups[0]["momentum"] == 0.95 and optimizer.param_groups[1]["betas"] == (0.9, 0.999)
    restored = MuonWithAuxAdamW(
        [{"params": matrices, "use_muon": True, "lr": 0.02}, {"params": rest, "use_muon": False, "lr": 3e-3}]
    )
    restored.load_state_dict(optimizer.state_dict())
    assert restored.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"] == 0.02 * 0.5**3
    assert torch.equal(restored.state[matrices[0]]["momentum_buffer"], optimizer.state[matrices[0]]["momentum_buffer"])


def test_each_group_is_checked_by_its_own_optimizer() -> None:
    model = TinyTransformer()
    matrices, rest = _split(model)
    with pytest.raises(ValueError, match="Muon only supports 2D parameters"):
        MuonWithAuxAdamW([{"params": rest, "use_muon": True}])
    with pytest.raises(ValueError, match="says use_muon=True"):
        MuonWithAuxAdamW([{"params": matrices}])
    with pytest.raises(TypeError):  # an AdamW setting in a Muon group: torch's own refusal
        MuonWithAuxAdamW([{"params": matrices, "use_muon": True, "betas": (0.9, 0.95)}])


def test_two_optimizers_are_refused_with_the_one_that_holds_both() -> None:
    """Lightning's configure_optimizers returning [Muon, AdamW], or two handed to Fabric or Accelerate: ZeRO
    shards one optimizer, and the refusal names the one that holds both halves."""
    from zero_core.sharding import single_optimizer

    matrix, vector = torch.nn.Parameter(torch.zeros(4, 4)), torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match=r"got 2 \(Muon, AdamW\).*zero_core\.MuonWithAuxAdamW"):
        single_optimizer([torch.optim.Muon([matrix]), torch.optim.AdamW([vector])])
