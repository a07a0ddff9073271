"""One node of a simulated two-node run: hybrid-sharded ZeRO (one shard group per
node) against DDP, every stage. Each rank writes OUT/rank<N>.json.

    python -m torch.distributed.run --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \\
        --rdzv-endpoint localhost:PORT --rdzv-id JOB tests/scripts/multinode_train.py OUT

(run once per node; on one machine, twice side by side).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.models import TinyTransformer, make_optimizer  # noqa: E402
from tests.workers import config_for, train_against_ddp  # noqa: E402
from zero_core import ZeroEngine  # noqa: E402


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    rank = dist.get_rank()
    # Which node each rank of this rank's shard group runs on.
    model = TinyTransformer()
    engine = ZeroEngine(model, make_optimizer("sgd", model), config_for(3, shard_group_size=per_node))
    nodes: list = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, int(os.environ["GROUP_RANK"]))
    group_nodes = sorted({nodes[r] for r in dist.get_process_group_ranks(engine.comm.shard_group)})
    engine.unshard()
    errors = {}
    for stage in (1, 2, 3):
        result = train_against_ddp(stage, "adamw", shard_group_size=per_node)
        errors[stage] = {
            "params": max(result["param_errors"]),
            "losses": result["losses"],
            "reference": result["reference_losses"],
        }
    report = {
        "rank": rank,
        "world_size": dist.get_world_size(),
        "node": nodes[rank],
        "group_nodes": group_nodes,
        "shard_group_size": engine.shard_group_size,
        "errors": errors,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
