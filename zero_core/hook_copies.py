"""Hooks that a deep copy of the model does not take along.

``copy.deepcopy`` of a module copies its hook dictionaries, and with them whatever a hook holds: for a
bound method of the step runtime, the whole runtime, its units and their buffers. A copy of a sharded model
(an EMA copy, a teacher) must be an ordinary module instead, so every hook the engine installs on modules
and parameters is wrapped in :class:`InertWhenCopied`: the copy gets :func:`no_hook`, which does nothing.
"""

from __future__ import annotations

from typing import Any


def no_hook(*args: Any, **kwargs: Any) -> None:
    """What a deep copy of a module or parameter gets for each of the engine's hooks: nothing happens."""
    return None


class InertWhenCopied:
    # The hook in a slot, not in __dict__: torch wraps some hooks with functools.update_wrapper, which copies
    # the hook's __dict__ onto its wrapper, where a deep copy would find the hook after all. (A __dict__ stays
    # for the marks torch sets on some hooks.)
    __slots__ = ("_hook", "__dict__")

    def __init__(self, hook: Any):
        self._hook = hook

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._hook(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> Any:
        return no_hook
