"""Run every benchmark and write a report with its plots.

    python benchmarks/run_all.py [--quick] [--publish] [--no-plots]

By default everything goes to a new folder under benchmarks/out/ (not tracked); ``--publish``
writes the tracked benchmarks/results/, benchmarks/RESULTS.md and the plots beside it.

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
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from contestants import CONTESTANTS  # noqa: E402
from plotting import pyplot  # noqa: E402
from report import write_report  # noqa: E402

OURS = ("zero1", "zero2", "zero3")
BUDGET_BYTES = 512 * 2**20  # per rank, for the largest-model search (medium width, more blocks)
PARAMS_PER_BLOCK, PARAMS_OUTSIDE_BLOCKS = 12 * 512**2 + 9 * 512, 8192 * 512 + 128 * 512 + 2 * 512


DEVICE = "cpu"  # set from --device


class Progress:
    """How far a run is, and about how long the rest takes (at the mean time per run so far)."""

    def __init__(self) -> None:
        self.planned, self.done, self.started = 0, 0, time.monotonic()

    def report(self, name: str, outcome: object) -> None:
        self.done += 1
        elapsed = time.monotonic() - self.started
        left = max(self.planned - self.done, 0) * elapsed / self.done
        print(
            f"[{self.done}/~{max(self.planned, self.done)}] {name}: {outcome} "
            f"({elapsed / 60:.1f} min so far, about {left / 60:.0f} min left)",
            flush=True,
        )


PROGRESS = Progress()


def run(contestant: str, size: str, world_size: int, out_dir: Path, steps: int, depth: int | None = None) -> dict:
    name = f"{size}-{contestant}-w{world_size}" + (f"-d{depth}" if depth else "")
    out = out_dir / f"{name}.json"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(world_size),
        str(HERE / "harness.py"),
        "--contestant",
        contestant,
        "--size",
        size,
        "--steps",
        str(steps),
        "--out",
        str(out),
        "--device",
        DEVICE,
    ]
    if depth:
        command += ["--depth", str(depth)]
    env = {**os.environ, "DS_ACCELERATOR": "cuda" if DEVICE == "cuda" else "cpu", "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0 or not out.exists():
        PROGRESS.report(name, "failed")
        return {"contestant": contestant, "size": size, "world_size": world_size, "failed": result.stderr[-1500:]}
    record = json.loads(out.read_text())
    PROGRESS.report(name, record.get("median_step_s", record.get("skipped")))
    return record


def largest_model(contestant: str, stage_bytes_per_param: float, out_dir: Path) -> dict:
    """The ZeRO paper's Table 2 at our scale: the deepest medium-width model whose
    measured model states fit the budget. Start at the formula's prediction and
    step the depth until the boundary is found (usually two runs)."""
    depth = max(1, int((BUDGET_BYTES / stage_bytes_per_param - PARAMS_OUTSIDE_BLOCKS) // PARAMS_PER_BLOCK))
    fits: dict[int, dict] = {}
    for _ in range(6):
        record = run(contestant, "medium", 2, out_dir, steps=1, depth=depth)
        if "model_state_bytes" not in record:
            return {"contestant": contestant, "failed": record.get("failed", record.get("skipped"))}
        fits[depth] = record
        fit = max(record["model_state_bytes"]) <= BUDGET_BYTES
        neighbour = depth + 1 if fit else depth - 1
        if neighbour in fits or neighbour < 1:
            break
        depth = neighbour
    fitting = [d for d, r in fits.items() if max(r["model_state_bytes"]) <= BUDGET_BYTES]
    best = fits[max(fitting)] if fitting else None
    return {
        "contestant": contestant,
        "budget_bytes": BUDGET_BYTES,
        "probes": {d: max(r["model_state_bytes"]) for d, r in fits.items()},
        "depth": best["depth"] if best else None,
        "numel": best["numel"] if best else None,
    }


def machine() -> dict:
    cpu = (
        next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            platform.processor(),
        )
        if Path("/proc/cpuinfo").exists()
        else platform.processor()
    )
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
    parser.add_argument(
        "--publish",
        action="store_true",
        help="write the tracked results: benchmarks/results/, benchmarks/RESULTS.md and its plots",
    )
    parser.add_argument(
        "--out", default=None, help="the records' folder (default: benchmarks/results with --publish, else a new one)"
    )
    parser.add_argument("--no-plots", action="store_true", help="a report without plots (plots need the 'bench' extra)")
    parser.add_argument(
        "--largest-only", action="store_true", help="only the largest-model search, added to an existing all.json"
    )
    parser.add_argument(
        "--sizes",
        nargs="+",
        choices=("small", "medium", "large"),
        default=None,
        help="model sizes to run at world size 2 (default: all three; --quick: small)",
    )
    parser.add_argument(
        "--contestants",
        nargs="+",
        choices=CONTESTANTS,
        default=CONTESTANTS,
        help="the contestants to run at each size (default: all)",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="replace only these sizes' records in an existing all.json (no scaling or largest-model runs)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: on a GPU machine, NCCL, world size 1 (the only size the lent machine has)",
    )
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    if (args.merge or args.largest_only) and not (args.publish or args.out):
        parser.error("--merge and --largest-only update existing records: add --publish (the tracked ones) or --out")
    if not args.no_plots:
        pyplot()  # a missing matplotlib stops here, not after the runs
    fresh = HERE / "out" / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = Path(args.out) if args.out else HERE / "results" if args.publish else fresh
    out_dir.mkdir(parents=True, exist_ok=True)
    report_path, plot_dir = (HERE / "RESULTS.md", HERE) if args.publish else (out_dir / "RESULTS.md", out_dir)

    def report() -> None:
        write_report(out_dir / "all.json", report_path, plot_dir, plots=not args.no_plots)
        print(f"wrote {report_path}", flush=True)

    if args.largest_only:
        data = json.loads((out_dir / "all.json").read_text())
        data["largest"] = [
            largest_model(c, b, out_dir) for c, b in (("ddp", 16), ("zero1", 12), ("zero2", 10), ("zero3", 8))
        ]
        (out_dir / "all.json").write_text(json.dumps(data, indent=1))
        report()
        return
    steps = 3 if args.quick else 5
    sizes = args.sizes or (["small"] if args.quick else ["small", "medium", "large"])
    records = []
    main_world = 1 if DEVICE == "cuda" else 2
    PROGRESS.planned = len(sizes) * len(args.contestants)
    if DEVICE != "cuda" and not args.merge:
        PROGRESS.planned += 2 * (1 + len(OURS)) + (0 if args.quick else 4 * 2)  # scaling; largest model (~2 each)
    for size in sizes:
        for contestant in args.contestants:
            records.append(run(contestant, size, main_world, out_dir, steps))
    if args.merge and DEVICE != "cuda":
        data = json.loads((out_dir / "all.json").read_text())
        kept = [r for r in data["records"] if not (r.get("size") in sizes and r.get("world_size") == main_world)]
        data["records"] = kept + records
        data.setdefault("machine_by_size", {}).update({size: machine() for size in sizes})
        (out_dir / "all.json").write_text(json.dumps(data, indent=1))
        report()
        return
    if DEVICE == "cuda":
        (out_dir / "all-cuda.json").write_text(json.dumps({"machine": machine(), "records": records}, indent=1))
        print(f"wrote {out_dir / 'all-cuda.json'} (GPU runs are reported as raw records)")
        return
    for world_size in (1, 4):  # scaling; 4 processes on this machine's cores are oversubscribed
        for contestant in ("ddp", *OURS):
            records.append(run(contestant, "small", world_size, out_dir, steps))
    largest = []
    if not args.quick:
        for contestant, bytes_per_param in (("ddp", 16), ("zero1", 12), ("zero2", 10), ("zero3", 8)):
            largest.append(largest_model(contestant, bytes_per_param, out_dir))
    data = {"machine": machine(), "records": records, "largest": largest}
    (out_dir / "all.json").write_text(json.dumps(data, indent=1))
    report()


if __name__ == "__main__":
    main()
