"""``python -m zero_core.deepspeed > docs/deepspeed-keys.md``: the table of every DeepSpeed key's treatment."""

from .key_table import markdown

print(markdown(), end="")
