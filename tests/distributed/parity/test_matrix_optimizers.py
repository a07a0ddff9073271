"""Optimizers that need whole tensors (``torch.optim.Muon``, ``torch.optim.Adafactor``, transformers' Adafactor)
at stages 1-3 train like DDP with the same optimizer: each tensor stepped whole at an owner rank, its pieces
sent there and its update sent back.

The model's matrices are square (``mix``), tall (``up``), wide (``down``) and tied (the embedding and head);
at 2 and 3 ranks the units' shards cut matrices between ranks, so owners receive pieces from others.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.checkpoint_files import assert_same_checkpoint
from tests.distributed.checkpoint.test_checkpoint_roundtrip import global_batch
from tests.models import TinyTransformer, batch, lm_loss, make_optimizer
from tests.rank_pool import run_distributed
from tests.workers import config_for, parity_grid, train_clipped
from zero_core import MixedPrecision, ZeroEngine

STAGES = (1, 2, 3)
CASES = [dict(stage=s, optimizer_name="muon") for s in STAGES]
# Accumulated and clipped. DDP's gradients are clipped with the engine's norm, and at stages 2/3 (whose shards
# sum each micro-batch's reduced gradient) reduced every micro-batch too: the sums in the same order.
CLIPPED = dict(optimizer_name="muon", micro_batches=2, clip=0.5, reference_clips_at_our_norm=True)
CASES += [dict(stage=1, **CLIPPED)] + [dict(stage=s, sync_every_micro_batch=True, **CLIPPED) for s in (2, 3)]
CASES += [dict(stage=s, optimizer_name="muon", settings={"offload_optimizer": "cpu"}) for s in STAGES]
CASES += [dict(stage=3, optimizer_name="muon", persistence_threshold=2000)]  # the blocks' units kept whole
# zero_core.MuonWithAuxAdamW: its Muon groups stepped whole at owners, its AdamW groups on each rank's pieces.
CASES += [dict(stage=s, optimizer_name="muon+adamw") for s in STAGES]
CASES += [dict(stage=3, optimizer_name="muon+adamw", settings={"offload_optimizer": "cpu"})]
# torch's Adafactor: every tensor whole at an owner (vectors too), its row and column factors kept whole on the
# holders of each matrix.
CASES += [dict(stage=s, optimizer_name="adafactor") for s in STAGES]
CASES += [dict(stage=1, **dict(CLIPPED, optimizer_name="adafactor"))]
CASES += [dict(stage=3, sync_every_micro_batch=True, **dict(CLIPPED, optimizer_name="adafactor"))]
CASES += [dict(stage=2, optimizer_name="adafactor", settings={"offload_optimizer": "cpu"})]
# transformers' Adafactor (the Hugging Face Trainer's optim="adafactor"): factors without the reduced dimension,
# a Python step count.
CASES += [dict(stage=s, optimizer_name="hf-adafactor") for s in (1, 3)]
# A DeepSpeed config's "Muon" section, built as DeepSpeed's engine splits the parameters.
CASES += [dict(stage=s, optimizer_name="deepspeed-muon") for s in (1, 3)]


def _case_id(case: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in case.items())


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"world{n}")
def grid(request: pytest.FixtureRequest) -> tuple[int, list[list[dict]]]:
    """At 3 ranks every rank trains on the same batches and DDP sums before it averages, as the engine does:
    otherwise the reduce-scatter's order of sums and DDP's division first put the gradients a rounding apart (as
    SGD shows in test_parity.py), which Muon's bf16 Newton-Schulz amplifies to ~1e-3 in a few steps or not, by
    the CPU's kernels. Equal addends give one sum in any order, so the owners' step is compared bit for bit
    there too. 2 ranks keep each rank's own batches (halving is exact)."""
    world_size = request.param
    cases = [dict(case, equal_sums=world_size == 3) for case in CASES]
    return world_size, run_distributed(parity_grid, world_size, cases)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[_case_id(c) for c in CASES])
