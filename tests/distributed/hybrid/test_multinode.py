"""A two-node run simulated on one machine: each "node" is its own launch of 2
processes, joined by torch's rendezvous, with one shard group per node
(``shard_group_size=2``), through torchrun, the Lightning Trainer
(``num_nodes=2``) and ``accelerate launch --num_machines 2``; each matches DDP.
These are the launches docs/multi-node.md gives as the multi-node recipe."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.paths import ROOT, TESTS
from tests.rank_pool import free_port
from tests.workers import relative_difference

SCRIPTS = TESTS / "scripts"
REPO = ROOT
NODES, PER_NODE = 2, 2


def _run_nodes(commands: list[list[str]], envs: list[dict[str, str]], out: Path, timeout: float = 300) -> None:
    """Start every node's launch side by side and wait for all; a node that fails or hangs fails the test.
    Why a process of its own: the launchers' multi-node settings (`--nnodes`, `--node_rank`, `--num_machines`) are
    the subject."""
    processes = []
    for node, (command, env) in enumerate(zip(commands, envs)):
        log = open(out / f"node{node}.log", "w")
        # ZeRO settings of Accelerate come from the launcher (or the test), never from this shell.
        inherited = {
            k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_ZERO_", "ACCELERATE_USE_ZERO"))
        }
        environment = {**inherited, "PYTHONPATH": str(REPO), **env}
        processes.append(
            (subprocess.Popen(command, env=environment, stdout=log, stderr=subprocess.STDOUT, cwd=REPO), log)
        )
    failed = []
    for node, (process, log) in enumerate(processes):
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            code = "timed out"
        log.close()
        if code != 0:
            failed.append(f"node {node}: {code}\n{(out / f'node{node}.log').read_text()[-4000:]}")
    for process, _ in processes:
        if process.poll() is None:
            process.kill()
    assert not failed, "\n".join(failed)


@pytest.fixture(scope="module")
def lightning_nodes(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The two nodes of ``test_lightning_num_nodes_two_matches_ddp`` (where that test is selected), started in the
    background beside torchrun's two: each keeps about one of two cores busy while its processes import."""
    selected = {getattr(item, "originalname", None) for item in request.session.items if item.module is request.module}
    if "test_lightning_num_nodes_two_matches_ddp" not in selected:
        yield None
        return
    out = tmp_path_factory.mktemp("lightning-nodes")
    common = dict(max_steps=4, num_nodes=NODES, batchnorm=False, accumulate=2, clip=0.5)
    runs = [
        {"name": "ddp", "strategy": "ddp_find_unused_parameters_true", **common},
        {"name": "zero3-hybrid", "strategy": "zero3", "shard_group_size": PER_NODE, **common},
    ]
    spec = out / "runs.json"
    spec.write_text(json.dumps(runs))
    port = str(free_port())
    command = [sys.executable, str(SCRIPTS / "lightning_runs.py"), str(spec), str(out), str(PER_NODE)]
    envs = [{"NODE_RANK": str(node), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port} for node in range(NODES)]
    with ThreadPoolExecutor(max_workers=1) as background:
        yield out, background.submit(_run_nodes, [command] * NODES, envs, out)


@pytest.mark.usefixtures("lightning_nodes")  # starts the next test's nodes, to run beside these
def test_torchrun_two_nodes_one_shard_group_per_node(tmp_path: Path) -> None:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(NODES),
        "--nproc-per-node",
        str(PER_NODE),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"localhost:{port}",
        "--rdzv-id",
        "zero-multinode",
        str(SCRIPTS / "multinode_train.py"),
        str(tmp_path),
    ]
    _run_nodes([command] * NODES, [{}] * NODES, tmp_path)
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(NODES * PER_NODE)]
    for report in reports:
        assert report["world_size"] == NODES * PER_NODE and report["shard_group_size"] == PER_NODE
        assert report["group_nodes"] == [report["node"]], "a shard group spans nodes"
        for stage, errors in report["errors"].items():
            assert errors["params"] <= 1e-5, f"rank {report['rank']} stage {stage}"
            assert errors["losses"] == pytest.approx(errors["reference"], rel=1e-5)
    assert {report["node"] for report in reports} == set(range(NODES))


def test_lightning_num_nodes_two_matches_ddp(lightning_nodes: Any) -> None:
    assert lightning_nodes is not None
    tmp_path, nodes = lightning_nodes
    nodes.result()  # the nodes' own failure, if one failed or hung
    reference = torch.load(tmp_path / "ddp.pt", weights_only=False)
    ours = torch.load(tmp_path / "zero3-hybrid.pt", weights_only=False)
    assert ours["world_size"] == NODES * PER_NODE and ours["shard_group_size"] == PER_NODE
    assert len(ours["losses"]) == 8  # 4 steps of 2 micro-batches
    assert ours["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert relative_difference(ours["weights"], reference["weights"]) <= 1e-5


def test_accelerate_num_machines_two_matches_one_process(tmp_path: Path) -> None:
    """The reference is one process on the global batch (2 per process x 4 = 8): the
    same gradients, since Accelerate deals a data loader's batches out to the processes."""
    accelerate_script = str(SCRIPTS / "accelerate_train.py")
    args = ["--accumulate", "2", "--clip", "0.5", "--batchnorm", "0", "--scheduler", "0"]
    env = {"ACCELERATE_USE_CPU": "1"}
    config = tmp_path / "zero.yaml"
    config.write_text(f"stage: 3\nwrap_classes: [Block]\nshard_group_size: {PER_NODE}\n")
    port = str(free_port())
    commands = [
        [
            sys.executable,
            "-m",
            "accelerate_zero.launch",
            "launch",
            "--zero_config_file",
            str(config),
            "--multi_gpu",
            "--num_machines",
            str(NODES),
            "--machine_rank",
            str(node),
            "--main_process_ip",
            "127.0.0.1",
            "--main_process_port",
            port,
            "--num_processes",
            str(NODES * PER_NODE),
            accelerate_script,
            str(tmp_path),
            "hybrid",
            "--batch-size",
            "2",
            *args,
        ]
        for node in range(NODES)
    ]
    # The reference runs beside the two machines: one plain process, as `accelerate launch
    # --num_processes 1` would start it.
    one = [sys.executable, accelerate_script, str(tmp_path), "one", "--batch-size", "8", *args]
    _run_nodes([*commands, one], [env] * (NODES + 1), tmp_path)
    reference = torch.load(tmp_path / "one.pt", weights_only=False)
    ours = torch.load(tmp_path / "hybrid.pt", weights_only=False)
    assert ours["accelerator"] == "ZeroAccelerator" and ours["num_processes"] == NODES * PER_NODE
    assert ours["shard_group_size"] == PER_NODE
    assert len(ours["losses"]) == 12  # 6 steps of 2 micro-batches
    assert ours["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert relative_difference(ours["weights"], reference["weights"]) <= 1e-5
