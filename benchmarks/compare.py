"""The guard: this tree's training step against another revision's (or one contestant against another), with
an interval narrow enough to tell a 5% slip from noise.

    python benchmarks/compare.py --baseline REV [--contestants zero2 zero3] [--rounds 2 --pairs 8] [--publish]
    python benchmarks/compare.py --reference ddp --contestants zero1 zero2 zero3
    python benchmarks/compare.py --pool OUT1/record.json OUT2/record.json [--publish]

Why steps, not runs: this machine drifts by 10-30% over minutes (DDP went 6.7 -> 8.4 s in 40 minutes), so two
runs minutes apart differ by more than the changes we want to see. Here both sides are alive at once, each a
world of ranks built once (``benchmarks/stepping_rank.py``), and they take turns a step at a time in the order
A B B A A B ..., on the same batch at the same step: each pair of adjacent steps shares the machine's state
of that moment, and its ratio is the measurement. Both sides are started afresh for each of ``--rounds``
rounds: a process can be slow or fast for its whole life (its memory's placement), and only new processes
show it. The estimate is the geometric mean of the pairs' ratios with a 95% bootstrap interval that draws
rounds, then pairs; the processes' own CPU time is measured beside the wall time (a ratio in CPU time
that moves with the wall ratio is work; one that does not is waiting), and so is the CPU the rest of the
machine used meanwhile. Before the first step it waits for a quiet machine.

``--baseline REV`` checks REV out in a temporary ``git worktree`` and puts it first on the baseline ranks'
PYTHONPATH: the packages under test are REV's, while the model, the data, the contestants and this driver are
this tree's, the same for both sides. The losses of both sides are compared step by step too: a change meant
to keep the numbers must show 0.

Both sides' worlds are alive at once: at the default size (the 168M model) that is about 10 GB of memory.
Results print as a table; ``--publish`` adds the record to benchmarks/results/compare/ and regenerates
benchmarks/COMPARE.md from every record there, newest first (``--table`` only regenerates it).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import queue
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from contestants import CONTESTANTS, MUON_CONTESTANTS, OFFLOAD_CONTESTANTS, STAGE_OF  # noqa: E402
from run_all import machine  # noqa: E402

RECORDS = HERE / "results" / "compare"
TABLE = HERE / "COMPARE.md"
STEP_TIMEOUT_S = 900  # one step of the largest model takes seconds; a rank silent this long has hung
START_TIMEOUT_S = 600  # building the 168M model and its engine


# ------------------------------------------------------------------ statistics
def abba_order(pairs: int) -> list[tuple[int, int]]:
    """The sides' order for each pair: (0, 1), (1, 0), (0, 1), ... A B B A A B: a drift within a pair
    favours each side equally often."""
    return [(0, 1) if index % 2 == 0 else (1, 0) for index in range(pairs)]


@dataclass(frozen=True)
class RatioEstimate:
    """The geometric mean of per-pair ratios, with a 95% bootstrap interval and the pairs' extremes."""

    ratio: float
    low: float
    high: float
    smallest: float
    largest: float
    pairs: int

    def __str__(self) -> str:
        return f"{self.ratio:.3f} [{self.low:.3f}, {self.high:.3f}]"


def ratio_estimate(rounds: list[list[float]], resamples: int = 4000, seed: int = 0) -> RatioEstimate:
    """Ratios multiply, so their logs are averaged. ``rounds``: the pairs' ratios of each round (each round
    a fresh start of both sides' processes). The interval is the 2.5th and 97.5th percentiles of the
    geometric means of ``resamples`` two-stage resamples (rounds, then pairs within each drawn round): a
    process that was slow or fast for the whole of its life widens it, as it should, instead of passing for
    a difference between the sides. No distribution is assumed; the same seed gives the same interval."""
    ratios = [r for pairs in rounds for r in pairs]
    if not ratios or any(not pairs for pairs in rounds) or any(not (r > 0 and math.isfinite(r)) for r in ratios):
        raise ValueError(f"ratios must be positive and finite, in rounds of at least one pair, got {rounds}")
    logs = [[math.log(r) for r in pairs] for pairs in rounds]
    draw = random.Random(seed)
    means = []
    for _ in range(resamples):
        drawn = [draw.choices(pairs, k=len(pairs)) for pairs in draw.choices(logs, k=len(logs))]
        means.append(statistics.fmean(value for pairs in drawn for value in pairs))
    means.sort()
    low, high = means[int(0.025 * (resamples - 1))], means[int(0.975 * (resamples - 1))]
    pooled = statistics.fmean(value for pairs in logs for value in pairs)
    return RatioEstimate(math.exp(pooled), math.exp(low), math.exp(high), min(ratios), max(ratios), len(ratios))