def test_each_whole_tensor_optimizer_matches_ddp_with_it(grid: tuple[int, list], index: int) -> None:
    """Bitwise: the owner runs the optimizer's own step (Muon's, Adafactor's) on the whole tensor, as DDP's rank
    does, from the same gradients. Why the clipped cases give DDP the engine's order of sums: the norm (equal to
    torch's within 1e-6, compared here) or an accumulated gradient one rounding off moves Muon's update by up to
    ~1e-3, as it would under DDP itself, because Newton-Schulz in bf16 amplifies the smallest singular
    directions."""
    world_size, per_rank = grid
    case = CASES[index]
    # Adafactor's elementwise scaling shows the one rounding a stage-2/3 shard's sum of micro-batches can differ
    # by from DDP's accumulated .grad.
    accumulated = case["optimizer_name"] == "adafactor" and case.get("micro_batches", 1) > 1 and case["stage"] > 1
    tolerance = 1e-6 if accumulated else 0.0
    for rank, results in enumerate(per_rank):
        result = results[index]
        assert max(result["param_errors"]) <= tolerance, f"rank {rank}: {result['param_errors']}"
        assert result["losses"] == pytest.approx(result["reference_losses"], rel=tolerance, abs=0)
        for ours, reference in result["norms"]:
            assert ours == pytest.approx(reference, rel=1e-6)
    losses = per_rank[0][index]["losses"]
    assert len(set(losses)) > 1  # it trains


