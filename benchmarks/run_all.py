"""Run every benchmark and write benchmarks/RESULTS.md and the plots.

    python benchmarks/run_all.py [--quick]

Each contestant runs in its own ``torchrun`` (gloo, CPU) so its peak memory
is its own; all runs of one invocation share the machine state, so the
ratios to DDP are comparable. ``--quick`` runs the small model only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from contestants import CONTESTANTS  # noqa: E402
from report import write_report  # noqa: E402

OURS = ("zero1", "zero2", "zero3")


def run(contestant: str, size: str, world_size: int, out_dir: Path, steps: int, depth: int | None = None) -> dict:
    name = f"{size}-{contestant}-w{world_size}" + (f"-d{depth}" if depth else "")
    out = out_dir / f"{name}.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world_size),
               str(HERE / "harness.py"), "--contestant", contestant, "--size", size, "--steps", str(steps), "--out", str(out)]
    if depth:
        command += ["--depth", str(depth)]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0 or not out.exists():
        return {"contestant": contestant, "size": size, "world_size": world_size, "failed": result.stderr[-1500:]}
    record = json.loads(out.read_text())
    print(f"{name}: {record.get('median_step_s', record.get('skipped'))}", flush=True)
    return record


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    versions = {"torch": torch.__version__, "python": platform.python_version()}
    for package in ("deepspeed", "lightning-zero"):
        try:
            from importlib.metadata import version

            versions[package] = version(package)
        except Exception:  # noqa: BLE001 - optional
            versions[package] = "not installed"
    return {"cpu": cpu, "cores": os.cpu_count(), "date": datetime.date.today().isoformat(), "versions": versions}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small model only, fewer steps")
    parser.add_argument("--out", default=str(HERE / "results"))
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = 3 if args.quick else 5
    sizes = ["small"] if args.quick else ["small", "medium"]
    records = []
    for size in sizes:
        for contestant in CONTESTANTS:
            records.append(run(contestant, size, 2, out_dir, steps))
    for world_size in (1, 4):  # scaling; 4 processes on this machine's cores are oversubscribed
        for contestant in ("ddp", *OURS):
            records.append(run(contestant, "small", world_size, out_dir, steps))
    (out_dir / "all.json").write_text(json.dumps({"machine": machine(), "records": records}, indent=1))
    write_report(out_dir / "all.json", HERE / "RESULTS.md", HERE)


if __name__ == "__main__":
    main()
