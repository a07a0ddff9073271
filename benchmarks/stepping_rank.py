"""One rank of a world that trains a step when told to: the other side of ``benchmarks/compare.py``.

compare.py starts it (never by hand) once per rank, with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set
and the tree under test first on PYTHONPATH, so ``zero_core`` is that tree's while the model, the data and
this driver are the same for every tree. The rank builds its contestant once, then answers each line of
its standard input:

    step N   trains step N (its batch depends on N and the rank only) and answers one JSON line:
             {"wall_s": ..., "cpu_s": ..., "loss": ..., "huge_page_bytes": ...}: seconds from a barrier to
             the step's end, this process's own CPU seconds over the same span (every thread), the step's
             loss, and its memory in transparent huge pages after the step
    stop     ends the process (so does the end of its input: a controller that died stops its ranks)

Its first line says which ``zero_core`` it imported, so a tree that was not the one imported is caught.
Anything else the step prints goes to standard error: standard output carries only these lines.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))
sys.path.insert(0, str(HERE))
from contestants import build  # noqa: E402
from gpt import GPT, GPTBlock, next_token_loss, synthetic_batch  # noqa: E402
from harness import SIZES  # noqa: E402
from rank_cores import take_own_cores  # noqa: E402


def huge_page_bytes() -> int:
    """This process's memory in transparent huge pages now (Linux; 0 elsewhere): a process that got fewer of
    them for its long-lived buffers steps slower for its whole life, whatever the code."""
    try:
        text = Path("/proc/self/smaps_rollup").read_text()
    except OSError:
        return 0
    line = next((line for line in text.splitlines() if line.startswith("AnonHugePages:")), "AnonHugePages: 0 kB")
    return int(line.split()[1]) * 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contestant", required=True)
    parser.add_argument("--size", choices=SIZES, required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--pin", type=int, default=1, help="1: this rank's own cores, the same in every world")
    args = parser.parse_args()
    world_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    per_rank = take_own_cores(rank, world_size, bool(args.pin))  # rank r of either side on the same cores
    # The answers get a descriptor of their own; everything else written to standard output (a library's
    # print, a warning routed there) lands on standard error instead of in the protocol.
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    on_gpu = args.device == "cuda"
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    # A peer that died mid-step ends the others' collectives in minutes, not gloo's default half hour.
    dist.init_process_group("nccl" if on_gpu else "gloo", timeout=datetime.timedelta(minutes=10))
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    # As benchmarks/harness.py: the machine's cores split between the ranks (both trees' worlds are alive,
    # but only one steps at a time).
    torch.set_num_threads(per_rank)
    config, batch_size = SIZES[args.size]
    torch.manual_seed(0)
    contestant = build(args.contestant, GPT(config).to(device), GPTBlock, next_token_loss)
    import zero_core

    answers.write(json.dumps({"zero_core": str(Path(zero_core.__file__).resolve().parent)}) + "\n")

    for line in sys.stdin:
        command = line.split()
        if command == ["stop"]:
            break
        if len(command) != 2 or command[0] != "step" or not command[1].isdigit():
            raise SystemExit(f"stepping_rank: expected 'step N' or 'stop', got {line!r}")
        ids = synthetic_batch(config, batch_size, int(command[1]), rank).to(device)
        dist.barrier()
        started_cpu, started = time.process_time(), time.perf_counter()
        loss = contestant.step(ids)
        if on_gpu:
            torch.cuda.synchronize()
        wall, cpu = time.perf_counter() - started, time.process_time() - started_cpu
        answer = {"wall_s": wall, "cpu_s": cpu, "loss": loss, "huge_page_bytes": huge_page_bytes()}
        answers.write(json.dumps(answer) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
