"""Which object (an engine) has sharded which model, so a model is never sharded twice.

Both held weakly: a model dropped by the user takes its entry with it, and the entry never keeps an engine
(which holds its model) alive by itself. What keeps an engine alive is the user's reference, or its model's
hooks while they are installed.
"""

from __future__ import annotations

import weakref
from typing import Generic, TypeVar

from torch import nn

Owner = TypeVar("Owner")


class ModelOwners(Generic[Owner]):
    def __init__(self) -> None:
        self._owners: weakref.WeakKeyDictionary[nn.Module, weakref.ref[Owner]] = weakref.WeakKeyDictionary()

    def register(self, model: nn.Module, owner: Owner) -> None:
        self._owners[model] = weakref.ref(owner)

    def forget(self, model: nn.Module) -> None:
        """``model`` has no owner any more (its engine gave it back): another may shard it."""
        self._owners.pop(model, None)

    def owner_of(self, model: nn.Module) -> Owner | None:
        """The owner of ``model`` itself, if any (and still alive)."""
        owner = self._owners.get(model)
        return owner() if owner is not None else None

    def owner_containing(self, module: nn.Module) -> tuple[Owner, str] | None:
        """The owner whose model contains ``module``, and the module's name in that model."""
        for model, owner_ref in list(self._owners.items()):
            owner = owner_ref()
            if owner is None:
                continue
            for name, candidate in model.named_modules():
                if candidate is module:
                    return owner, name
        return None
