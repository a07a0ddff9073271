"""At interpreter exit: the default process group destroyed while the interpreter is still whole.

A gloo process group still alive when the interpreter finalizes is destroyed with it: its worker
threads can then release work objects that hold tensors (a GIL taken during finalization) or be
destroyed unjoined, and a run that finished every step ends in SIGABRT ("terminate called without an
active exception"), which torchrun reports as a failed job. torch destroys nothing at exit (pytorch
#179291 proposed it), and Lightning destroys the group at exit for NCCL only. It is registered when
``zero_core`` is imported, so runs under any adapter, or none, end cleanly, and it runs after every exit
handler the script registers later (atexit runs the last registered first): a user's own
``atexit.register(dist.destroy_process_group)`` or a last metric's all-reduce still finds the group. A
script that destroys the group itself is unaffected (the handler then finds nothing to do). The
meetings' own exit handler, registered at the first meeting, runs before it and still has the store.
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
