"""Checkpoints written by earlier versions of the engine load into this one, exactly.

``earlier_versions/wrapped-b40a64c`` was saved by the engine at commit b40a64c (``make_wrapped_checkpoint.py``
beside it says how): a model whose block is wrapped in torch's ``checkpoint_wrapper``, whose optimizer state
that engine named with the wrapper's ``_checkpoint_wrapped_module.`` prefix (the weights never carried it:
``model.state_dict()`` drops it). Today's engine names the parameters without it, so such a checkpoint must load
with its optimizer state, into the model wrapped as it was or without the wrapper, from the directory (into
memory or the NVMe tier's files) and from its consolidated state, and be written back in today's names. One
process, no process group: the code path every rank takes.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX, checkpoint_wrapper
from torch.distributed.checkpoint import FileSystemReader

from tests.models import SEQ, VOCAB, TinyTransformer, lm_loss, make_optimizer
from tests.workers import config_for
from zero_core import ZeroEngine
from zero_core.checkpoint import load_full_checkpoint

EARLIER_WRAPPED = Path(__file__).parent / "earlier_versions" / "wrapped-b40a64c"


def _engine(wrapped: bool, **settings: Any) -> tuple[TinyTransformer, ZeroEngine]:
    torch.manual_seed(1)  # not the saved run's weights: the load must bring them
    model = TinyTransformer(blocks=1, batchnorm=False)
    if wrapped:
        model.blocks[0] = checkpoint_wrapper(model.blocks[0])
    return model, ZeroEngine(model, make_optimizer("adamw", model), config_for(3, **settings))


def _without_prefix(tree: Any) -> Any:
    """The saved state under today's names: every key and parameter name without the wrapper's prefix."""
    if isinstance(tree, dict):
        return {_without_prefix(key): _without_prefix(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_without_prefix(item) for item in tree]
    return tree.replace(_CHECKPOINT_PREFIX, "") if isinstance(tree, str) else tree


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_the_fixture_holds_the_prefixed_names_it_stands_for() -> None:
    keys = FileSystemReader(str(EARLIER_WRAPPED)).read_metadata().state_dict_metadata
    assert any(key.startswith("optimizer_0.state.") and _CHECKPOINT_PREFIX in key for key in keys)
    assert not any(key.startswith("model.") and _CHECKPOINT_PREFIX in key for key in keys)


@pytest.mark.parametrize("wrapped", [True, False], ids=["wrapped", "unwrapped"])
@pytest.mark.parametrize("source", ["directory", "directory into the NVMe tier", "consolidated"])
def test_an_earlier_checkpoint_with_the_wrapper_prefix_in_its_optimizer_names_loads_exactly(
    tmp_path: Path, wrapped: bool, source: str
) -> None:
    earlier = shutil.copytree(EARLIER_WRAPPED, tmp_path / "earlier")
    saved = load_full_checkpoint(earlier)
    nvme = {"offload_optimizer": "nvme", "offload_dir": str(tmp_path)} if "NVMe" in source else {}
    model, engine = _engine(wrapped, **nvme)
    if source.startswith("directory"):
        extra = engine.load_checkpoint(earlier)
        assert extra == {"epoch": 1}
    else:
        engine.load_full_state_dict(saved["model"], optimizer_state_dict=saved["optimizer_0"])
    engine.save_checkpoint(tmp_path / "now")
    written = load_full_checkpoint(tmp_path / "now")
    for part in ("model", "optimizer_0"):
        assert _same(written[part], _without_prefix(saved[part])), part
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(5))
    engine.backward(lm_loss(model(ids), ids))
    engine.step()  # training goes on from it
