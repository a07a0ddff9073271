"""The corpus configs a script with its own optimizer brings (DeepSpeed's tutorials, Lightning's presets), each
given unedited to ``ZeroStrategy(config=file)`` under Lightning's Trainer, and trained beside the reference: DeepSpeed
itself on the same file where it runs on this CPU (no offload), else the same settings written as keyword arguments.
Rank 0 writes OUT/<file stem>.json with both runs' losses and final full weights.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 tests/scripts/deepspeed_corpus_lightning.py OUT CONFIG [CONFIG ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.scripts.deepspeed_same_config import MICRO_BATCH, deepspeed_run, ours  # noqa: E402

# What each offloading config means, written as our settings (DeepSpeed's offload needs its compiled CPU Adam).
NATIVE = {
    "deepspeed_tutorial_zero_infinity_cpu": dict(
        stage=3,
        offload_optimizer="cpu",
        offload_params="cpu",
        prefetch="auto",
        prefetch_cap_mb=1e7 * 4 / 2**20,
        persistence_threshold=100000,
    ),  # fmt: skip
    "lightning_deepspeed_stage_3_offload": dict(stage=3, offload_optimizer="cpu", offload_params="cpu"),
    "lightning_deepspeed_stage_3_offload_nvme": dict(
        stage=3, offload_optimizer="nvme", offload_params="nvme", offload_dir="/local_nvme"
    ),
}


def lightning_handed(config: dict) -> dict:
    """The file as Lightning's DeepSpeed strategy hands it to DeepSpeed's engine: the micro-batch size from the
    DataLoader, and ``gradient_clipping`` from Trainer(gradient_clip_val) where the file has none (0: DeepSpeed
    0.19 would otherwise clip at 1.0)."""
    return {"gradient_clipping": 0.0, **config, "train_micro_batch_size_per_gpu": MICRO_BATCH}


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    import deepspeed

    deepspeed.init_distributed("gloo")
    for path in map(Path, sys.argv[2:]):
        if path.stem in NATIVE:
            reference, weights = ours(None, "32-true", accumulate=1, **NATIVE[path.stem])
        else:
            reference, weights = deepspeed_run(lightning_handed(json.loads(path.read_text())))
        losses, our_weights = ours(path, "32-true", accumulate=1)
        if torch.distributed.get_rank() == 0:
            report = {
                "reference": reference,
                "ours": losses,
                "weights": {k: (v.flatten().tolist(), our_weights[k].flatten().tolist()) for k, v in weights.items()},
            }
            (out / f"{path.stem}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
