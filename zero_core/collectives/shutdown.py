"""At interpreter exit: the default process group destroyed while the interpreter is still whole.

A gloo process group still alive when the interpreter finalizes is destroyed with it: its worker
threads can then release work objects that hold tensors (a GIL taken during finalization) or be
destroyed unjoined, and a run that finished every step ends in SIGABRT ("terminate called without an
active exception"), which torchrun reports as a failed job. torch destroys nothing at exit (pytorch
#179291 proposed it), and Lightning destroys the group at exit for NCCL only. Every engine registers
this once, so runs under any adapter, or none, end cleanly; a script that destroys the group itself
is unaffected (the handler then finds nothing to do). It runs after the meetings' own exit handler
(registered later, run earlier), which still needs the group's store.
"""

from __future__ import annotations

import atexit

import torch.distributed as dist

_registered = False


def destroy_process_group_at_exit() -> None:
    global _registered
    if not _registered:
        _registered = True
        atexit.register(_destroy_if_initialized)


def _destroy_if_initialized() -> None:
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - exiting either way; nothing is left to report it to
            pass
