"""The parity and offload grid's numbers, bit for bit, to hold a restructuring to "behaviour unchanged".

    torchrun --nproc_per_node 2 benchmarks/same_numbers.py record OUT.pt [--scratch DIR]
    python benchmarks/same_numbers.py compare BEFORE.pt AFTER.pt

``record`` runs from a checkout's root (its own ``zero_core`` and ``tests`` are imported) and trains every
stage x precision (fp32, bf16) x offload_optimizer x offload_params (stage 3) x offload_fraction (1, 0.5) x
offload_step_in_backward (bf16 with an offloaded optimizer), and stage 3's ZeRO++ wires (hpZ alone, and all three
pieces) in both precisions, 3 steps of the tests' tiny transformer each (the stage-3 NVMe runs with 2
micro-batches), then resumes a checkpoint of each into another offload mode for one
step. It saves rank 0's losses and every final full state. ``compare`` says which entries differ: run
``record`` in a checkout of the code before and one after (``git worktree add``), then compare.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch

# The wire's settings by name: exact collectives, hpZ alone, hpZ with quantized weights and gradients. At 2
# ranks a secondary group of 1 is the only one there is (each rank keeps the whole unit for its backward).
WIRES = {
    "exact": {},
    "hpz": {"secondary_shard_group_size": 1},
    "zeropp": {"secondary_shard_group_size": 1, "quantize_weights": True, "quantize_gradients": True},
}


def _grid() -> list[tuple]:
    cases = []
    for stage in (1, 2, 3):
        for precision in ("fp32", "bf16"):
            for optimizer in ("none", "cpu", "nvme"):
                for params in ("none", "cpu", "nvme") if stage == 3 else ("none",):
                    for fraction in (1.0, 0.5) if optimizer != "none" else (1.0,):
                        in_backward = (False, True) if optimizer != "none" and precision == "bf16" else (False,)
                        cases += [(stage, precision, optimizer, params, fraction, b, "exact") for b in in_backward]
    for precision in ("fp32", "bf16"):
        cases += [(3, precision, "none", "none", 1.0, False, wire) for wire in ("hpz", "zeropp")]
    return cases


def record(out: str, scratch: str) -> None:
    import torch.distributed as dist

    sys.path.insert(0, os.getcwd())  # the checkout's own packages
    from tests.models import TinyTransformer, batch, lm_loss, make_optimizer
    from tests.workers import config_for
    from zero_core import MixedPrecision, ZeroEngine

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    os.makedirs(scratch, exist_ok=True)

    def engine_for(stage, precision, optimizer, params, fraction, in_backward, wire):  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        model = TinyTransformer(batchnorm=False)
        bf16 = MixedPrecision(compute_dtype=torch.bfloat16) if precision == "bf16" else None
        config = dataclasses.replace(
            config_for(stage, precision=bf16),
            offload_optimizer=optimizer,
            offload_params=params,
            offload_fraction=fraction,
            offload_step_in_backward=in_backward,
            offload_dir=scratch,
            **WIRES[wire],
        )
        return ZeroEngine(model, make_optimizer("adamw", model), config)

    def train(engine, steps: range, accumulate: int = 1) -> list[float]:  # type: ignore[no-untyped-def]
        losses = []
        for step in steps:
            for micro in range(accumulate):
                ids = batch(10 * step + micro, rank)
                loss = lm_loss(engine.model(ids), ids)
                if micro < accumulate - 1:
                    with engine.no_sync():
                        engine.backward(loss / accumulate)
                else:
                    engine.backward(loss / accumulate)
                losses.append(loss.item())
            engine.step()
            engine.optimizer.zero_grad()
        return losses

    results = {}
    for case in _grid():
        engine = engine_for(*case)
        losses = train(engine, range(3), 2 if case[0] == 3 and case[2] == "nvme" else 1)
        results[str(case)] = (losses, {k: v.clone() for k, v in engine.full_state_dict().items()})
        if case[4] == 1.0 and not case[5]:  # its checkpoint resumed in another offload mode
            path = os.path.join(scratch, "checkpoint")
            engine.save_checkpoint(path)
            other = engine_for(3, case[1], "cpu" if case[2] == "nvme" else "nvme", "none", 1.0, False, "exact")
            other.load_checkpoint(path)
            more = train(other, range(3, 4))
            results[f"{case} resumed"] = (more, {k: v.clone() for k, v in other.full_state_dict().items()})
            del other
        del engine
    if rank == 0:
        torch.save(results, out)
        print(f"{len(results)} entries in {out}")
    dist.destroy_process_group()


def compare(before: str, after: str) -> int:
    a, b = torch.load(before), torch.load(after)
    if a.keys() != b.keys():
        print(f"different entries: {sorted(set(a) ^ set(b))}")
        return 1
    differ = [
        key
        for key in a
        if a[key][0] != b[key][0]
        or a[key][1].keys() != b[key][1].keys()
        or not all(torch.equal(a[key][1][name], b[key][1][name]) for name in a[key][1])
    ]
    print(f"{len(a)} entries, {len(a) - len(differ)} bit for bit equal; differ: {differ}")
    return 1 if differ else 0


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "record":
        scratch = sys.argv[sys.argv.index("--scratch") + 1] if "--scratch" in sys.argv else "/tmp/same-numbers"
        record(sys.argv[2], scratch)
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    else:
        sys.exit(__doc__)
