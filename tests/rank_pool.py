"""Ranks that outlive a test: kept gloo worlds that run test bodies and return what each rank returned.

Starting a world costs seconds on 2 cores (each process imports torch, Lightning, Accelerate, transformers);
asserting costs far less. So one world of N ranks is started per world size the suite needs and every
``run_distributed(fn, N, ...)`` runs ``fn(rank, N, *args)`` inside it, as PyTorch's
``MultiProcContinuousTest`` and DeepSpeed's ``reuse_dist_env`` do.

What keeps one body from reaching the next:

- Before each body, the process-wide state a body may change is put back as it was when the world started
  (``_ProcessBaseline``: environment, working directory, argv, default dtype, grad and anomaly modes, RNG
  states, warning filters, callables patched on torch, torch's global hooks, our packages' module-level names,
  Accelerate's and transformers' singletons).
- After each body, each rank checks it can take another (process group alive and in step, file descriptors and
  memory within bounds); a rank that cannot ends, and its world is remade for the next call.
- A body that raises fails its own test: its rank reports the traceback and ends, the other ranks get
  ``_FAILURE_GRACE_S`` to report theirs, then the world is killed and remade for the next call. A body that
  hangs is cut at its own ``timeout`` the same way.

A body whose subject is process start or exit (a short process-group timeout, nccl, exit codes) asks for
``fresh=True``: a world of its own, ended after it, with abnormal exits reported.
``ZERO_TEST_FRESH_WORLDS=1`` makes every call fresh, to rule the kept worlds out when chasing a failure.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import dataclasses
import datetime
import gc
import importlib
import itertools
import os
import pickle
import random
import runpy
import socket
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# torch.optim deletes the name of its submodule, so it is reached by import path.
_OPTIMIZER_MODULE = importlib.import_module("torch.optim.optimizer")

# A rank whose body failed waits in a collective for its peers that already ended (gloo's own timeout is 30
# minutes); this long after the first failure the rest are killed, and what they reported so far is shown.
_FAILURE_GRACE_S = 30.0
# How long the ranks may take to agree after a body returned, before the world is judged out of step.
_FIT_CHECK_S = 60.0
# A rank past these after a body ends; its world is remade (a leak must not grow across the whole suite).
_MAX_OPEN_FDS = 600
_MAX_RSS_BYTES = 3 * 2**30
# Every process group a body makes and does not destroy (an engine's hybrid, TP or secondary groups) keeps its
# gloo threads for the life of the process: a kept 4-rank world reached 318 threads (200 gloo run loops, 100
# socket loops) by the end of the distributed tier. Past this many the world is remade.
_MAX_THREADS = 96

# Ranks fork from one server process that imported these once per test session (forkserver), instead of each
# importing them anew (spawn: about 2.5 s per process on 2 cores). The server runs nothing else.
# ZERO_TEST_START_METHOD=spawn goes back to spawning (to rule the server out when chasing a failure).
_PRELOAD = ["torch", "torch.distributed", "zero_core", "lightning_zero", "accelerate_zero", "tests.models"]

# Our packages, whose module-level names a body may rebind (a test's monkeypatch left behind).
_OWN_PACKAGES = ("zero_core", "lightning_zero", "accelerate_zero", "tests")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_context() -> Any:
    """The multiprocessing context ranks (and tests' own processes) start from."""
    method = os.environ.get("ZERO_TEST_START_METHOD", "forkserver")
    context = mp.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload(_PRELOAD)
    return context


# ----------------------------------------------------------------------------------------------------- rank side


class _ProcessBaseline:
    """The process-wide state of a rank as its world started; ``restore()`` puts it back before each body."""

    # Objects whose attributes tests patch (a collective wrapped to count bytes, a function made to fail).
    _PATCHED = (
        torch,
        dist,
        torch.nn.functional,
        torch.autograd,
        torch.Tensor,
        torch.nn.Module,
        torch.optim.Optimizer,
    )
    # torch's process-wide hook registries (``register_module_forward_hook`` and friends).
    _HOOK_REGISTRIES = (
        (torch.nn.modules.module, "_global_forward_hooks"),
        (torch.nn.modules.module, "_global_forward_pre_hooks"),
        (torch.nn.modules.module, "_global_backward_hooks"),
        (torch.nn.modules.module, "_global_backward_pre_hooks"),
        (torch.nn.modules.module, "_global_forward_hooks_always_called"),
        (torch.nn.modules.module, "_global_forward_hooks_with_kwargs"),
        (torch.nn.modules.module, "_global_module_registration_hooks"),
        (torch.nn.modules.module, "_global_parameter_registration_hooks"),
        (torch.nn.modules.module, "_global_buffer_registration_hooks"),
        (_OPTIMIZER_MODULE, "_global_optimizer_pre_hooks"),
        (_OPTIMIZER_MODULE, "_global_optimizer_post_hooks"),
    )

    def __init__(self) -> None:
        self.environment = dict(os.environ)
        self.cwd = os.getcwd()
        self.argv = list(sys.argv)
        self.path = list(sys.path)
        self.default_dtype = torch.get_default_dtype()
        self.grad_enabled = torch.is_grad_enabled()
        self.anomaly = torch.is_anomaly_enabled()
        self.deterministic = torch.are_deterministic_algorithms_enabled()
        self.threads = torch.get_num_threads()
        self.torch_rng = torch.get_rng_state()
        self.python_rng = random.getstate()
        self.warning_filters = list(warnings.filters)
        self.patched = {id(owner): (owner, dict(vars(owner))) for owner in self._PATCHED}
        self.hooks = {
            (module.__name__, name): copy.copy(getattr(module, name))
            for module, name in self._HOOK_REGISTRIES
            if hasattr(module, name)
        }
        self.module_names: dict[str, dict[str, Any]] = {}
        self._learn_new_modules()

    def _learn_new_modules(self) -> None:
        """A module first imported by a body is known from the end of that body on (its state as imported)."""
        for name, module in list(sys.modules.items()):
            if name.startswith(_OWN_PACKAGES) and module is not None and name not in self.module_names:
                self.module_names[name] = dict(vars(module))

    def restore(self) -> None:
        os.environ.clear()
        os.environ.update(self.environment)
        os.chdir(self.cwd)
        sys.argv[:] = self.argv
        sys.path[:] = self.path
        torch.set_default_dtype(self.default_dtype)
        torch.set_grad_enabled(self.grad_enabled)
        torch.set_anomaly_enabled(self.anomaly)
        torch.use_deterministic_algorithms(self.deterministic)
        torch.set_num_threads(self.threads)
        torch.set_rng_state(self.torch_rng)
        random.setstate(self.python_rng)
        warnings.filters[:] = self.warning_filters
        for owner, names in self.patched.values():
            _rebind(owner, names)
        for (module_name, name), saved in self.hooks.items():
            registry = getattr(sys.modules[module_name], name)
            registry.clear()
            registry.update(saved)
        self._learn_new_modules()
        for name, names in self.module_names.items():
            module = sys.modules.get(name)
            if module is not None:
                _rebind(module, names)
        _reset_singletons()
        # What a body left in cycles is freed before the next one; what is still alive then (imports, module
        # caches) is frozen: a full collection walks every tracked object, and a rank that has imported torch,
        # Lightning, Accelerate and transformers holds about half a million (0.2-0.6 s a collection on 2
        # cores, every body's, and every gc.collect() a body makes to count what is alive). A body's own
        # objects, made after the freeze, are collected as before; frozen ones are still freed when their last
        # reference goes, but a cycle among them is not (what a body leaked into a cache that a later body
        # drops: bounded by the world's remake past 3 GiB resident).
        gc.collect()
        gc.freeze()


_MISSING = object()


def _rebind(owner: Any, names: dict[str, Any]) -> None:
    """Names of ``owner`` bound to another object since the baseline are bound back (added names stay: a
    submodule imported since is an attribute of its package)."""
    current = vars(owner)
    for name, value in names.items():
        if name.startswith("__") and name.endswith("__") and not callable(value):
            continue  # __dict__-level bookkeeping (__cached__, __spec__ ...)
        if current.get(name, _MISSING) is not value:
            with contextlib.suppress(AttributeError, TypeError):
                setattr(owner, name, value)


def _reset_singletons() -> None:
    """Process-wide objects of the libraries under test, made by one body and read by the next."""
    if "accelerate.state" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    if "transformers.integrations.deepspeed" in sys.modules:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()


# Set by a body (``retire_this_world``) whose world must not run another: a script that exited non-zero, or
# one that changed what the baseline cannot put back.
_RETIRING: list[str] = []


def retire_this_world(why: str) -> None:
    """Called on a rank from inside a body: this world ends after the body, and the next call gets a new one."""
    _RETIRING.append(why)


def _fit_for_another_body(task_id: int) -> str:
    """Empty if this rank can run another body; else why not."""
    if _RETIRING:
        return f"the body asked for it: {_RETIRING[0]}"
    if not dist.is_initialized():
        return "the body destroyed the process group"
    open_fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0
    if open_fds > _MAX_OPEN_FDS:
        return f"{open_fds} open file descriptors"
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 0
    if threads > _MAX_THREADS:
        return f"{threads} threads (process groups left behind keep theirs)"
    with open("/proc/self/statm") as statm:
        rss = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    if rss > _MAX_RSS_BYTES:
        return f"{rss / 2**30:.1f} GiB resident"
    # All ranks at the same body, and their collectives still matched (a body that left one behind shows here).
    step = torch.tensor([task_id, -task_id], dtype=torch.int64)
    dist.all_reduce(step, op=dist.ReduceOp.MIN)
    if step[0].item() != task_id or -step[1].item() != task_id:
        return f"ranks out of step after body {task_id}: {step.tolist()}"
    return ""


def _rank_main(
    rank: int, world_size: int, port: int, conn: Connection, backend: str, pg_timeout: float | None, kept: bool
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        timeout = datetime.timedelta(seconds=pg_timeout) if pg_timeout else None
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
        baseline = _ProcessBaseline()
    except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
        conn.send_bytes(pickle.dumps((0, False, traceback.format_exc())))
        return
    while True:
        try:
            message = conn.recv_bytes()
        except EOFError:  # the parent is gone
            break
        if not message:  # the parent ends this world
            break
        task_id = -1
        try:
            task_id, fn, args = pickle.loads(message)
            baseline.restore()
            # Plain pickle copies tensors by value; torch's pickling would share them through file
            # descriptors that die with this process.
            reply = (task_id, True, pickle.dumps(fn(rank, world_size, *args)))
        except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
            reply = (task_id, False, traceback.format_exc())
        conn.send_bytes(pickle.dumps(reply))
        if not reply[1] or not kept:  # a fresh world runs one body and exits, its exit code the parent's to check
            break
        try:
            why_not = _fit_for_another_body(task_id)
        except BaseException:  # noqa: BLE001
            why_not = traceback.format_exc()
        conn.send_bytes(pickle.dumps((task_id, "fit", why_not)))
        if why_not:
            break
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------- parent side


class RankWorld:
    """``world_size`` ranks with one process group, each waiting for bodies on its own pipe."""

    def __init__(
        self, world_size: int, backend: str = "gloo", pg_timeout: float | None = None, kept: bool = True
    ) -> None:
        self.world_size = world_size
        self.kept = kept
        context = start_context()
        port = free_port()
        self.connections: list[Connection] = []
        self.processes = []
        for rank in range(world_size):
            parent_end, rank_end = context.Pipe(duplex=True)
            process = context.Process(
                target=_rank_main,
                args=(rank, world_size, port, rank_end, backend, pg_timeout, kept),
                daemon=True,
                name=f"rank {rank} of {world_size}",
            )
            process.start()
            rank_end.close()
            self.connections.append(parent_end)
            self.processes.append(process)
        self._task_ids = itertools.count(1)
        self.usable = True

    def alive(self) -> bool:
        return self.usable and all(process.is_alive() for process in self.processes)

    def run(self, fn: Callable, args: tuple, timeout: float) -> list[Any]:
        """``fn(rank, world_size, *args)`` on every rank; the results by rank, or the first failure raised."""
        task_id = next(self._task_ids)
        message = pickle.dumps((task_id, fn, args))
        try:
            for conn in self.connections:
                conn.send_bytes(message)
        except (BrokenPipeError, ConnectionResetError, OSError):
            self.usable = False
            raise RuntimeError(f"a rank of the world of {self.world_size} was gone before the body started")
        results, failures = self._collect(task_id, timeout)
        if failures or len(results) < self.world_size:
            self.usable = False
            self.close(wait_s=0)
            if failures:
                first = min(failures)
                others = "".join(
                    f"\n--- rank {rank} failed too:\n{failures[rank]}" for rank in sorted(failures) if rank != first
                )
                raise RuntimeError(f"rank {first} of {self.world_size} failed:\n{failures[first]}{others}")
            missing = sorted(set(range(self.world_size)) - set(results))
            raise TimeoutError(f"ranks {missing} of {self.world_size} gave no result within {timeout}s (hang or crash)")
        if self.kept:
            self._check_fit(task_id)
        return [results[rank] for rank in range(self.world_size)]

    def _receive(self, rank: int) -> tuple | None:
        try:
            return pickle.loads(self.connections[rank].recv_bytes())
        except (EOFError, OSError):
            return None

    def _collect(self, task_id: int, timeout: float) -> tuple[dict[int, Any], dict[int, str]]:
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        pending = {conn: rank for rank, conn in enumerate(self.connections)}
        deadline = time.monotonic() + timeout
        first_failure_at = deadline  # read only once a failure has set it
        while pending:
            remaining = deadline - time.monotonic()
            if failures:
                remaining = min(remaining, first_failure_at + _FAILURE_GRACE_S - time.monotonic())
            if remaining <= 0:
                break
            for conn in wait(list(pending), timeout=remaining):
                rank = pending.pop(conn)
                reply = self._receive(rank)
                if reply is None:
                    process = self.processes[rank]
                    process.join(timeout=5)
                    reply = (task_id, False, f"rank {rank} ended without a result (exit code {process.exitcode})")
                _, ok, payload = reply
                if ok:
                    results[rank] = pickle.loads(payload)
                else:
                    if not failures:
                        first_failure_at = time.monotonic()
                    failures[rank] = payload
        return results, failures

    def _check_fit(self, task_id: int) -> None:
        """Every rank said it can take another body, or the world is ended (the result already stands)."""
        deadline = time.monotonic() + _FIT_CHECK_S
        for rank, conn in enumerate(self.connections):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                self.usable = False
                break
            reply = self._receive(rank)
            if reply is None or reply[2]:
                self.usable = False
        if not self.usable:
            self.close(wait_s=0)

    def close(self, wait_s: float = 10.0) -> dict[int, int | None]:
        """End the ranks: asked to within ``wait_s``, then killed. Their exit codes by rank."""
        self.usable = False
        for conn in self.connections:
            with contextlib.suppress(OSError):
                conn.send_bytes(b"")
        deadline = time.monotonic() + wait_s
        for process in self.processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        for conn in self.connections:
            conn.close()
        return {rank: process.exitcode for rank, process in enumerate(self.processes)}


# The kept worlds, one per world size.
_WORLDS: dict[int, RankWorld] = {}


@atexit.register
def _close_kept_worlds() -> None:
    for world in _WORLDS.values():
        world.close(wait_s=5)
    _WORLDS.clear()


def _kept_world(world_size: int) -> RankWorld:
    world = _WORLDS.get(world_size)
    if world is None or not world.alive():
        if world is not None:
            world.close(wait_s=0)
        world = _WORLDS[world_size] = RankWorld(world_size)
    return world


def run_distributed(
    fn: Callable,
    world_size: int,
    *args: Any,
    timeout: float = 300,
    backend: str = "gloo",
    pg_timeout: float | None = None,
    fresh: bool = False,
) -> list[Any]:
    """``fn(rank, world_size, *args)`` on each rank of a gloo world; returns the results by rank.

    ``fn`` is a module-level function (sent by reference). ``timeout``: how long the body may take on every
    rank. ``pg_timeout``: the process group's own timeout in seconds (how long a collective may wait), for tests
    of what happens when ranks diverge; such a world, an nccl one, or ``fresh=True`` is the body's alone, and a
    rank that exits abnormally after returning fails the call (torchrun would report it as a failed job).
    """
    fresh = fresh or pg_timeout is not None or backend != "gloo" or os.environ.get("ZERO_TEST_FRESH_WORLDS") == "1"
    if not fresh:
        return _kept_world(world_size).run(fn, args, timeout)
    world = RankWorld(world_size, backend, pg_timeout, kept=False)
    try:
        results = world.run(fn, args, timeout)
    finally:
        exit_codes = world.close(wait_s=60)
    bad_exits = {rank: code for rank, code in exit_codes.items() if code != 0}
    if bad_exits:
        raise RuntimeError(
            f"ranks returned their results but exited abnormally (rank: exit code, negative = signal): {bad_exits}"
        )
    return results


def run_each(rank: int, world_size: int, workers: dict[str, Callable]) -> dict[str, Any]:
    """Several workers in one body (one process group for a file's cases): their results by name."""
    return {name: worker(rank, world_size) for name, worker in workers.items()}


def by_rank(grid: list[dict[str, Any]], name: str) -> list[Any]:
    """One worker's results from ``run_each``, rank by rank."""
    return [ranked[name] for ranked in grid]


# ------------------------------------------------------------------------------------------ scripts on kept ranks


@dataclasses.dataclass(frozen=True)
class ScriptRun:
    """What one rank's run of a script left: as ``subprocess.CompletedProcess`` has it."""

    returncode: int
    stdout: str
    stderr: str


@contextlib.contextmanager
def _output_captured() -> Any:
    """The process's stdout and stderr (file descriptors 1 and 2: C++ and child output too) into files."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    files = {fd: tempfile.TemporaryFile(mode="w+b") for fd in (1, 2)}
    captured: dict[int, str] = {}
    try:
        for fd, file in files.items():
            os.dup2(file.fileno(), fd)
        yield captured
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, file in files.items():
            os.dup2(saved[fd], fd)
            os.close(saved[fd])
            file.seek(0)
            captured[fd] = file.read().decode(errors="replace")
            file.close()


def run_script_on_rank(
    rank: int, world_size: int, script: str, argv: list[str], env: dict[str, str], cwd: str
) -> ScriptRun:
    """A body: ``script`` run as ``__main__`` on this rank as torchrun would start it (its variables set), in
    this rank's process group. The script's own ``init_process_group`` finds the group made, and its
    ``destroy_process_group`` leaves it for the next body (both put back before the next body)."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
        ROLE_RANK=str(rank),
        ROLE_WORLD_SIZE=str(world_size),
        ROLE_NAME="default",
        OMP_NUM_THREADS="1",
        **env,
    )
    os.chdir(cwd)
    sys.argv[:] = [script, *argv]
    sys.path.insert(0, str(Path(script).parent))
    initialize, destroy = dist.init_process_group, dist.destroy_process_group

    def init_process_group(*args: Any, **kwargs: Any) -> None:
        if not dist.is_initialized():
            initialize(*args, **kwargs)

    def destroy_process_group(group: Any = None) -> None:
        if group is not None and group is not dist.GroupMember.WORLD:
            destroy(group)

    dist.init_process_group, dist.destroy_process_group = init_process_group, destroy_process_group
    returncode = 0
    with _output_captured() as captured:
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exit:
            code = exit.code
            returncode = code if isinstance(code, int) else (0 if code is None else 1)
            if not isinstance(code, int | None):
                print(code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - a script's traceback, as python would print it
            traceback.print_exc()
            returncode = 1
    if returncode != 0:
        retire_this_world(f"{script} exited with {returncode}")
    return ScriptRun(returncode, captured[1], captured[2])


def run_script(
    script: Path | str,
    *argv: str,
    world_size: int,
    env: dict[str, str] | None = None,
    cwd: Path | str | None = None,
    timeout: float = 300,
) -> list[ScriptRun]:
    """``torchrun --nproc_per_node world_size script argv`` without the launch: the script runs on the ranks of
    a kept world (seconds less per run than a new interpreter importing torch and the frameworks). For scripts
    whose subject is not the launcher itself."""
    script = Path(script).resolve()
    return run_distributed(
        run_script_on_rank,
        world_size,
        str(script),
        list(argv),
        dict(env or {}),
        str(Path(cwd or script.parent).resolve()),
        timeout=timeout,
    )
