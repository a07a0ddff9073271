"""Gradients users can read: ``param.grad`` is absent after a synchronising
backward (never a mix of reduced and local values), and the gradient norms
Lightning logs come from the shards, equal to DDP's."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm

from lightning_zero import grad_norm
from tests.models import TinyTransformer, batch, lm_loss, make_optimizer
from tests.rank_pool import by_rank, run_distributed, run_each
from zero_core import ZeroConfig, ZeroEngine


def _grads_worker(rank: int, world_size: int) -> list[dict]:
    results = []
    # The last: stage 1 under hybrid sharding (groups of one rank, replicated across ranks).
    for stage, shard_group_size in ((1, None), (2, None), (3, None), (1, 1)):
        torch.manual_seed(0)
        model = TinyTransformer(batchnorm=False)
        reference = copy.deepcopy(model)
        config = ZeroConfig(stage=stage, shard_group_size=shard_group_size)
        engine = ZeroEngine(model, make_optimizer("adamw", model), config)
        local = {}
        if stage == 1:  # inside no_sync, stage 1 keeps full local gradients, as DDP does
            with engine.no_sync():
                ids = batch(0, rank)
                engine.backward(lm_loss(model(ids), ids))
            local = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        ids = batch(1, rank)
        engine.backward(lm_loss(model(ids), ids))
        present = [n for n, p in model.named_parameters() if p.grad is not None]
        # What DDP holds after the same backwards: every rank's gradients, averaged.
        steps = (0, 1) if stage == 1 else (1,)
        own = {}
        for step in steps:
            ids = batch(step, rank)
            lm_loss(reference(ids), ids).backward()
            if step == 0:
                own = {n: p.grad.clone() for n, p in reference.named_parameters() if p.grad is not None}
        for param in reference.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad)
                param.grad /= world_size
        ours = {k: v.item() for k, v in grad_norm(model, 2).items()}
        expected = {k: v.item() for k, v in lightning_grad_norm(reference, 2).items()}
        block = {k: v.item() for k, v in grad_norm(model.blocks[1], "inf").items()}
        expected_block = {k: v.item() for k, v in lightning_grad_norm(reference.blocks[1], "inf").items()}
        results.append(
            {
                "stage": stage,
                "present": present,
                "norms": (ours, expected),
                "block": (block, expected_block),
                "local_error": max(((local[n] - own[n]).abs().max().item() for n in own), default=0.0),
                "local_keys": sorted(local) == sorted(own),
            }
        )
    return results


def test_grads_are_absent_not_mixed_and_norms_match_ddp(grid: list) -> None:
    for results in by_rank(grid, "grads"):
        for result in results:
            assert result["present"] == [], result["stage"]
            for ours, expected in (result["norms"], result["block"]):
                assert ours.keys() == expected.keys(), result["stage"]
                for key, value in expected.items():
                    assert ours[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (result["stage"], key)
            if result["stage"] == 1:
                assert result["local_keys"] and result["local_error"] < 1e-6


def _fp16_norms_worker(rank: int, world_size: int) -> list[dict]:
    """fp16 with accumulation: reading norms between micro-batches changes nothing."""
    from zero_core import MixedPrecision

    results = []
    for stage in (1, 2, 3):
        finals = []
        for read_norms in (False, True):
            torch.manual_seed(0)
            model = TinyTransformer(batchnorm=False)
            precision = MixedPrecision(compute_dtype=torch.float16)
            config = ZeroConfig(stage=stage, mixed_precision=precision, initial_loss_scale=2.0**10)
            engine = ZeroEngine(model, make_optimizer("adamw", model), config)
            for micro in range(2):
                ids = batch(micro, rank)
                engine.backward(lm_loss(model(ids), ids) / 2)
                if read_norms and micro == 0:
                    engine.grad_norms()
            norms = engine.grad_norms()
            engine.step()
            finals.append((engine.full_state_dict(), norms["grad_2.0_norm_total"].item()))
        (plain, plain_norm), (read, read_norm) = finals
        results.append(
            {
                "stage": stage,
                "same": all(torch.equal(plain[k], read[k]) for k in plain),
                "norms": (plain_norm, read_norm),
            }
        )
    return results


def test_reading_norms_between_micro_batches_leaves_fp16_gradients_alone(grid: list) -> None:
    for results in by_rank(grid, "fp16 norms"):
        for result in results:
            assert result["same"], result["stage"]
            assert result["norms"][0] == result["norms"][1], result["stage"]


def _tied_worker(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = TinyTransformer(batchnorm=False)
    reference = copy.deepcopy(model)
    engine = ZeroEngine(model, make_optimizer("adamw", model), ZeroConfig(stage=3))
    ids = batch(0, rank)
    engine.backward(lm_loss(model(ids), ids))
    lm_loss(reference(ids), ids).backward()
    for param in reference.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)
            param.grad /= world_size
    return {
        "ours": {k: v.item() for k, v in grad_norm(model.head, 2).items()},  # head.weight is tied to embed.weight
        "expected": {k: v.item() for k, v in lightning_grad_norm(reference.head, 2).items()},
    }


def test_grad_norm_of_a_submodule_names_tied_parameters_as_lightning_does(grid: list) -> None:
    for result in by_rank(grid, "tied"):
        assert result["ours"].keys() == result["expected"].keys() == {"grad_2.0_norm/weight", "grad_2.0_norm_total"}
        for key, value in result["expected"].items():
            assert result["ours"][key] == pytest.approx(value, rel=1e-5)


def _subset_clipping_worker(rank: int, world_size: int) -> list[dict]:
    """Clipping some parameters (a block by norm, the head by value), as DDP users do with
    torch.nn.utils.clip_grad_norm_(model.blocks[1].parameters(), ...): the same norms and weights as DDP;
    ranks that pass different parameters get the same error."""
    from torch.nn.parallel import DistributedDataParallel

    from zero_core import CollectiveFailed

    results = []
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        model = TinyTransformer(batchnorm=False)
        reference = DistributedDataParallel(copy.deepcopy(model))
        # SGD: its update scales with the gradient, so a clip that missed would show in the weights (Adam's not).
        engine = ZeroEngine(model, make_optimizer("sgd", model), ZeroConfig(stage=stage))
        reference_optimizer = make_optimizer("sgd", reference.module)
        norms = []
        for step in range(2):
            ids = batch(step, rank)
            engine.backward(lm_loss(model(ids), ids))
            lm_loss(reference(ids), ids).backward()
            ours = engine.clip_grad_norm_(0.05, parameters=model.blocks[1].parameters())
            engine.clip_grad_value_(1e-3, parameters=[model.branch.weight])
            theirs = torch.nn.utils.clip_grad_norm_(reference.module.blocks[1].parameters(), 0.05)
            torch.nn.utils.clip_grad_value_([reference.module.branch.weight], 1e-3)
            norms.append((ours.item(), theirs.item()))
            engine.step()
            reference_optimizer.step()
            reference_optimizer.zero_grad()
        full = engine.full_state_dict()
        expected = reference.module.state_dict()
        error = max((full[k] - expected[k]).abs().max().item() for k in expected)
        ids = batch(3, rank)
        engine.backward(lm_loss(model(ids), ids))
        try:  # rank 1 picks another block
            engine.clip_grad_norm_(0.05, parameters=model.blocks[rank].parameters())
            refused = "no error"
        except CollectiveFailed as raised:
            refused = str(raised)
        engine.zero_grad()
        results.append({"stage": stage, "norms": norms, "error": error, "refused": refused})
        engine.unshard()
    return results


def test_clipping_some_parameters_matches_ddp_and_ranks_must_pick_the_same(grid: list) -> None:
    by_stage = by_rank(grid, "subset clipping")
    for results in by_stage:
        for result in results:
            for ours, theirs in result["norms"]:
                assert ours == pytest.approx(theirs, rel=1e-5), result["stage"]
            assert result["error"] < 1e-6, result["stage"]
            assert "clip_grad_norm_: the parameters given, as a checksum of their slots" in result["refused"]
    assert [r["refused"] for r in by_stage[0]] == [r["refused"] for r in by_stage[1]], "the same error on every rank"


@pytest.fixture(scope="module")
def grid() -> list[dict]:
    """Every case of this file in one spawn of two ranks."""
    workers = {
        "grads": _grads_worker,
        "fp16 norms": _fp16_norms_worker,
        "tied": _tied_worker,
        "subset clipping": _subset_clipping_worker,
    }
    return run_distributed(run_each, 2, workers, timeout=600)
