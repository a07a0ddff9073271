"""benchmarks/results/all.json -> benchmarks/RESULTS.md and PNG plots."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from plotting import copy_to_docs, pyplot

from zero_core import MixedPrecision, expected_model_state_bytes

MIB = 2**20
ADAM_BYTES = 8  # exp_avg + exp_avg_sq in fp32
BUDGET = 512 * 2**20  # per rank, as in run_all.py's depth search
# Step time relative to DDP in the same run, on the largest model run (168M parameters).
TARGETS = {1: 0.85, 2: 0.90, 3: 1.10}


def _formula(record: dict) -> int:
    return expected_model_state_bytes(
        record["stage"], record["numel"], record["world_size"], MixedPrecision(), ADAM_BYTES
    ).model_state_bytes


def _ok(records: list[dict], size: str, world_size: int) -> list[dict]:
    from contestants import CONTESTANTS

    rows = [r for r in records if r.get("size") == size and r.get("world_size") == world_size and "median_step_s" in r]
    return sorted(rows, key=lambda r: CONTESTANTS.index(r["contestant"]))


def _speed_table(records: list[dict], size: str) -> list[str]:
    rows = _ok(records, size, 2)
    ddp = next((r for r in rows if r["contestant"] == "ddp"), None)
    if ddp is None:
        return [f"(no {size} results)"]
    lines = [
        f"Model: {rows[0]['numel']:,} parameters, world size 2, fp32 AdamW.",
        "",
        "| contestant | ZeRO stage | median step (s) | vs DDP | model states / rank (MiB) | formula (MiB) | measured / formula | peak RSS / rank (MiB) | first loss | last loss |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        measured = max(r["model_state_bytes"])
        lines.append(
            f"| {r['contestant']} | {r['stage']} | {r['median_step_s']:.3f} | {r['median_step_s'] / ddp['median_step_s']:.2f}x | "
            f"{measured / MIB:.1f} | {_formula(r) / MIB:.1f} | {measured / _formula(r):.2f} | {max(r['peak_rss_bytes']) / MIB:.0f} | "
            f"{r['first_loss']:.4f} | {r['last_loss']:.4f} |"
        )
    skipped = [r for r in records if r.get("size") == size and ("skipped" in r or "failed" in r)]
    for r in skipped:
        lines.append(f"| {r['contestant']} | - | not run: {r.get('skipped') or 'failed'} | | | | | | | |")
    return lines


def _phase_table(records: list[dict], size: str) -> list[str]:
    """Where each contestant's step goes, and the floor stages 1/2 are held to: DDP's step
    less half its optimizer step (each of 2 ranks runs Adam on half the parameters)."""
    rows = [r for r in _ok(records, size, 2) if "phase_median_s" in r]
    ddp = next((r for r in rows if r["contestant"] == "ddp"), None)
    if ddp is None:
        return [f"(no phase times for the {size} model)"]
    lines = [
        "Median per phase over the timed steps, slowest rank each (communication a phase waits for counts in that phase; "
        "stages 1/2 wait for their post-step all-gather inside the optimizer step).",
        "",
        "| contestant | forward (s) | backward (s) | optimizer step (s) | step (s) | vs DDP |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = r["phase_median_s"]
        lines.append(
            f"| {r['contestant']} | {p['forward']:.3f} | {p['backward']:.3f} | {p['optimizer step']:.3f} | "
            f"{r['median_step_s']:.3f} | {r['median_step_s'] / ddp['median_step_s']:.2f}x |"
        )
    half = ddp["median_step_s"] - ddp["phase_median_s"]["optimizer step"] / 2
    lines += [
        "",
        f"DDP's step less half its optimizer step (what stages 1/2 save by updating half the parameters, all else "
        f"as DDP): {half:.3f} s = {half / ddp['median_step_s']:.2f}x DDP. A stage's optimizer step above half of DDP's "
        "is mostly its post-step all-gather, waited for inside the step; a backward below DDP's is DDP's all-reduce "
        "that our reduce-scatters hide better.",
    ]
    return lines


def _profile_table(records: list[dict], size: str) -> list[str]:
    """The torch profiler's breakdown of one extra step (rank 0), as shares applied to the median step."""
    from profile_breakdown import CATEGORIES

    rows = [r for r in _ok(records, size, 2) if "profile" in r]
    if not rows:
        return [f"(no profiles for the {size} model)"]
    lines = [
        "One extra step per contestant under the torch profiler (rank 0). Each event's self time goes to one "
        "category: compute (aten ops), copies (`copy_`, `cat`, `to`, `clone`), communication (issuing and waiting "
        "for collectives: ours `zero::*` and `zero::wait`, FSDP2's `FSDP::all_gather`/`post_backward_reduce`, "
        "`c10d` ops), hooks (the frameworks' named hook ranges, `zero::pre_forward`, `FSDP::pre_forward`, ...), "
        "and other (what no event covers: Python, and waits inside C++ such as DDP's all-reduce at the end of "
        "backward). The profiler slows each op, so the table applies the profiled shares to the unprofiled median step.",
        "",
        "| contestant | step (s) | " + " | ".join(f"{c} (s)" for c in CATEGORIES) + " | largest self times |",
        "|---|---|" + "---|" * len(CATEGORIES) + "---|",
    ]
    for r in rows:
        shares, step = r["profile"]["shares"], r["median_step_s"]
        top = ", ".join(f"`{name}` {seconds:.2f}" for name, seconds in r["profile"]["top_self"][:4])
        lines.append(
            f"| {r['contestant']} | {step:.3f} | "
            + " | ".join(f"{shares[c] * step:.3f}" for c in CATEGORIES)
            + f" | {top} |"
        )
    return lines


