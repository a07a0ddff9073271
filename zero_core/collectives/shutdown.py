"""At interpreter exit: the default process group destroyed while the interpreter is still whole.

A gloo process group still alive when the interpreter finalizes is destroyed with it: its worker
threads can then release work objects that hold tensors (a GIL taken during finalization) or be
destroyed unjoined, and a run that finished every step ends in SIGABRT ("terminate called without an
active exception"), which torchrun reports as a failed job. torch destroys nothing at exit (pytorch
#179291 proposed it), and Lightning destroys the group at exit for NCCL only.

Nothing happens at import. The clean-up is armed when it is first needed: the first time an engine
takes a process group (``CommContext.create``), so runs under any adapter, or none, end cleanly. It
must still run after the exit handlers the script registers, even those registered before the engine
was built (a user's own ``atexit.register(dist.destroy_process_group)``, a last metric's all-reduce):
those still need the group. So it is a ``weakref.finalize`` with ``atexit=True`` rather than an
``atexit`` handler of its own: finalizers run from the one exit handler ``weakref`` registers when the
first finalizer of the process is made, which ``import torch`` does, so it runs after every handler
registered once torch is imported, whenever the engine arms it. A script that destroys the group
itself is unaffected (the clean-up then finds nothing to do). The meetings' own exit handler,
registered at the first meeting, runs before it and still has the store.
"""

from __future__ import annotations

import weakref

import torch.distributed as dist


class _Process:
    """Lives as long as the interpreter: the object the exit-time clean-up is attached to."""


_PROCESS = _Process()
_armed: weakref.finalize | None = None


def destroy_process_group_at_exit() -> None:
    """Arms the exit-time clean-up, once per process."""
    global _armed
    if _armed is None:
        _armed = weakref.finalize(_PROCESS, _destroy_if_initialized)  # atexit=True is finalize's default


def _destroy_if_initialized() -> None:
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - exiting either way; nothing is left to report it to
            pass
