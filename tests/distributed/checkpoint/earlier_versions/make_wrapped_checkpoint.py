"""Writes ``wrapped-b40a64c/``: a checkpoint saved by the engine at commit b40a64c (2026-12-04), the last one
whose optimizer state kept torch's checkpoint_wrapper prefix in its parameter names. Run from a checkout of
that commit (one process, no process group):

    git worktree add --detach ../old b40a64c && cd ../old
    PYTHONPATH=. python /path/to/make_wrapped_checkpoint.py /path/to/earlier_versions
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from tests.models import SEQ, VOCAB, TinyTransformer, lm_loss, make_optimizer
from tests.workers import config_for
from zero_core import ZeroEngine


def main(out: Path) -> None:
    torch.manual_seed(0)
    model = TinyTransformer(blocks=1, batchnorm=False)
    for index, block in enumerate(model.blocks):
        model.blocks[index] = checkpoint_wrapper(block)
    engine = ZeroEngine(model, make_optimizer("adamw", model), config_for(3))
    for step in range(2):
        ids = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(step))
        engine.backward(lm_loss(model(ids), ids))
        engine.step()
        engine.zero_grad()
    engine.save_checkpoint(out / "wrapped-b40a64c", {"epoch": 1})


if __name__ == "__main__":
    main(Path(sys.argv[1]))