def _traffic_table(records: list[dict], size: str) -> list[str]:
    lines = [
        "| contestant | collective | calls / step | MiB / step | / parameter bytes | formula |",
        "|---|---|---|---|---|---|",
    ]
    for r in _ok(records, size, 2):
        if not r.get("traffic"):
            continue
        param_bytes = 4 * r["numel"]
        formula = {0: "all-reduce 2Ψ (counted once: Ψ)", 1: "RS Ψ + AG Ψ", 2: "RS Ψ + AG Ψ", 3: "AG 2Ψ + RS Ψ"}[
            r["stage"]
        ]
        for kind, count in r["traffic"].items():
            if count["calls"] and kind in ("all_gather", "reduce_scatter", "all_reduce") and count["bytes"] > 1024:
                lines.append(
                    f"| {r['contestant']} | {kind} | {count['calls']} | {count['bytes'] / MIB:.1f} | {count['bytes'] / param_bytes:.2f} | {formula} |"
                )
    return lines


def _largest_model(records: list[dict], size: str) -> list[str]:
    lines = [
        f"Per-rank budget for model states: {BUDGET / MIB:.0f} MiB, world size 2. Theoretical: the budget over the formula's bytes per parameter; measured: the budget over the bytes per parameter measured on the {size} model.",
        "",
        "| contestant | stage | bytes / parameter (formula) | bytes / parameter (measured) | largest model, theory (M params) | largest model from measured bytes (M params) |",
        "|---|---|---|---|---|---|",
    ]
    for r in _ok(records, size, 2):
        formula = _formula(r) / r["numel"]
        measured = max(r["model_state_bytes"]) / r["numel"]
        lines.append(
            f"| {r['contestant']} | {r['stage']} | {formula:.2f} | {measured:.2f} | {BUDGET / formula / 1e6:.1f} | {BUDGET / measured / 1e6:.1f} |"
        )
    return lines


def _largest_search(largest: list[dict]) -> list[str]:
    if not largest:
        return []
    lines = [
        "",
        f"Measured: the deepest model (width 512, vocabulary 8192) whose measured model states fit {largest[0].get('budget_bytes', 0) / MIB:.0f} MiB per rank at world size 2, found by training it; the probes list each depth tried with its measured bytes.",
        "",
        "| contestant | largest depth that fits | parameters (M) | probes: depth -> MiB / rank |",
        "|---|---|---|---|",
    ]
    for entry in largest:
        if entry.get("failed"):
            lines.append(f"| {entry['contestant']} | failed | | {entry['failed'][:80]} |")
            continue
        probes = ", ".join(f"{d} -> {b / MIB:.0f}" for d, b in sorted(entry["probes"].items(), key=lambda x: int(x[0])))
        lines.append(f"| {entry['contestant']} | {entry['depth']} | {entry['numel'] / 1e6:.1f} | {probes} |")
    return lines


