"""Who is told when a forward begins and ends, besides the units: the one listener protocol of the engine.

The step runtime (``passes/runtime.py``) drives each pass over the units. A few parts built after it must act
at the edges of a forward: check the model's registered parameters, broadcast rank 0's buffers, drop an
export that raised midway, show the optimizer the model's parameters again, agree on the shard files' reads.
They subclass :class:`PassListener`, override the events they need, and the builder (``build.py``) subscribes
each once, right after making it, to the :class:`PassListeners` it gave the runtime's constructor. They are
told in that order, on every rank at the same point of the same forward; any of them may raise to refuse the
forward before a unit gathers.

The optimizer step is told of one more kind of part: :class:`BackgroundWork`, work a thread of its own does
beside training (an asynchronous checkpoint's write), finished when every rank says so in the step's agreement.

This module sits at the bottom of the core's layers, so the model, optimizer, offload and checkpoint parts
above it can listen without importing the passes layer.
"""

from __future__ import annotations


class PassListener:
    """The events of a forward; each does nothing unless overridden."""

    def before_outermost_forward(self) -> None:
        """A forward begins (its first unit is entered; a pass that raised before it is cleaned up)."""

    def before_root_forward(self) -> None:
        """That forward is the model's own (its root unit runs first), not a unit called alone."""

    def after_root_forward(self) -> None:
        """The model's own forward has returned (before its output is used)."""


class PassListeners:
    """The listeners the runtime tells, in the order they subscribed (the order the builder made them)."""

    def __init__(self) -> None:
        self._listeners: list[PassListener] = []

    def subscribe(self, listener: PassListener) -> None:
        self._listeners.append(listener)

    def before_outermost_forward(self) -> None:
        for listener in self._listeners:
            listener.before_outermost_forward()

    def before_root_forward(self) -> None:
        for listener in self._listeners:
            listener.before_root_forward()

    def after_root_forward(self) -> None:
        for listener in self._listeners:
            listener.after_root_forward()


class BackgroundWork:
    """Work a thread of its own does beside training (an asynchronous checkpoint's write), collected at the
    optimizer step: every rank says in the step's agreement whether its own is finished, and once every
    rank's is, each calls ``collect`` (which raises the work's error, the same on every rank)."""

    def finished_here(self) -> bool:
        """Nothing is left to do on this rank (True when no work is pending)."""
        return True

    def collect(self) -> None:
        """Every rank's work is finished: take its outcome (raise its error) and forget it."""
