"""The Python blocks of the docs and the README, read from the Markdown as a user reads them.

A block's first line says how it runs, so the page says it too:

- ``# run: <command> <script>.py``: saved as the script and started with the command
  (``python``, ``torchrun``, ``accelerate launch``, ``accelerate-zero launch``; leading
  ``NAME=value`` words are environment variables), e.g. ``# run: torchrun --nproc_per_node 2 train.py``;
- ``# not run: <why>``: a block that cannot run here (a GPU, two machines, a fragment of the
  script above); the reason is part of the page;
- anything else: a whole script, run with ``python``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RUN = "# run: "
NOT_RUN = "# not run: "

_FENCE = re.compile(r"^(?P<indent>[ ]*)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ ]*$", re.M | re.S)

# The words a user types, as this interpreter starts them (before a shell has seen the console scripts).
_LAUNCHERS = {
    "python": [sys.executable],
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    "accelerate": [sys.executable, "-m", "accelerate.commands.accelerate_cli"],
    "accelerate-zero": [sys.executable, "-m", "accelerate_zero.launch"],
}


@dataclasses.dataclass(frozen=True)
class Snippet:
    page: Path
    index: int  # the block's place among the page's Python blocks, from 1
    line: int  # where the block starts in the page
    code: str

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def first_line(self) -> str:
        return self.code.lstrip().splitlines()[0] if self.code.strip() else ""

    @property
    def not_run_reason(self) -> str | None:
        line = self.first_line
        return line[len(NOT_RUN) :].strip() if line.startswith(NOT_RUN) else None

    def command(self, script: Path) -> tuple[list[str], dict[str, str]]:
        """The command that runs this block saved as ``script``, and the variables it sets."""
        line = self.first_line
        words = shlex.split(line[len(RUN) :]) if line.startswith(RUN) else ["python", "snippet.py"]
        env = {}
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
            name, value = words.pop(0).split("=", 1)
            env[name] = value
        if not words or words[0] not in _LAUNCHERS:
            raise ValueError(f"{self.id}: '{line}' starts with none of {sorted(_LAUNCHERS)}")
        scripts = [i for i, word in enumerate(words) if word.endswith(".py")]
        if not scripts:
            raise ValueError(f"{self.id}: '{line}' names no script (a word ending in .py)")
        words[scripts[0]] = str(script)
        return _LAUNCHERS[words[0]] + words[1:], env


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def snippets(page: Path) -> list[Snippet]:
    text = page.read_text()
    found = []
    for match in _FENCE.finditer(text):
        if match["lang"] != "python":
            continue
        indent = len(match["indent"])
        code = "".join(line[indent:] + "\n" for line in match["body"].splitlines())
        found.append(Snippet(page, len(found) + 1, text.count("\n", 0, match.start()) + 1, code))
    return found


def all_snippets() -> list[Snippet]:
    return [snippet for page in pages() for snippet in snippets(page)]


def environment(extra: dict[str, str]) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **extra}
