"""The offload tiers beside the in-memory step, with this machine's disk as the NVMe tier's bound.

    python benchmarks/offload.py [--size large] [--steps 3] [--offload-dir DIR] [--publish]
    python benchmarks/offload.py --from-results benchmarks/results/offload [--publish]

Measures the offload directory's write (synced) and read (page cache dropped) bandwidth, then runs
zero1, zero1_cpu, zero1_nvme, zero3, zero3_cpu, zero3_nvme, zero3_params (offload_params="cpu"),
zero3_cpu_params (both), zero3_infinity (both on NVMe), the step during backward, and DeepSpeed's ZeRO-3 in
memory and with its NVMe optimizer offload side by side
(2 ranks, the same machine state), and writes a
table: the median step, the optimizer step alone, the bytes each step moves to and from disk (all
ranks) and the disk bound (those bytes over the measured bandwidth), then our NVMe tiers' step beside
DeepSpeed's. ``--publish`` writes the tracked benchmarks/OFFLOAD.md; otherwise a new folder under
benchmarks/out/. The run's records and its disk measurement (``run.json``) go to the results folder;
``--from-results`` writes the page from those alone, running nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import run_all  # noqa: E402

PAIRS = (
    ("zero1", "zero1_cpu"),
    ("zero1", "zero1_nvme"),
    ("zero3", "zero3_cpu"),
    ("zero3", "zero3_nvme"),
    ("zero3", "zero3_params"),
    ("zero3", "zero3_cpu_params"),
    ("zero1", "zero1_nvme_in_backward"),
    ("zero3", "zero3_nvme_in_backward"),
    ("zero3", "zero3_infinity"),
    ("zero3", "zero3_infinity_in_backward"),
    ("deepspeed3", "deepspeed3_nvme"),
    ("deepspeed3", "deepspeed3_infinity"),
)
PROBE_BYTES = 512 * 2**20
# Ours beside DeepSpeed's on the same tier: (ours, DeepSpeed's).
AGAINST_DEEPSPEED = (
    ("zero3_nvme", "deepspeed3_nvme"),
    ("zero3_nvme_in_backward", "deepspeed3_nvme"),
    ("zero3_infinity", "deepspeed3_infinity"),
    ("zero3_infinity_in_backward", "deepspeed3_infinity"),
)


def disk_bandwidth(directory: Path) -> tuple[float, float]:
    """(write, read) bytes per second of a file in ``directory``: written and synced, then read back
    with its pages dropped from the cache first, as the NVMe tier writes and reads."""
    block = os.urandom(2**20)
    path = directory / f".bandwidth-probe-{os.getpid()}"
    try:
        start = time.perf_counter()
        with open(path, "wb") as file:
            for _ in range(PROBE_BYTES // len(block)):
                file.write(block)
            file.flush()
            os.fdatasync(file.fileno())
        write = PROBE_BYTES / (time.perf_counter() - start)
        with open(path, "rb") as file:
            os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            start = time.perf_counter()
            while file.read(8 * 2**20):
                pass
        read = PROBE_BYTES / (time.perf_counter() - start)
    finally:
        path.unlink(missing_ok=True)
    return write, read


def row(in_memory: dict, offloaded: dict, write_bw: float, read_bw: float) -> str:
    if "failed" in in_memory or "failed" in offloaded:
        failure = in_memory.get("failed") or offloaded.get("failed")
        return f"| {offloaded['contestant']} | failed: {failure[-200:]!r} |"
    ranks = offloaded["world_size"]
    if "infinity" in offloaded["contestant"]:  # ours and DeepSpeed's alike, per element: the fp32 master with
        # Adam's two fp32 moments written and read once, the parameter shard (fp32 here) written after the step
        # and read for the forward's gather and again for backward's.
        written, read = (12 + 4) * offloaded["numel"], (12 + 2 * 4) * offloaded["numel"]
    elif offloaded["breakdown"] is not None:
        breakdown = offloaded["breakdown"]
        written = read = breakdown.get("nvme_bytes_between_steps", breakdown["nvme_bytes"]) * ranks
    else:  # DeepSpeed: its optimizer swapper moves each fp32 partition with its two moments (12 bytes each)
        written = read = 12 * offloaded["numel"] if offloaded["contestant"].endswith("_nvme") else 0
    if offloaded["breakdown"] is not None:
        before = in_memory["breakdown"]["optimizer_state_bytes"] / 2**20
        state = f"{before:.0f} -> {offloaded['breakdown']['optimizer_state_bytes'] / 2**20:.0f} MiB"
    else:
        state = "not reported"
    bound = written / write_bw + read / read_bw
    step, base = offloaded["median_step_s"], in_memory["median_step_s"]
    optimizer = offloaded["phase_median_s"]["optimizer step"]
    base_optimizer = in_memory["phase_median_s"]["optimizer step"]
    return (
        f"| {offloaded['contestant']} | {base:.2f} | {step:.2f} | {base_optimizer:.2f} -> {optimizer:.2f} | "
        f"{written / 2**20:.0f} MiB + {read / 2**20:.0f} MiB | {bound:.2f} | {step / max(base, bound):.2f}x | "
        f"{state} |"
    )


def against_deepspeed(records: dict) -> list[str]:
    """Our NVMe tiers' step time over DeepSpeed's on the same tier (rows whose runs both finished)."""
    lines = ["| ours | DeepSpeed's | ours (s) | DeepSpeed's (s) | ours / DeepSpeed's |", "|---|---|---|---|---|"]
    for ours, theirs in AGAINST_DEEPSPEED:
        a, b = records.get(ours, {}), records.get(theirs, {})
        if "median_step_s" in a and "median_step_s" in b:
            step, base = a["median_step_s"], b["median_step_s"]
            lines.append(f"| {ours} | {theirs} | {step:.2f} | {base:.2f} | {step / base:.2f}x |")
    return lines if len(lines) > 2 else []


def page(run: dict, records: dict) -> str:
    write_bw, read_bw = run["write_bytes_per_s"], run["read_bytes_per_s"]
    lines = [
        "# The offload tiers of the optimizer state, beside the in-memory step",
        "",
        f"{run['date']}, `python benchmarks/offload.py --size {run['size']} --steps {run['steps']}`: "
        f"2 ranks (gloo, CPU), AdamW, fp32. Disk under `{run['offload_dir']}`: {write_bw / 2**20:.0f} MiB/s "
        f"written (synced), {read_bw / 2**20:.0f} MiB/s read (cache dropped).",
        "",
        "| contestant | in memory (s) | offloaded (s) | optimizer step (s) | to + from disk per step | "
        "disk bound (s) | offloaded / max(in memory, bound) | optimizer state in memory per rank |",
        "|---|---|---|---|---|---|---|---|",
        *(row(records[a], records[b], write_bw, read_bw) for a, b in PAIRS if a in records and b in records),
        "",
        "The disk bound counts every rank's bytes against one disk's bandwidth, write then read "
        "(no overlap of the two assumed). On this machine host and device are the same memory: the `_cpu` "
        "rows measure the host step (torch's fused CPU AdamW, which the offloaded step picks where the user "
        "left the kernel to torch; the in-memory rows run torch's default per-tensor loop) and the offload "
        "schedule's overhead. Medians of the timed steps of one run each; this machine's run-to-run noise "
        "is up to 20% (NOTES.md).",
    ]
    compared = against_deepspeed(records)
    if compared:
        lines += [
            "",
            "## Our NVMe tiers beside DeepSpeed's",
            "",
            "DeepSpeed's ZeRO-3 with its NVMe optimizer offload (`DeepSpeedCPUAdam`, its async I/O), and with its "
            "parameters on NVMe too (ZeRO-Infinity), against ours on the same tiers, from the table above:",
            "",
            *compared,
        ]
    return "\n".join(lines) + "\n"


def from_results(directory: Path) -> tuple[dict, dict]:
    """A published run's disk measurement and records, as the run left them."""
    run = json.loads((directory / "run.json").read_text())
    records = {}
    for name in dict.fromkeys(name for pair in PAIRS for name in pair):
        path = directory / f"{run['size']}-{name}-w2.json"
        if path.exists():
            records[name] = json.loads(path.read_text())
    return run, records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="large")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--offload-dir", default=tempfile.gettempdir())
    parser.add_argument("--publish", action="store_true")
    parser.add_argument("--from-results", type=Path, help="write the page from this folder's records; run nothing")
    args = parser.parse_args()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    if args.from_results is not None:
        run, records = from_results(args.from_results)
        out_dir = HERE / "out" / f"offload-{stamp}"
    else:
        # Its own folder: the in-memory records beside the offloaded ones are this run's, not RESULTS.md's.
        out_dir = HERE / "results" / "offload" if args.publish else HERE / "out" / f"offload-{stamp}"
        out_dir.mkdir(parents=True, exist_ok=True)
        os.environ["ZERO_BENCH_OFFLOAD_DIR"] = args.offload_dir
        write_bw, read_bw = disk_bandwidth(Path(args.offload_dir))
        run = {
            "date": str(datetime.date.today()),
            "size": args.size,
            "steps": args.steps,
            "offload_dir": args.offload_dir,
            "write_bytes_per_s": write_bw,
            "read_bytes_per_s": read_bw,
        }
        (out_dir / "run.json").write_text(json.dumps(run, indent=1))
        names = dict.fromkeys(name for pair in PAIRS for name in pair)  # each once, in order
        run_all.PROGRESS.planned = len(names)
        records = {name: run_all.run(name, args.size, 2, out_dir, args.steps) for name in names}
    if not args.publish:
        out_dir.mkdir(parents=True, exist_ok=True)
    target = HERE / "OFFLOAD.md" if args.publish else out_dir / "OFFLOAD.md"
    target.write_text(page(run, records))
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
