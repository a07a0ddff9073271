"""Every DeepSpeed key's row, gathered from the modules that read them, and the Markdown table the docs
print (``python -m zero_core.deepspeed > docs/deepspeed-keys.md``), so the table is the code."""

from __future__ import annotations

from . import optimizer_sections, precision_sections, top_level, zero_section
from .common import KeyRow, Treatment

# Sections whose reader is its own module (their keys' rows are dotted under them).
SECTIONS = ("zero_optimization", "optimizer", "scheduler", "fp16", "bf16", "bfloat16")
_TITLE = "DeepSpeed config keys"


def all_rows() -> tuple[KeyRow, ...]:
    return (
        *top_level.ROWS,
        *zero_section.ROWS,
        *precision_sections.ROWS,
        *optimizer_sections.ROWS,
    )


def top_level_keys() -> list[str]:
    return sorted({row.key.split(".", 1)[0] for row in all_rows()} | set(SECTIONS))


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown() -> str:
    """The table, one section after another, each key with its treatment and what it becomes here."""
    counts = {treatment: 0 for treatment in Treatment}
    lines = []
    for row in sorted(all_rows(), key=lambda row: (row.key.count(".") > 0, row.key.split(".")[0], row.key)):
        counts[row.treatment] += 1
        treatment = row.treatment.value + (f" ({row.accepted_text})" if row.accepted_text else "")
        lines.append(f"| `{row.key}` | {_cell(treatment)} | {_cell(row.meaning)} |")
    summary = ", ".join(f"{count} {treatment.value}" for treatment, count in counts.items())
    return "\n".join(
        [
            f"# {_TITLE}",
            "",
            "Every key of a DeepSpeed config (DeepSpeed 0.19) and what `ZeroStrategy(config=...)`, "
            "`ZeroFabricStrategy(config=...)`, `ZeroPlugin.from_deepspeed(...)`, `accelerate-zero launch "
            "--zero_config_file` and `TrainingArguments(deepspeed=...)` under `ZeroTrainer` do with it:",
            "",
            "- **mapped**: becomes a setting here and trains as DeepSpeed does;",
            '- **resolved**: the framework\'s own value decides (`"auto"` takes it; a number becomes it or must '
            "agree with it);",
            "- **accepted without effect**: a knob whose job this design does another way; the setup log lists "
            "the ones a config sets, with the reason;",
            "- **refused**: training would differ; the error names the key and what to do. A key with no row "
            "(a typo, a newer DeepSpeed's key) is refused too.",
            "",
            f"{len(lines)} keys: {summary}. Generated from the code by `python -m zero_core.deepspeed`; "
            "do not edit by hand.",
            "",
            "| Key | Treatment | Here |",
            "| --- | --- | --- |",
            *lines,
            "",
        ]
    )
