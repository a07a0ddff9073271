"""The kept worlds of ``tests/rank_pool.py``: one body's changes, failure or hang never reach the next."""

from __future__ import annotations

import os
import time
import warnings

import pytest
import torch
import torch.distributed as dist

import zero_core
from tests.rank_pool import run_distributed


def _leave_state_behind(rank: int, world_size: int) -> dict:
    """Changes what a careless body might, and reports what it found on arrival."""
    found = {
        "pid": os.getpid(),
        "dtype": torch.get_default_dtype(),
        "env": os.environ.get("ZERO_RANK_POOL_PROBE"),
        "grad": torch.is_grad_enabled(),
        "all_reduce": dist.all_reduce.__name__,
        "config": zero_core.ZeroConfig.__name__,
        "cwd": os.getcwd(),
        "random": torch.rand(1).item(),
        "forward_hooks": len(torch.nn.modules.module._global_forward_hooks),
        "warning_filters": len(warnings.filters),
    }
    torch.set_default_dtype(torch.float64)
    os.environ["ZERO_RANK_POOL_PROBE"] = "left behind"
    torch.set_grad_enabled(False)
    dist.all_reduce = lambda *args, **kwargs: None  # a wrapper left in place
    zero_core.ZeroConfig = None
    os.chdir("/")
    torch.rand(5)
    torch.nn.modules.module.register_module_forward_hook(lambda *args: None)
    warnings.simplefilter("ignore")
    return found


def test_a_body_finds_the_state_its_world_started_with() -> None:
    first = run_distributed(_leave_state_behind, 2)
    second = run_distributed(_leave_state_behind, 2)
    assert [found["pid"] for found in first] == [found["pid"] for found in second], "the world was not kept"
    for before, after in zip(first, second):
        assert after == before
        assert after["dtype"] == torch.float32 and after["env"] is None and after["grad"]
        assert after["all_reduce"] == "all_reduce" and after["config"] == "ZeroConfig"


def _pid(rank: int, world_size: int) -> int:
    return os.getpid()


def _raise_on_rank1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 broke on purpose")
    dist.barrier()  # rank 0 waits for a peer that is gone, as a real failure leaves it


def test_a_raising_body_fails_its_call_only_and_the_next_gets_a_new_world() -> None:
    before = run_distributed(_pid, 2)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 broke on purpose"):
        run_distributed(_raise_on_rank1, 2)
    after = run_distributed(_pid, 2)
    assert set(after).isdisjoint(before), "the broken world was used again"
    assert time.monotonic() - started < 120, "the failure was not cut short"


def _hang_on_rank0(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(3600)


def test_a_hanging_body_is_cut_at_its_timeout() -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0\] of 2 gave no result within 3s"):
        run_distributed(_hang_on_rank0, 2, timeout=3)
    assert time.monotonic() - started < 60
    assert len(run_distributed(_pid, 2)) == 2


def test_a_fresh_world_is_the_bodys_alone() -> None:
    kept = run_distributed(_pid, 2)
    fresh = run_distributed(_pid, 2, fresh=True)
    assert set(fresh).isdisjoint(kept)
    assert run_distributed(_pid, 2) == kept
