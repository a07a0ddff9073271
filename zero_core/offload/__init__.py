"""Offload's mechanics, every tier in one place (the plan of where each unit's tensors rest is
``zero_core/offload_plan.py``; host buffers are ``zero_core/host_memory.py``).

Below the units: a unit's storage holds the file tiers it calls, typed from here, and the tiers take a unit as
a protocol (``state_files.UnitInFiles``). Highest first: ``opening`` (this rank's tiers, opened from the plan);
``nvme_save`` and ``nvme_load`` (the optimizer state's files read unit by unit for a save; a load staged beside
them, all or nothing); ``state_files`` (offload_optimizer="nvme": the optimizer state's files and the step's
walk over them); ``shard_files`` (offload_params="nvme": the parameter shards' files); ``tier`` (what the file
tiers share: the engine's one I/O pool, the directory, the failure agreement); ``scratch`` and ``unit_file``
(the run's scratch directory; the one layout of a unit's file); ``failure_agreement`` and ``file_io`` (``OffloadError``
and the one agreement of failures across ranks; tensors to and from files, without the page cache).
"""

from .failure_agreement import OffloadError

__all__ = ["OffloadError"]
