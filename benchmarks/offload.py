"""The offload tiers beside the in-memory step, with this machine's disk as the NVMe tier's bound.

    python benchmarks/offload.py [--size large] [--steps 3] [--offload-dir DIR] [--publish]

Measures the offload directory's write (synced) and read (page cache dropped) bandwidth, then runs
zero1, zero1_cpu, zero1_nvme, zero3, zero3_cpu, zero3_nvme, zero3_params (offload_params="cpu"),
zero3_cpu_params (both), zero3_infinity (both on NVMe), the step during backward, and DeepSpeed's ZeRO-3 in
memory and with its NVMe optimizer offload side by side
(2 ranks, the same machine state), and writes a
table: the median step, the optimizer step alone, the bytes each step moves to and from disk (all
ranks) and the disk bound (those bytes over the measured bandwidth). ``--publish`` writes the tracked
benchmarks/OFFLOAD.md; otherwise a new folder under benchmarks/out/.
"""

from __future__ import annotations

import argparse
import datetime
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="large")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--offload-dir", default=tempfile.gettempdir())
    parser.add_argument("--publish", action="store_true")
    args = parser.parse_args()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    # Its own folder: the in-memory records beside the offloaded ones are this run's, not RESULTS.md's.
    out_dir = HERE / "results" / "offload" if args.publish else HERE / "out" / f"offload-{stamp}"
    out_dir.mkdir(parents=True, exist_ok=True)
    os.environ["ZERO_BENCH_OFFLOAD_DIR"] = args.offload_dir
    write_bw, read_bw = disk_bandwidth(Path(args.offload_dir))
    names = dict.fromkeys(name for pair in PAIRS for name in pair)  # each once, in order
    run_all.PROGRESS.planned = len(names)
    records = {name: run_all.run(name, args.size, 2, out_dir, args.steps) for name in names}
    lines = [
        "# The offload tiers of the optimizer state, beside the in-memory step",
        "",
        f"{datetime.date.today()}, `python benchmarks/offload.py --size {args.size} --steps {args.steps}`: "
        f"2 ranks (gloo, CPU), AdamW, fp32. Disk under `{args.offload_dir}`: {write_bw / 2**20:.0f} MiB/s "
        f"written (synced), {read_bw / 2**20:.0f} MiB/s read (cache dropped).",
        "",
        "| contestant | in memory (s) | offloaded (s) | optimizer step (s) | to + from disk per step | "
        "disk bound (s) | offloaded / max(in memory, bound) | optimizer state in memory per rank |",
        "|---|---|---|---|---|---|---|---|",
        *(row(records[a], records[b], write_bw, read_bw) for a, b in PAIRS),
        "",
        "The disk bound counts every rank's bytes against one disk's bandwidth, write then read "
        "(no overlap of the two assumed). On this machine host and device are the same memory: the `_cpu` "
        "rows measure the host step (torch's fused CPU AdamW, which the offloaded step picks where the user "
        "left the kernel to torch; the in-memory rows run torch's default per-tensor loop) and the offload "
        "schedule's overhead. Medians of the timed steps of one run each; this machine's run-to-run noise "
        "is up to 20% (NOTES.md).",
    ]
    target = HERE / "OFFLOAD.md" if args.publish else out_dir / "OFFLOAD.md"
    target.write_text("\n".join(lines) + "\n")
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