# ------------------------------------------------------------------ the machine
def busy_cpu_seconds() -> float:
    """CPU seconds every process on the machine has used since boot (all cores; /proc/stat)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def wait_for_quiet(max_busy_cores: float, max_wait_s: float, sample_s: float = 5.0) -> float:
    """Waits until the machine, before anything of ours runs, keeps fewer than ``max_busy_cores`` cores busy
    over ``sample_s``; gives up after ``max_wait_s`` (then says so) and returns the last busy figure."""
    deadline = time.monotonic() + max_wait_s
    while True:
        before = busy_cpu_seconds()
        time.sleep(sample_s)
        busy = (busy_cpu_seconds() - before) / sample_s
        if busy < max_busy_cores:
            print(f"the machine is quiet: {busy:.2f} cores busy", flush=True)
            return busy
        if time.monotonic() >= deadline:
            print(
                f"warning: the machine stayed busy ({busy:.2f} cores for {max_wait_s:.0f} s); measuring anyway, "
                "and the table says so",
                flush=True,
            )
            return busy
        print(f"waiting for a quiet machine: {busy:.2f} cores busy (limit {max_busy_cores})", flush=True)


# ------------------------------------------------------------------ trees and worlds
def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


# What the guard itself writes: a published record changes the table, and must not make the next run of the
# same question a question about another tree (its records could then not be pooled).
GUARD_OUTPUTS = ("benchmarks/COMPARE.md", "benchmarks/results")


def describe_checkout(tree: Path = ROOT) -> str:
    """The checkout's commit, marked where its tracked files differ from it (the guard's own outputs aside)."""
    outputs = [f":(exclude){path}" for path in GUARD_OUTPUTS]
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", *outputs, cwd=tree)
    return git("rev-parse", "--short", "HEAD", cwd=tree) + ("+changes" if changed else "")


@contextlib.contextmanager
def worktree_of(revision: str) -> Iterator[tuple[Path, str]]:
    """REV checked out in a temporary worktree (removed on the way out, whatever happens)."""
    try:
        commit = git("rev-parse", "--short", f"{revision}^{{commit}}")
    except subprocess.CalledProcessError as error:
        raise SystemExit(f"compare.py: {revision!r} is not a revision of this repository ({error.stderr.strip()})")
    folder = Path(tempfile.mkdtemp(prefix=f"compare-{commit}-"))
    git("worktree", "add", "--detach", str(folder), commit)
    try:
        yield folder, commit
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(folder)], cwd=ROOT, capture_output=True)


@dataclass(frozen=True)
class Side:
    """What one side runs: a contestant, with the packages of a tree."""

    label: str  # "baseline", "this tree", or the contestant's name
    tree: Path
    revision: str
    contestant: str


@dataclass(frozen=True)
class StepSettings:
    """How every world of one comparison is run and measured."""

    size: str  # benchmarks/harness.py's model sizes
    world_size: int
    device: str
    rounds: int  # fresh starts of both sides
    pairs: int  # per round
    warmup: int  # untimed steps per side, each round
    pin: bool  # rank r of each side on the same cores
    logs: Path  # the ranks' standard error


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class SteppingWorld:
    """The ranks of one side, started once; ``step(n)`` trains step n on every rank and returns their answers.

    A rank that exits, writes what is not an answer, or stays silent past the timeout ends the comparison
    with its standard error's tail (the ranks' standard error goes to a log file, so a talkative rank never
    blocks on a full pipe); ``close`` stops every rank, by signal if it must."""

    def __init__(self, side: Side, settings: StepSettings) -> None:
        self.side = side
        world_size, device = settings.world_size, settings.device
        name = f"{side.label.replace(' ', '-')}-{side.contestant}"
        self.log_paths = [settings.logs / f"{name}-rank{r}.log" for r in range(world_size)]
        port = free_port()
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(side.tree), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "DS_ACCELERATOR": "cuda" if device == "cuda" else "cpu",
            "PYTHONWARNINGS": "ignore",
        }
        self.ranks: list[subprocess.Popen] = []
        self.answers: list[queue.Queue] = []
        try:
            self._start(settings, env)
        except BaseException:  # a rank that failed to start (or Ctrl-C) must not leave its peers waiting
            self.close()
            raise

    def _start(self, settings: StepSettings, env: dict[str, str]) -> None:
        side, device = self.side, settings.device
        for rank in range(settings.world_size):
            log = self.log_paths[rank].open("w")
            process = subprocess.Popen(
                [sys.executable, str(HERE / "stepping_rank.py"), "--contestant", side.contestant]
                + ["--size", settings.size, "--device", device, "--pin", str(int(settings.pin))],
                env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                start_new_session=True,  # close() signals the rank and whatever it started
            )
            log.close()
            lines: queue.Queue = queue.Queue()
            threading.Thread(target=self._read, args=(process, lines), daemon=True).start()
            self.ranks.append(process)
            self.answers.append(lines)
        hello = self._collect(START_TIMEOUT_S, "starting")
        imported = {Path(h["zero_core"]) for h in hello}
        expected = (side.tree / "zero_core").resolve()
        if imported != {expected}:
            raise RuntimeError(
                f"{side.label}: the ranks imported zero_core from {sorted(map(str, imported))}, not {expected}: "
                "something ahead of PYTHONPATH on sys.path (a .pth file?) shadows the tree under test"
            )

    @staticmethod
    def _read(process: subprocess.Popen, lines: queue.Queue) -> None:
        for line in process.stdout:
            lines.put(line)
        lines.put(None)  # the rank's output ended: it exited

    def _collect(self, timeout_s: float, doing: str) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        answers = []
        for rank, lines in enumerate(self.answers):
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(self._failure(rank, f"was silent for {timeout_s:.0f} s while {doing}")) from None
            if line is None:
                code = self.ranks[rank].wait()
                raise RuntimeError(self._failure(rank, f"exited with code {code} while {doing}"))
            try:
                answers.append(json.loads(line))
            except json.JSONDecodeError:
                raise RuntimeError(self._failure(rank, f"answered {line!r} while {doing}")) from None
        return answers

    def _failure(self, rank: int, what: str) -> str:
        tail = self.log_paths[rank].read_text(errors="replace")[-3000:]
        return f"{self.side.label} ({self.side.contestant}), rank {rank} {what}; its standard error ends:\n{tail}"

    def step(self, index: int) -> list[dict]:
        for process in self.ranks:
            process.stdin.write(f"step {index}\n")
            process.stdin.flush()
        return self._collect(STEP_TIMEOUT_S, f"training step {index}")

    def close(self) -> None:
        for process in self.ranks:
            with contextlib.suppress(OSError, ValueError):
                process.stdin.write("stop\n")
                process.stdin.close()
        deadline = time.monotonic() + 30
        for process in self.ranks:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()


# ------------------------------------------------------------------ one comparison
@dataclass
class StepRecord:
    wall_s: list[float] = field(default_factory=list)  # the slowest rank's, per step
    cpu_s: list[float] = field(default_factory=list)  # every rank's together, per step
    losses: list[list[float]] = field(default_factory=list)  # [step][rank]
    huge_page_bytes: list[int] = field(default_factory=list)  # every rank's together, per step


def _one_round(
    sides: tuple[Side, Side], settings: StepSettings, first: int
) -> tuple[tuple[StepRecord, StepRecord], list[float]]:
    """Both sides started (side ``first`` first), the warm-up steps, then the pairs in A B B A order; every rank
    stopped at the end, whatever happens."""
    pairs, warmup = settings.pairs, settings.warmup
    worlds: dict[int, SteppingWorld] = {}
    steps = (StepRecord(), StepRecord())
    others_cores = []  # the cores the rest of the machine kept busy during each step
    try:
        for which in (first, 1 - first):
            worlds[which] = SteppingWorld(sides[which], settings)
        for index in range(warmup):
            for which in (0, 1):
                worlds[which].step(index)
        for pair, order in enumerate(abba_order(pairs)):
            index = warmup + pair  # the same batch for both sides of a pair
            for which in order:
                busy_before = busy_cpu_seconds()
                answers = worlds[which].step(index)
                busy = busy_cpu_seconds() - busy_before
                wall, cpu = max(a["wall_s"] for a in answers), sum(a["cpu_s"] for a in answers)
                steps[which].wall_s.append(wall)
                steps[which].cpu_s.append(cpu)
                steps[which].losses.append([a["loss"] for a in answers])
                steps[which].huge_page_bytes.append(sum(a["huge_page_bytes"] for a in answers))
                others_cores.append(max(0.0, busy - cpu) / wall)
            print(
                f"  pair {pair + 1}/{pairs}: {sides[0].label} {steps[0].wall_s[-1]:.3f} s, "
                f"{sides[1].label} {steps[1].wall_s[-1]:.3f} s",
                flush=True,
            )
    finally:
        for world in worlds.values():
            world.close()
    return steps, others_cores


def compare_sides(sides: tuple[Side, Side], settings: StepSettings) -> dict:
    """The rounds of :func:`_one_round` (which side starts first alternates); the second side over the first,
    per pair, pooled with the rounds kept apart for the interval."""
    rounds = settings.rounds
    wall_rounds, cpu_rounds, round_ratios, others_cores = [], [], [], []
    round_huge_pages_mib: list[list[float]] = []  # [round][side]: the ranks' memory in huge pages
    base, other = StepRecord(), StepRecord()
    for number in range(rounds):
        print(f"  round {number + 1}/{rounds}", flush=True)
        (b, o), others = _one_round(sides, settings, first=number % 2)
        wall_rounds.append([x / y for x, y in zip(o.wall_s, b.wall_s)])
        cpu_rounds.append([x / y for x, y in zip(o.cpu_s, b.cpu_s)])
        round_ratios.append(math.exp(statistics.fmean(math.log(r) for r in wall_rounds[-1])))
        huge = [statistics.median(part.huge_page_bytes) / 2**20 for part in (b, o)]
        round_huge_pages_mib.append(huge)
        print(
            f"  round {number + 1}: ratio {round_ratios[-1]:.3f}, huge pages {huge[0]:.0f} / {huge[1]:.0f} MiB",
            flush=True,
        )
        for record, part in ((base, b), (other, o)):
            record.wall_s += part.wall_s
            record.cpu_s += part.cpu_s
            record.losses += part.losses
        others_cores += others
    wall, cpu = ratio_estimate(wall_rounds), ratio_estimate(cpu_rounds)
    loss_gap = max(abs(o - b) for os_, bs in zip(other.losses, base.losses) for o, b in zip(os_, bs))
    return {
        "sides": [vars(side) | {"tree": str(side.tree)} for side in sides],
        "wall": vars(wall),
        "cpu": vars(cpu),
        "round_ratios": round_ratios,
        "wall_rounds": wall_rounds,  # every pair's ratio, by round: records of one question can be pooled later
        "cpu_rounds": cpu_rounds,
        "round_huge_pages_mib": round_huge_pages_mib,
        "median_wall_s": [statistics.median(base.wall_s), statistics.median(other.wall_s)],
        "median_cpu_s": [statistics.median(base.cpu_s), statistics.median(other.cpu_s)],
        "largest_loss_difference": loss_gap,
        "others_cores_mean": statistics.fmean(others_cores),
    }


def pooled_record(records: list[dict]) -> dict:
    """Records of one question (the same heading: the same two trees, or the same reference in one tree; the
    same model, world size, pairs and warm-up, on the same kind of machine) as one record: every round of each
    contestant, the estimate drawn again from all of them. Rounds are the noise's unit, so more of them narrow
    the interval however many runs they came from; each round's pairs stay side by side in time, so pooling
    adds no drift. Runs on another processor are another question: a change can cost more on one than on the
    other, so they are refused rather than averaged in."""
    keys = ("heading", "size", "world_size", "device", "pairs", "warmup", "pinned", "machine")
    question = {key: records[0][key] for key in keys}
    for record in records[1:]:
        differ = [key for key in keys if record[key] != question[key]]
        if differ:
            raise ValueError(f"records of different questions cannot be pooled: they differ in {differ}")
    comparisons = []
    for name in dict.fromkeys(row["name"] for record in records for row in record["comparisons"]):
        rows = [row for record in records for row in record["comparisons"] if row["name"] == name]
        if any("failed" in row for row in rows):
            comparisons.append({"name": name, "failed": next(row["failed"] for row in rows if "failed" in row)})
            continue
        wall_rounds = [pairs for row in rows for pairs in row["wall_rounds"]]
        cpu_rounds = [pairs for row in rows for pairs in row["cpu_rounds"]]
        comparisons.append(
            {
                "name": name,
                "wall": vars(ratio_estimate(wall_rounds)),
                "cpu": vars(ratio_estimate(cpu_rounds)),
                "round_ratios": [ratio for row in rows for ratio in row["round_ratios"]],
                "wall_rounds": wall_rounds,
                "cpu_rounds": cpu_rounds,
                "median_wall_s": [statistics.median(row["median_wall_s"][side] for row in rows) for side in (0, 1)],
                "median_cpu_s": [statistics.median(row["median_cpu_s"][side] for row in rows) for side in (0, 1)],
                "largest_loss_difference": max(row["largest_loss_difference"] for row in rows),
                "others_cores_mean": statistics.fmean(row["others_cores_mean"] for row in rows),
            }
        )
    return {
        **question,
        "heading": f"{question['heading']}, {len(records)} runs pooled",
        "date": max(record["date"] for record in records),
        "machine": records[0]["machine"],
        "rounds": sum(record["rounds"] for record in records),
        "busy_before": max(record["busy_before"] for record in records),
        "comparisons": comparisons,
        "pooled_from": [record["date"] for record in records],
    }


# ------------------------------------------------------------------ the table
def table_lines(record: dict) -> list[str]:
    """One record's table: a row per comparison."""
    head = record["heading"]
    lines = [
        f"### {head}",
        "",
        f"{record['date']}, {record['machine']}; model `{record['size']}`, world size {record['world_size']}, "
        f"{record.get('rounds', 1)} round(s) of {record['pairs']} pairs, each after {record['warmup']} warm-up "
        f"steps, {'each rank on its own cores' if record.get('pinned', True) else 'the ranks placed by the scheduler'}"
        f"; the machine before: {record['busy_before']:.2f} cores busy.",
        *(
            [
                "",
                "One round (one process per rank and side): the interval leaves out how fast each process happened "
                "to be for its whole life, about ±7% here; read it as a lower bound of the uncertainty.",
            ]
            if record.get("rounds", 1) == 1
            else []
        ),
        "",
        "| contestant | second / first (wall) | rounds | pairs' range | CPU ratio | median step s (first, second) "
        "| largest loss difference | others' cores |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in record["comparisons"]:
        if "failed" in row:
            lines.append(f"| {row['name']} | failed: {row['failed'].splitlines()[0]} | | | | | | |")
            continue
        wall, cpu = RatioEstimate(**row["wall"]), RatioEstimate(**row["cpu"])
        first, second = row["median_wall_s"]
        rounds = ", ".join(f"{r:.3f}" for r in row.get("round_ratios", [wall.ratio]))
        lines.append(
            f"| {row['name']} | {wall} | {rounds} | {wall.smallest:.3f}-{wall.largest:.3f} | {cpu} "
            f"| {first:.3f}, {second:.3f} "
            f"| {row['largest_loss_difference']:.3g} | {row['others_cores_mean']:.2f} |"
        )
    return lines + [""]


def write_table(records: list[dict], path: Path) -> None:
    body = [
        "# Side-by-side step comparisons",
        "",
        "Generated by `python benchmarks/compare.py ... --publish` from benchmarks/results/compare/ (do not edit).",
        "Each row: the second side's step over the first's, the geometric mean of pairs of adjacent steps",
        "(A B B A order, the same batch), with its 95% bootstrap interval; the CPU ratio is the processes' own",
        'CPU time; "others\' cores" is what the rest of the machine kept busy meanwhile. "rounds": each',
        "round's own ratio, both sides started afresh; the interval draws rounds, then pairs.",
        "",
    ]
    for record in sorted(records, key=lambda r: r["date"], reverse=True):
        body += table_lines(record)
    path.write_text("\n".join(body))


def _publish(record: dict, stamp: str) -> None:
    RECORDS.mkdir(parents=True, exist_ok=True)
    (RECORDS / f"{stamp}.json").write_text(json.dumps(record, indent=1))
    write_table([json.loads(p.read_text()) for p in sorted(RECORDS.glob("*.json"))], TABLE)
    print(f"wrote {TABLE}")


def machine_line() -> str:
    described = machine()  # run_all.py's description of the machine, the one every report uses
    return f"{described['cores']} cores ({described['cpu']})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    against = parser.add_mutually_exclusive_group(required=True)
    against.add_argument(
        "--table", action="store_true", help="only rewrite benchmarks/COMPARE.md from the published records"
    )
    against.add_argument("--baseline", help="a revision: each contestant with its packages against with this tree's")
    against.add_argument(
        "--reference",
        choices=CONTESTANTS + OFFLOAD_CONTESTANTS + MUON_CONTESTANTS,
        help="a contestant: each one against it, this tree",
    )
    against.add_argument(
        "--pool",
        nargs="+",
        type=Path,
        metavar="RECORD",
        help="records (record.json) of one question: their rounds as one estimate (with --publish, a new record)",
    )
    parser.add_argument("--contestants", nargs="+", choices=list(STAGE_OF), default=["zero1", "zero2", "zero3"])
    parser.add_argument("--size", choices=("small", "medium", "large"), default="large")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--rounds", type=int, default=2, help="fresh starts of both sides per contestant")
    parser.add_argument("--pairs", type=int, default=8, help="pairs of steps per round (at least 3)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per side first")
    parser.add_argument("--no-pin", action="store_true", help="let the scheduler place the ranks")
    parser.add_argument("--quiet-cores", type=float, default=0.3, help="a quiet machine keeps fewer cores busy")
    parser.add_argument("--wait", type=float, default=600, help="seconds to wait for a quiet machine")
    parser.add_argument("--publish", action="store_true", help="add the record to benchmarks/COMPARE.md")
    parser.add_argument("--out", default=None, help="the folder for the record and the ranks' logs (default: new)")
    args = parser.parse_args()
    if args.table:
        write_table([json.loads(p.read_text()) for p in sorted(RECORDS.glob("*.json"))], TABLE)
        print(f"wrote {TABLE}")
        return
    if args.pool:
        record = pooled_record([json.loads(path.read_text()) for path in args.pool])
        print("\n".join(table_lines(record)))
        if args.publish:
            _publish(record, datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
        return
    if args.pairs < 3:
        parser.error("--pairs: at least 3 pairs (an interval from fewer says nothing)")
    if args.rounds < 1:
        parser.error("--rounds: at least 1")
    if args.world_size < 1:
        parser.error("--world-size: at least 1")

    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else HERE / "out" / f"compare-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    this_tree = describe_checkout()
    with contextlib.ExitStack() as stack:
        if args.baseline:
            baseline_tree, baseline = stack.enter_context(worktree_of(args.baseline))
            heading = f"this tree ({this_tree}) over {baseline}"
        else:
            heading = f"each contestant over {args.reference}, this tree ({this_tree})"
        settings = StepSettings(
            args.size, args.world_size, args.device, args.rounds, args.pairs, args.warmup, not args.no_pin, out
        )
        busy_before = wait_for_quiet(args.quiet_cores, args.wait)
        comparisons = []
        for name in args.contestants:
            if args.baseline:
                sides = (Side("baseline", baseline_tree, baseline, name), Side("this tree", ROOT, this_tree, name))
            else:
                sides = (Side(args.reference, ROOT, this_tree, args.reference), Side(name, ROOT, this_tree, name))
            print(f"{name}: {sides[1].label} over {sides[0].label}, {args.rounds} x {args.pairs} pairs", flush=True)
            try:
                row = compare_sides(sides, settings)
            except RuntimeError as error:  # one side cannot run this contestant: say so, go on with the next
                print(f"{name}: failed: {error}", flush=True)
                comparisons.append({"name": name, "failed": str(error)})
                continue
            row["name"] = name
            comparisons.append(row)
            by_round = ", ".join(f"{r:.3f}" for r in row["round_ratios"])
            print(
                f"{name}: wall {RatioEstimate(**row['wall'])} (rounds {by_round}), CPU {RatioEstimate(**row['cpu'])}, "
                "largest loss "
                f"difference {row['largest_loss_difference']:.3g}, others' cores {row['others_cores_mean']:.2f}",
                flush=True,
            )
    record = {
        "heading": heading,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine_line(),
        "size": args.size,
        "world_size": args.world_size,
        "device": args.device,
        "rounds": args.rounds,
        "pairs": args.pairs,
        "warmup": args.warmup,
        "pinned": not args.no_pin,
        "busy_before": busy_before,
        "comparisons": comparisons,
    }
    (out / "record.json").write_text(json.dumps(record, indent=1))
    print("\n".join(table_lines(record)))
    if args.publish:
        _publish(record, stamp)
    if any("failed" in row for row in comparisons):
        sys.exit(1)


if __name__ == "__main__":
    main()
