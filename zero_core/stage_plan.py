"""What a ZeRO stage means for the units and the runtime, derived once from ``stage``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StagePlan:
    """What a ZeRO stage means for the runtime, derived once from ``stage``.

    Units and the step runtime read these behaviours instead of comparing
    stage numbers, so each rule lives in one place. Communication per optimizer
    step (Ψ parameters):

    - stage 1: gradients accumulate in full on every rank; at the accumulation
      boundary each unit is reduce-scattered (Ψ) as soon as its backward ends;
      the optimizer updates this rank's fp32 shard; the updated shards are
      all-gathered (Ψ) back into the full parameters.
    - stage 2: as stage 1, but every micro-batch reduce-scatters each unit
      during backward and keeps only the gradient shard.
    - stage 3: parameters are sharded at rest; each unit is all-gathered before
      its forward (Ψ) and again before its backward (Ψ), released after each,
      and its gradients are reduce-scattered (Ψ) when its backward ends.
    """

    params_sharded_at_rest: bool  # stage 3: full parameters exist only while a unit runs
    grads_sharded: bool  # stages 2/3: each backward reduce-scatters and keeps only the shard
    reduce_inside_no_sync: bool  # stages 2/3 cannot hold full gradients across micro-batches

    @classmethod
    def for_stage(cls, stage: int) -> "StagePlan":
        return cls(params_sharded_at_rest=stage == 3, grads_sharded=stage >= 2, reduce_inside_no_sync=stage >= 2)