def _scaling(records: list[dict]) -> list[str]:
    lines = [
        "| contestant | world size | median step (s) | model states / rank (MiB) | formula (MiB) |",
        "|---|---|---|---|---|",
    ]
    for contestant in ("ddp", "zero1", "zero2", "zero3"):
        for world_size in (1, 2, 4):
            for r in _ok(records, "small", world_size):
                if r["contestant"] == contestant:
                    lines.append(
                        f"| {contestant} | {world_size} | {r['median_step_s']:.3f} | {max(r['model_state_bytes']) / MIB:.1f} | {_formula(r) / MIB:.1f} |"
                    )
    return lines


def _targets(records: list[dict], size: str) -> list[str]:
    rows = {r["contestant"]: r for r in _ok(records, size, 2)}
    if "ddp" not in rows:
        return []
    lines = []
    for stage in (1, 2, 3):
        ours = rows.get(f"zero{stage}")
        if ours is None:
            continue
        ratio = ours["median_step_s"] / rows["ddp"]["median_step_s"]
        verdict = "met" if ratio <= TARGETS[stage] else f"missed by {ratio / TARGETS[stage] - 1:.0%}"
        others = [
            name
            for name in (f"deepspeed{stage}", "fsdp2" if stage == 3 else "", "ddp_zero_optimizer" if stage == 1 else "")
            if name in rows
        ]
        against = ", ".join(
            f"{name} {rows[name]['median_step_s'] / ours['median_step_s']:.2f}x our time" for name in others
        )
        if stage == 3 and "fsdp2" in rows:
            against += f"; peak RSS {max(ours['peak_rss_bytes']) / MIB:.0f} MiB vs fsdp2's {max(rows['fsdp2']['peak_rss_bytes']) / MIB:.0f} MiB"
        overlap = rows.get(f"zero{stage}_overlap")
        if overlap is not None:
            against = (against + "; " if against else "") + (
                f"with overlap_param_refresh {overlap['median_step_s'] / rows['ddp']['median_step_s']:.2f}x DDP"
            )
        memory = max(ours["model_state_bytes"]) / _formula(ours)
        lines.append(
            f"- Stage {stage}: {ratio:.2f}x DDP (target <= {TARGETS[stage]}x: {verdict}); memory {memory:.3f}x the formula (target within 5%)"
            + (f"; {against}" if against else "")
            + "."
        )
    return lines


def _plots(records: list[dict], size: str, directory: Path) -> list[str]:
    plt = pyplot()
    rows = _ok(records, size, 2)
    names = [r["contestant"] for r in rows]
    figure, axis = plt.subplots(figsize=(10, 4))
    axis.bar(names, [max(r["model_state_bytes"]) / MIB for r in rows], label="measured")
    axis.plot(names, [_formula(r) / MIB for r in rows], "k_", markersize=30, mew=2, label="formula")
    ceiling = 1.3 * max(_formula(r) for r in rows) / MIB
    axis.set_ylim(0, ceiling)  # keep the formulas readable; taller bars are labelled
    for index, r in enumerate(rows):
        measured = max(r["model_state_bytes"]) / MIB
        if measured > ceiling:
            axis.text(index, ceiling * 0.92, f"{measured:.0f}", ha="center", color="white", fontsize=8)
    axis.set_ylabel("model states per rank (MiB)")
    axis.set_title(f"Memory per rank, {size} model, world size 2")
    axis.legend()
    plt.xticks(rotation=30, ha="right")
    figure.tight_layout()
    figure.savefig(directory / "memory_per_stage.png", dpi=100)
    ours = [r for r in rows if r.get("traffic") and r["contestant"].startswith(("zero", "ddp"))]
    figure, axis = plt.subplots(figsize=(8, 4))
    bottoms = [0.0] * len(ours)
    # An all-reduce is a reduce-scatter plus an all-gather: 2x its payload in the formulas' accounting.
    for kind, weight, label in (
        ("all_reduce", 2, "all_reduce (x2: RS + AG)"),
        ("reduce_scatter", 1, "reduce_scatter"),
        ("all_gather", 1, "all_gather"),
    ):
        values = [
            weight * r["traffic"].get(kind, {}).get("bytes", 0) / (4 * r["numel"])
            if r["traffic"].get(kind, {}).get("bytes", 0) > 1024
            else 0
            for r in ours
        ]
        axis.bar([r["contestant"] for r in ours], values, bottom=bottoms, label=label)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    axis.set_ylabel("bytes moved per step / parameter bytes")
    axis.set_title("Communication per step (formula accounting: DDP 2, stages 1/2 2, stage 3 3)")
    axis.legend()
    figure.tight_layout()
    figure.savefig(directory / "traffic_per_stage.png", dpi=100)
    for name in ("memory_per_stage.png", "traffic_per_stage.png"):
        copy_to_docs(directory / name)
    return ["![memory per stage](memory_per_stage.png)", "", "![traffic per stage](traffic_per_stage.png)"]


