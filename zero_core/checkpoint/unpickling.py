"""Reading the pickled files of a checkpoint without running code from them.

DCP's ``.metadata`` is a plain pickle: its unpickler here resolves only an
exact list of fully qualified names (DCP's record classes, torch dtypes and
``Size``, paths). A name is looked up as a whole: dotted attribute paths
(pickle protocol 4 lets ``find_class`` walk ``module.attr.attr``), other
modules and anything not on the list are refused, whichever opcode asked
(GLOBAL, STACK_GLOBAL, INST, OBJ, EXT1/2/4 all go through ``find_class``).
Persistent ids are refused too, and BUILD (which sets attributes) applies
only to instances of DCP's record classes, never to a class or function.

Everything else we unpickle (``meta.pt``, tensors, param groups) goes
through ``torch.load(weights_only=True)``, torch's own allow-list.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
from collections import OrderedDict
from pathlib import Path, PosixPath, PurePosixPath, PureWindowsPath, WindowsPath
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata

from .checkpoint_error import CheckpointError

_MAX_TUPLE_DEPTH = 32

# DCP's record classes: the only classes BUILD may fill (with their own fields).
_RECORD_CLASSES: tuple[type, ...] = (
    dcp_metadata.Metadata,
    dcp_metadata.MetadataIndex,
    dcp_metadata.StorageMeta,
    dcp_metadata.TensorProperties,
    dcp_metadata.TensorStorageMetadata,
    dcp_metadata.ChunkStorageMetadata,
    dcp_metadata.BytesStorageMetadata,
    dcp_filesystem._StorageInfo,
)
_BUILDABLE: dict[type, frozenset[str]] = {
    cls: frozenset(field.name for field in dataclasses.fields(cls)) for cls in _RECORD_CLASSES
}


def _exact_names() -> dict[tuple[str, str], Any]:
    names: dict[tuple[str, str], Any] = {(cls.__module__, cls.__name__): cls for cls in _RECORD_CLASSES}
    # An Enum: how TensorProperties records memory_format.
    names[(dcp_metadata.__name__, "_MEM_FORMAT_ENCODING")] = dcp_metadata._MEM_FORMAT_ENCODING
    names[("torch", "Size")] = torch.Size
    names[("torch.serialization", "_get_layout")] = torch.serialization._get_layout  # a name -> layout lookup
    names[("collections", "OrderedDict")] = OrderedDict
    names[("builtins", "set")] = set
    names[("builtins", "frozenset")] = frozenset
    for cls in (PosixPath, WindowsPath, PurePosixPath, PureWindowsPath):  # DCP records the checkpoint_id
        names[("pathlib", cls.__name__)] = cls
    for attribute in dir(torch):
        value = getattr(torch, attribute, None)
        if isinstance(value, torch.dtype):
            names[("torch", attribute)] = value
    return names


ALLOWED_METADATA_NAMES = _exact_names()


class MetadataUnpickler(pickle._Unpickler):
    """The pure-Python unpickler (its opcodes can be overridden; the C one's cannot),
    resolving only exact names and letting BUILD fill only instances of DCP's records.

    BUILD would otherwise set attributes on whatever is on the stack: on an
    allowed class or function, for the whole process (``PosixPath.name``,
    ``Metadata.planner_data``), which a later save would act on.
    """

    def find_class(self, module: str, name: str) -> Any:
        found = ALLOWED_METADATA_NAMES.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from checkpoint metadata")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refusing a persistent id in checkpoint metadata")

    def load_build(self) -> None:
        state, target = self.stack[-1], self.stack[-2]
        fields = _BUILDABLE.get(type(target))
        if fields is None:
            raise pickle.UnpicklingError(f"refusing to set the state of {describe(target)} from checkpoint metadata")
        if "__setstate__" in vars(type(target)):  # TensorProperties: a tuple of its fields, in order
            well_formed = isinstance(state, tuple) and len(state) == len(fields)
        else:
            well_formed = isinstance(state, dict) and all(isinstance(k, str) and k in fields for k in state)
        if not well_formed:
            raise pickle.UnpicklingError(
                f"refusing a malformed state for {type(target).__name__} in checkpoint metadata"
            )
        super().load_build()

    def _track_tuple(self) -> None:
        """Tuples nested deeper than any DCP record needs are refused: hashing a tuple (a dict
        key) recurses in C without a depth guard, and a million-deep one crashes the process."""
        built = self.stack[-1]
        depth = 1 + max((self._tuple_depths.get(id(item), 0) for item in built), default=0)
        if depth > _MAX_TUPLE_DEPTH:
            raise pickle.UnpicklingError(
                f"refusing tuples nested more than {_MAX_TUPLE_DEPTH} deep in checkpoint metadata"
            )
        self._tuple_depths[id(built)] = depth
        self._kept.append(built)  # ids stay unique while tracked

    def _tracking(load: Any) -> Any:  # noqa: N805 - a decorator inside the class body
        def tracked(self: "MetadataUnpickler") -> None:
            if not hasattr(self, "_tuple_depths"):
                self._tuple_depths: dict[int, int] = {}
                self._kept: list[Any] = []
            load(self)
            self._track_tuple()

        return tracked

    dispatch = dict(pickle._Unpickler.dispatch)
    dispatch[pickle.BUILD[0]] = load_build
    for _opcode, _load in (
        (pickle.TUPLE, pickle._Unpickler.load_tuple),
        (pickle.TUPLE1, pickle._Unpickler.load_tuple1),
        (pickle.TUPLE2, pickle._Unpickler.load_tuple2),
        (pickle.TUPLE3, pickle._Unpickler.load_tuple3),
    ):
        dispatch[_opcode[0]] = _tracking(_load)
    del _opcode, _load


def describe(value: Any) -> str:
    if isinstance(value, type):
        return f"the class {value.__module__}.{value.__qualname__}"
    return f"a {type(value).__name__}"


def unpickle_metadata(data: bytes, file: Path) -> dcp_metadata.Metadata:
    """DCP's ``.metadata`` from ``data`` (read from ``file``), or CheckpointError saying why not."""
    try:
        metadata = MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as error:  # noqa: BLE001 - any failure means the file is unusable
        raise CheckpointError(f"{file} is corrupt or not DCP metadata ({type(error).__name__}: {error}).") from error
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointError(f"{file} is not DCP metadata (found {type(metadata).__name__}).")
    return metadata


def _numpy_globals() -> list[Any]:
    """numpy arrays, scalars and dtypes, which users keep in their extra state (Lightning's
    ``on_save_checkpoint``) and DDP's ``torch.save`` keeps: exact names, each a constructor of plain
    data (an object array's elements still go through the same allow-list). Under numpy 1's module
    name too, so a file written with either loads with both."""
    try:
        import numpy
        import numpy.dtypes
    except ImportError:  # nothing of numpy can be in a file we wrote, and what a hostile one holds is refused
        return []
    multiarray = numpy._core.multiarray if hasattr(numpy, "_core") else numpy.core.multiarray
    allowed: list[Any] = [numpy.ndarray, numpy.dtype]
    allowed += [getattr(numpy.dtypes, name) for name in dir(numpy.dtypes) if name.endswith("DType")]
    for name in ("_reconstruct", "scalar"):
        constructor = getattr(multiarray, name)
        allowed += [(constructor, f"numpy.core.multiarray.{name}"), (constructor, f"numpy._core.multiarray.{name}")]
    return allowed


def weights_only_load(data: bytes) -> Any:
    """``torch.load(weights_only=True)``: torch's allow-list, and numpy's plain data."""
    with torch.serialization.safe_globals(_numpy_globals()):
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def load_weights_only(data: bytes, file: Path, what: str) -> Any:
    """``torch.load(weights_only=True)`` of a small file's bytes, or CheckpointError with the reason."""
    if not data:
        raise CheckpointError(f"{file} is empty: {what} cannot be restored from it.")
    try:
        return weights_only_load(data)
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"{file} holds objects that only arbitrary code could rebuild; refusing to load it "
            f"({refusal_reason(error)}). If you wrote it yourself with custom classes, register them with "
            "torch.serialization.add_safe_globals."
        ) from error
    except Exception as error:  # noqa: BLE001 - truncated zip, bad header, ...
        raise CheckpointError(
            f"{file} is corrupt ({type(error).__name__}: {error}); {what} cannot be restored."
        ) from error


def refusal_reason(error: Exception) -> str:
    """The part of torch's refusal that names the object, without its advice to
    retry with ``weights_only=False`` (the one thing not to do with a hostile file)."""
    text = str(error)
    marker = "WeightsUnpickler error: "
    if marker in text:
        return text.split(marker, 1)[1].split(". Please", 1)[0].split("\n", 1)[0].strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines:
        if "GLOBAL" in line or "unsupported" in line.lower():
            return line
    advice = ("Weights only load failed", "Check the documentation", "(1)", "(2)")
    return next((line for line in lines if not line.startswith(advice)), type(error).__name__)
