"""Patterns real training loops bring: a block called twice in one forward,
evaluation under no_grad between steps, a parameter unused on one rank only."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from tests.models import TinyTransformer, batch, lm_loss, make_optimizer
from tests.rank_pool import run_distributed
from tests.workers import config_for, rank0_state_dict, relative_difference
from zero_core import ZeroEngine


class ReusingTransformer(TinyTransformer):
    """Runs block 0 twice; uses the branch only on rank 0 (data-dependent, per rank)."""

    def forward(self, ids: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        x = self.embed(ids)
        x = self.norm((x + 0.5 * self.frozen(x)).transpose(1, 2)).transpose(1, 2)
        x = self.blocks[0](x)
        for block in self.blocks:
            x = block(x)
        if use_branch:
            x = x + self.branch(x)
        return self.head(x)


def _reuse_and_eval(rank: int, world_size: int, stage: int) -> list[float]:
    torch.manual_seed(0)
    reference = ReusingTransformer()
    model = copy.deepcopy(reference)
    ddp = DistributedDataParallel(reference, find_unused_parameters=True)
    reference_optimizer = make_optimizer("adamw", reference)
    engine = ZeroEngine(model, make_optimizer("adamw", model), config_for(stage))
    errors = []
    for step in range(4):
        ids = batch(step, rank)
        branch = rank == 0
        loss = lm_loss(ddp(ids, use_branch=branch), ids)
        loss.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        engine.backward(lm_loss(model(ids, use_branch=branch), ids))
        engine.step()
        for net in (model, ddp):
            net.eval()
        with torch.no_grad():
            evaluation = [lm_loss(net(batch(50, rank)), batch(50, rank)).item() for net in (model, ddp)]
        for net in (model, ddp):
            net.train()
        errors.append(abs(evaluation[0] - evaluation[1]) / abs(evaluation[1]))
        errors.append(relative_difference(engine.full_state_dict(), rank0_state_dict(reference)))
    return errors


def _grid(rank: int, world_size: int) -> list[list[float]]:
    return [_reuse_and_eval(rank, world_size, stage) for stage in (1, 2, 3)]


@pytest.mark.parametrize("world_size", [2, 3])
def test_reused_block_eval_and_rank_dependent_branch_match_ddp(world_size: int) -> None:
    for per_stage in run_distributed(_grid, world_size):
        for stage, errors in zip((1, 2, 3), per_stage):
            assert max(errors) <= 1e-5, f"stage {stage}: {errors}"