def write_report(source: Path, target: Path, plot_dir: Path, plots: bool = True) -> None:
    data = json.loads(source.read_text())
    records, machine = data["records"], data["machine"]
    sizes = [s for s in ("small", "medium", "large") if _ok(records, s, 2)]
    main_size = sizes[-1]
    lines = [
        "# Benchmarks",
        "",
        "Regenerate with `python benchmarks/run_all.py --publish` (about 35 minutes on 2 cores; `--quick` for the small model only; "
        "`--sizes large --merge --publish` reruns one size into the existing results).",
        "",
        f"Machine: {machine['cpu']}, {machine['cores']} cores, CPU only, gloo. Date: {machine['date']}. "
        f"Versions: {', '.join(f'{k} {v}' for k, v in machine['versions'].items())}.",
        "",
        "All contestants train the same GPT-style model (tied embeddings), same data, same seed, fp32 AdamW, no clipping; "
        "each runs in its own `torchrun` with 2 processes, one thread each. Step time is the median over timed steps of the "
        "slowest rank. Model-state memory is measured: every live tensor storage once, after a backward with the optimizer "
        "state alive (activations freed). Traffic is the logical payload per step: for ours from the collectives module, "
        "for DDP from a counting comm hook; FSDP2 and DeepSpeed expose no such count (their formulas are those of stage 3 and "
        "of their stage).",
        "",
        "## Targets",
        "",
        *_targets(records, main_size),
    ]
    for size in sizes:
        rerun = data.get("machine_by_size", {}).get(size)  # rerun alone with --merge: its own date and versions
        note = (
            [
                f"Run on its own on {rerun['date']} (torch {rerun['versions']['torch']}); ratios compare rows of this table.",
                "",
            ]
            if rerun
            else []
        )
        lines += ["", f"## Step time, memory and losses: {size} model", "", *note, *_speed_table(records, size)]
    lines += ["", f"## Where the step goes: {main_size} model", "", *_phase_table(records, main_size)]
    lines += ["", f"## Profile of a step: {main_size} model", "", *_profile_table(records, main_size)]
    lines += ["", f"## Communication per step: {main_size} model", "", *_traffic_table(records, main_size)]
    lines += [
        "",
        "## Largest trainable model",
        "",
        *_largest_model(records, main_size),
        *_largest_search(data.get("largest", [])),
    ]
    lines += ["", "## Scaling (small model; 4 processes oversubscribe the 2 cores)", "", *_scaling(records)]
    if plots:
        lines += ["", "## Plots", "", *_plots(records, main_size, plot_dir)]
    notes = Path(__file__).with_name("NOTES.md")
    if notes.exists():
        lines += ["", notes.read_text().strip()]
    target.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    write_report(Path(sys.argv[1]) if len(sys.argv) > 1 else here / "results" / "all.json", here / "RESULTS.md", here)