def _bytes_and_work(rank: int, world_size: int, stage: int) -> dict:
    """What Muon's step really sends (every isend counted as torch runs it) against the traffic report, and
    the Newton-Schulz work each rank did (torch's own iteration, wrapped)."""
    import torch.optim._muon as muon_module

    sent = []
    real_batch = dist.batch_isend_irecv

    def counting(ops: list) -> list:
        sent.extend(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return real_batch(ops)

    work = []
    real_ns = muon_module._zeropower_via_newtonschulz

    def counting_ns(grad: torch.Tensor, *args: object):  # type: ignore[no-untyped-def]
        m, n = grad.shape
        work.append(m * n * min(m, n))
        return real_ns(grad, *args)

    torch.manual_seed(0)
    model = TinyTransformer()
    engine = ZeroEngine(model, make_optimizer("muon", model), config_for(stage))
    ids = batch(0, rank)
    engine.backward(lm_loss(model(ids), ids))
    dist.batch_isend_irecv, muon_module._zeropower_via_newtonschulz = counting, counting_ns
    try:
        engine.step()
    finally:
        dist.batch_isend_irecv, muon_module._zeropower_via_newtonschulz = real_batch, real_ns
    matrices = [p for group in make_optimizer("muon", TinyTransformer()).param_groups for p in group["params"]]
    return {
        "sent": sum(sent),
        "reported": engine.last_step_traffic["send"].bytes,
        "work": sum(work),
        "costs": [p.shape[0] * p.shape[1] * min(p.shape) for p in matrices],
    }


@pytest.mark.parametrize("stage", [1, 3])
def test_bytes_sent_are_reported_and_the_work_is_shared(stage: int) -> None:
    per_rank = run_distributed(_bytes_and_work, 2, stage)
    for result in per_rank:
        assert result["sent"] > 0
        assert result["reported"] == result["sent"]
    costs = per_rank[0]["costs"]
    assert sum(result["work"] for result in per_rank) == sum(costs)  # each matrix once, not once per rank
    for result in per_rank:
        assert abs(result["work"] - sum(costs) / 2) <= max(costs)


def _planned_and_sent(rank: int, world_size: int, name: str) -> dict:
    """zero-estimate's figures for the whole-tensor step against one real step: the bytes every isend carried
    (torch's own batch_isend_irecv, wrapped) and the whole tensors an owner really built in a round."""
    from zero_core.memory.estimate import estimate
    from zero_core.optim.whole_tensor_step import WholeTensorStep

    sent, built, reported = [], [], []
    real_batch, real_gather, real_step = dist.batch_isend_irecv, WholeTensorStep._gather, WholeTensorStep._step_whole

    def counting(ops: list) -> list:
        sent.extend(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return real_batch(ops)

    def gathering(self, tensors, optimizer):  # type: ignore[no-untyped-def]
        mine = real_gather(self, tensors, optimizer)
        built.append(sum(w.weight.nbytes + w.weight.grad.nbytes + w.kept.nbytes for w in mine))
        built[-1] += sum(value.nbytes for w in mine for value in w.state.values())
        return mine

    def stepping(self, optimizer, mine):  # type: ignore[no-untyped-def]
        reported.append(engine.memory_report().communication_bytes)  # a report taken inside the round
        return real_step(self, optimizer, mine)

    torch.manual_seed(0)
    model = TinyTransformer()
    trainable = [p for p in model.parameters() if p.requires_grad]  # the model's order, as torch's docs list them
    optimizer = (
        torch.optim.Muon([p for p in trainable if p.ndim == 2]) if name == "muon" else torch.optim.Adafactor(trainable)
    )
    config = config_for(3)
    engine = ZeroEngine(model, optimizer, config)
    ids = batch(0, rank)
    engine.backward(lm_loss(model(ids), ids))
    dist.batch_isend_irecv, WholeTensorStep._gather, WholeTensorStep._step_whole = counting, gathering, stepping
    try:
        engine.step()
    finally:
        dist.batch_isend_irecv, WholeTensorStep._gather, WholeTensorStep._step_whole = (
            real_batch,
            real_gather,
            real_step,
        )
    planned = estimate(TinyTransformer(), world_size, config, whole_tensor_optimizer=name)
    return {
        "sent": sum(sent),
        "built": max(built),
        "reported": max(reported, default=0),
        "after": engine.memory_report().communication_bytes,
        "planned_sent": planned.whole_tensor_sent_bytes,
        "planned_built": planned.whole_tensor_working_bytes,
    }


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", ["muon", "adafactor"])
def test_zero_estimate_plans_the_bytes_the_step_sends_and_builds(name: str, world_size: int) -> None:
    """The estimate runs the step's own plan of owners and rounds over the model's layouts: the most any rank
    sends equals what the busiest rank's isends carried, and the most an owner builds at once equals the largest
    round's whole tensors it really made; memory_report() taken inside a round counts them (communication
    bytes), and nothing once the step is over."""
    per_rank = run_distributed(_planned_and_sent, world_size, name)
    assert per_rank[0]["planned_sent"] == max(result["sent"] for result in per_rank) > 0
    assert per_rank[0]["planned_built"] == max(result["built"] for result in per_rank) > 0
    for result in per_rank:
        assert result["reported"] == result["built"] and result["after"] == 0


def _non_matrix_added_later(rank: int, world_size: int) -> str:
    torch.manual_seed(0)
    model = TinyTransformer()
    optimizer = make_optimizer("muon", model)
    engine = ZeroEngine(model, optimizer, config_for(2))
    optimizer.add_param_group({"params": [model.blocks[0].mix.bias]})  # torch's constructor would refuse it
    ids = batch(0, rank)
    engine.backward(lm_loss(model(ids), ids))
    try:
        engine.step()
    except ValueError as error:
        return str(error)
    return "stepped"


def test_a_non_matrix_added_later_is_refused_on_every_rank() -> None:
    errors = run_distributed(_non_matrix_added_later, 2)
    assert errors[0] == errors[1]
    assert "Muon only supports 2D parameters" in errors[0] and "blocks.0.mix.bias" in errors[0]


def _refused_settings(rank: int, world_size: int, offload_dir: str) -> dict[str, str]:
    errors = {}
    for name, settings in {
        "nvme": {"offload_optimizer": "nvme", "offload_dir": offload_dir},
        "in_backward": {"offload_optimizer": "cpu", "offload_step_in_backward": True},
    }.items():
        torch.manual_seed(0)
        model = TinyTransformer()
        try:
            ZeroEngine(model, make_optimizer("muon", model), config_for(3, **settings))
            errors[name] = "built"
        except ValueError as error:
            errors[name] = str(error)
    return errors


def test_settings_muon_cannot_run_with_are_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    errors = run_distributed(_refused_settings, 2, str(tmp_path))
    assert errors[0] == errors[1]
    assert 'offload_optimizer="nvme"' in errors[0]["nvme"] and "Muon" in errors[0]["nvme"]
    assert "offload_step_in_backward" in errors[0]["in_backward"]


def _whole_tensor_run(name: str, stage: int) -> tuple[TinyTransformer, ZeroEngine]:
    torch.manual_seed(0)
    model = TinyTransformer().eval()  # BatchNorm on running statistics: independent of the split
    return model, ZeroEngine(model, make_optimizer(name, model), config_for(stage))


def _train_global(model: TinyTransformer, engine: ZeroEngine, steps: range) -> list[float]:
    losses = []
    for step in steps:
        ids = global_batch(step, engine.rank, engine.world_size)
        loss = lm_loss(model(ids), ids)
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / engine.world_size)
    return losses


def _save_whole_tensor(rank: int, world_size: int, directory: str, name: str) -> dict:
    model, engine = _whole_tensor_run(name, 3)
    _train_global(model, engine, range(2))
    engine.save_checkpoint(f"{directory}/saved")
    losses = _train_global(model, engine, range(2, 4))
    return {"losses": losses, "final": engine.full_state_dict()}


def _resume_whole_tensor(rank: int, world_size: int, directory: str, name: str, stage: int) -> dict:
    model, engine = _whole_tensor_run(name, stage)
    engine.load_checkpoint(f"{directory}/saved")
    engine.save_checkpoint(f"{directory}/reloaded-{world_size}-{stage}")
    losses = _train_global(model, engine, range(2, 4))
    return {"losses": losses, "final": engine.full_state_dict()}


# The state a round trip must give back: Muon's momentum (sharded like the weight), Adafactor's column factor
# (kept whole on every holder of its matrix; its step and vectors' variance are compared too), transformers'
# Adafactor's row factor (its step a Python int, saved as a pickled number and loaded back as one).
_KEPT_STATE = {"muon": "momentum_buffer", "adafactor": "col_var", "hf-adafactor": "exp_avg_sq_row"}


@pytest.mark.parametrize("name", sorted(_KEPT_STATE))
def test_a_whole_tensor_checkpoint_resumes_at_another_world_size_and_stage(tmp_path, name: str) -> None:  # type: ignore[no-untyped-def]
    """Saved at 2 ranks and stage 3: loaded at 2 ranks it continues bit for bit; at 3 ranks and stage 1 it
    loads exactly (saved again, the same bytes: the factors each new holder loaded whole, the momentum's new
    pieces) and continues within what the other split's rounding (amplified by Newton-Schulz) allows."""
    saved = run_distributed(_save_whole_tensor, 2, str(tmp_path), name)[0]
    same = run_distributed(_resume_whole_tensor, 2, str(tmp_path), name, 3)[0]
    other = run_distributed(_resume_whole_tensor, 3, str(tmp_path), name, 1)[0]
    for world_size, stage in ((2, 3), (3, 1)):
        assert_same_checkpoint(tmp_path / "saved", tmp_path / f"reloaded-{world_size}-{stage}", _KEPT_STATE[name])
    assert same["losses"] == saved["losses"]
    assert all(torch.equal(same["final"][key], value) for key, value in saved["final"].items())
    assert other["losses"] == pytest.approx(saved["losses"], rel=1e-4)


def _whole_tensor_precisions(rank: int, world_size: int, name: str) -> dict[str, list[float]]:
    losses = {}
    for stage in STAGES:
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            model = TinyTransformer()
            config = config_for(stage, precision=MixedPrecision(compute_dtype=dtype))
            engine = ZeroEngine(model, make_optimizer(name, model, lr=3e-2), config)
            losses[f"{stage}-{dtype}"] = train_clipped(model, engine, rank, range(8))
    return losses


@pytest.mark.parametrize("name", ["muon", "adafactor"])
def test_bf16_compute_with_a_whole_tensor_optimizer_tracks_fp32_at_every_stage(name: str) -> None:
    """bf16 compute, fp32 master and reduction: Muon and Adafactor step the fp32 masters (and Adafactor's
    factors are fp32), as with fp32 compute."""
    losses = run_distributed(_whole_tensor_precisions, 2, name)[0]
    for stage in STAGES:
        fp32, bf16 = losses[f"{stage}-torch.float32"], losses[f"{stage}-torch.bfloat16"]
        assert bf16[-1] < 0.8 * bf16[0], "the run must train"
        assert bf16 != fp32, "bf16 must actually be used"
        assert bf16 == pytest.approx(fp32, rel=0.02)


def test_muon_with_parameters_offloaded_and_hybrid_sharding_matches_ddp(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """At 4 ranks, bit for bit: stage-3 parameters in files or in host memory (the masters the owners read and
    write live there), and hybrid sharding (owners inside each shard group of 2; both groups step alike).
    Muon alone: an AdamW piece one rounding off DDP's (hybrid sums within the shard group, then across) would
    be amplified by Newton-Schulz through the next steps' gradients."""
    cases = [
        dict(stage=3, optimizer_name="muon", settings={"offload_params": "nvme", "offload_optimizer": "cpu"}),
        dict(stage=3, optimizer_name="muon", settings={"offload_params": "cpu", "offload_optimizer": "cpu"}),
        dict(stage=3, optimizer_name="muon", shard_group_size=2),
    ]
    cases[0]["settings"]["offload_dir"] = str(tmp_path)
    for results in run_distributed(parity_grid, 4, cases):
        for case, result in zip(cases, results):
            assert result["param_errors"] == [0.0] * 5, case
            assert result["losses"] == result["reference_losses"]


def _owner_step_raises(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = TinyTransformer()
    optimizer = make_optimizer("muon", model)
    engine = ZeroEngine(model, optimizer, config_for(3))
    optimizer.param_groups[0]["ns_steps"] = 100  # torch's Newton-Schulz refuses it, on the owners only
    ids = batch(0, rank)
    engine.backward(lm_loss(model(ids), ids))
    try:
        engine.step()
        error = "stepped"
    except ValueError as raised:
        error = str(raised)
    optimizer.param_groups[0]["ns_steps"] = 5
    engine.zero_grad()
    engine.backward(lm_loss(model(ids), ids))
    engine.step()  # the engine trains on
    return {"error": error, "steps": engine.steps_taken}


def test_an_owners_failing_step_is_raised_on_every_rank_and_training_goes_on() -> None:
    results = run_distributed(_owner_step_raises, 2)
    assert results[0]["error"] == results[1]["error"]
    assert "Muon.step() failed on ranks [0, 1]" in results[0]["error"]
    assert "Number of steps must be less than 100" in results[0]["error"]
    assert [result["steps"] for result in results] == [1, 1]


def _muon_with_tensor_parallelism(rank: int, world_size: int) -> str:
    from tests.tensor_parallel_model import Layer, TinyLlama, parallelize
    from zero_core import WrapPolicy, ZeroConfig, tensor_parallel_mesh

    mesh = tensor_parallel_mesh(2)
    torch.manual_seed(0)
    split = parallelize(TinyLlama(), mesh["tensor_parallel"])
    muon = torch.optim.Muon([p for p in split.parameters() if p.ndim == 2])
    config = ZeroConfig(stage=3, wrap_policy=WrapPolicy(module_classes=(Layer,)))
    try:
        ZeroEngine(split, muon, config, device_mesh=mesh)
    except ValueError as error:
        return str(error)
    return "built"


def test_muon_with_tensor_parallelism_is_refused_on_every_rank() -> None:
    errors = run_distributed(_muon_with_tensor_parallelism, 4)
    assert len(set(errors)) == 1
    assert "Muon under ZeRO does not run with tensor parallelism" in errors[0]
