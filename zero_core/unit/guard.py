"""Stage-3 parameters at rest: every read is either answered correctly or refused clearly.
(Stages 1/2 use the same guard between a step and the next forward, while the
post-step all-gather may still write the values: any touch waits for it.)

At rest a unit's full parameters have no storage (storage.py): each
parameter is a full-shape view of a storage shrunk to 0 bytes, and a kernel
that reads it reads freed memory. So while its unit is released, each
parameter's class is switched to a guard subclass of its own class whose
``__torch_function__``:

- lets metadata through (shape, dtype, device, requires_grad, grad, hooks);
- answers conversions that change nothing (``model.to(same_device)``)
  with the parameter itself, as torch does;
- prints a description instead of values;
- writes ``copy_`` of full values into this rank's shard (no communication:
  every rank holds the full source), which is how ``load_state_dict``
  loads a sharded model;
- hands ``detach()`` the full value while ``state_dict()`` exports it;
- answers ``torch.equal`` from metadata, or exactly from digests inside
  ``engine.comparable_parameters()`` (``ParameterDigests``, at the end of this file);
- refuses everything else with :class:`ParameterAtRestError`, naming the
  ways to get full values.

Switching the class, rather than swapping the registered parameter objects
as FSDP2 does, keeps every reference a user holds (param groups, lists of
frozen parameters) pointing at the one object. While its unit is gathered a
parameter has its own class again, so the forward pays nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Sequence
from typing import Any, Callable, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor


class ParameterAtRestError(RuntimeError):
    """A stage-3 parameter was read while its values are sharded across the ranks.

    What it means: between uses, a stage-3 parameter's values are split across the ranks and no rank
    holds them whole, so reading or editing it outside a forward of the module that owns it (an
    ``other_module.weight`` used from elsewhere, ``param.sum()`` or ``param.add_(...)`` in the training
    loop) is refused rather than computing with freed memory. Its metadata
    (shape, dtype, device, ``requires_grad``) stays readable, and ``load_state_dict`` still loads into
    it. The message names the parameter and its unit.

    What to do: read or edit parameters inside ``with engine.gathered_parameters():`` (every rank
    enters together); take full values with ``engine.full_state_dict()`` or ``model.state_dict()``
    (every rank calls); load them with ``model.load_state_dict()`` or ``engine.load_full_state_dict()``;
    or use the parameter only inside the forward of the module that registers it (or one containing
    it), choosing a wrap policy whose unit contains every module that uses a shared parameter.
    """


_GETTERS = (
    "shape",
    "dtype",
    "device",
    "requires_grad",
    "grad",
    "_grad",
    "is_leaf",
    "grad_fn",
    "ndim",
    "layout",
    "is_cuda",
    "is_cpu",
    "is_meta",
    "is_sparse",
    "is_quantized",
    "is_mkldnn",
    "is_nested",
    "is_xpu",
    "is_mps",
    "names",
    "name",
    "output_nr",
    "_version",
    "retains_grad",
    "itemsize",
    "nbytes",
    "_backward_hooks",
    "_post_accumulate_grad_hooks",
    "is_sparse_csr",
    "_cdata",
    "grad_dtype",
)
_SETTERS = ("requires_grad", "grad", "_grad", "_backward_hooks", "_post_accumulate_grad_hooks")
_METHODS = (
    "size",
    "dim",
    "numel",
    "nelement",
    "element_size",
    "stride",
    "is_contiguous",
    "get_device",
    "is_floating_point",
    "is_complex",
    "is_signed",
    "requires_grad_",
    "register_hook",
    "register_post_accumulate_grad_hook",
    "_has_compatible_shallow_copy_type",
    "__len__",
    "is_inference",
    "storage_offset",
    "retain_grad",
    "is_shared",
    "_is_view",
    "__hash__",
    # The 0-byte storage itself is safe to hand out: reads through it are bounds-checked.
    "untyped_storage",
    "data_ptr",
    "is_conj",
    "is_neg",
)
_TORCH_FUNCTIONS = (torch.numel, torch.is_floating_point, torch.is_complex, torch._has_compatible_shallow_copy_type)

_METADATA: frozenset[Any] = frozenset(
    [getattr(torch._C.TensorBase, name).__get__ for name in _GETTERS if hasattr(torch._C.TensorBase, name)]
    + [getattr(torch._C.TensorBase, name).__set__ for name in _SETTERS if hasattr(torch._C.TensorBase, name)]
    + [getattr(torch.Tensor, name) for name in _METHODS if hasattr(torch.Tensor, name)]
    + list(_TORCH_FUNCTIONS)
)

_DATA_SETTER = torch._C.TensorBase.data.__set__  # a new, equal object on each access: compare with ==


def _parse_to(self: torch.Tensor, *args: Any, copy: bool = False, **kwargs: Any) -> tuple[Any, Any]:
    device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    if copy or memory_format not in (None, torch.preserve_format):
        return "copy", None  # never a no-op: refused
    return device, dtype


# Conversions that return the parameter itself when they change nothing.
_CONVERSIONS: dict[Any, Callable[..., tuple[Any, torch.dtype | None]]] = {
    torch.Tensor.to: _parse_to,
    torch.Tensor.cpu: lambda self, *a, **k: (torch.device("cpu"), None),
    torch.Tensor.cuda: lambda self, device=None, *a, **k: (torch.device("cuda" if device is None else device), None),
    torch.Tensor.float: lambda self, *a, **k: (None, torch.float32),
    torch.Tensor.double: lambda self, *a, **k: (None, torch.float64),
    torch.Tensor.half: lambda self, *a, **k: (None, torch.float16),
    torch.Tensor.bfloat16: lambda self, *a, **k: (None, torch.bfloat16),
    torch.Tensor.type_as: lambda self, other, *a, **k: (other.device, other.dtype),
}


def _describe(func: Any) -> str:
    name = getattr(func, "__name__", None) or repr(func)
    if name in ("__get__", "__set__"):
        return f"its attribute '{getattr(getattr(func, '__self__', None), '__name__', '?')}'"
    return f"'{name}'"


def _same_device(wanted: Any, actual: torch.device) -> bool:
    if wanted is None:
        return True
    return isinstance(wanted, torch.device) and wanted.type == actual.type and wanted.index in (None, actual.index)


class GuardedUnit(Protocol):
    """What the guard needs of the unit whose parameters it guards."""

    label: str

    @property
    def refreshing(self) -> bool: ...  # stages 1/2: the post-step all-gather may still write the values

    def wait_gathered(self) -> None: ...

    def write_param(self, param: nn.Parameter, full_value: torch.Tensor) -> bool: ...

    def slot_of(self, param: nn.Parameter) -> int: ...

    def name_of(self, param: nn.Parameter) -> str: ...


class ParameterGuard:
    """One unit's guard: its parameters' guard classes, switching them, and their ``__torch_function__``."""

    def __init__(
        self, unit: GuardedUnit, params: list[nn.Parameter], guarding: bool, comparisons: ParameterDigests | None
    ):
        self.unit = unit
        self.params = params
        self.exported: dict[int, torch.Tensor] | None = None  # slot index -> full value, during state_dict()
        self.digests = comparisons
        self._own_classes = [type(p) for p in params]
        self.guard_classes = {cls: guard_class(cls, self) for cls in set(self._own_classes)}
        self._guarding = guarding  # stage 3: parameters take their guard classes at rest
        self._classes_guarded = False  # the parameters have their own classes now

    def guard(self, on: bool) -> None:
        """Stage 3: parameters without storage refuse reads (on) or are ordinary again (off)."""
        self.switch(on and self._guarding)

    def switch(self, guarded: bool) -> None:
        """Give the parameters their guard classes (or their own back), whatever the stage."""
        if guarded == self._classes_guarded:
            return  # nothing to switch: no loop over the parameters on the hot path
        for param, own_class in zip(self.params, self._own_classes):
            param.__class__ = self.guard_classes[own_class] if guarded else own_class
        self._classes_guarded = guarded

    def stop_guarding(self) -> None:
        """The parameters are ordinary tensors of their own for good (``unshard``)."""
        self.guard(False)
        self._guarding = False

    def __call__(self, func: Any, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA:
            return self._plain(func, args, kwargs)
        if self.unit.storage.refreshing:
            # Stages 1/2 between a step and the unit's next forward: wait for the values,
            # which gives the parameters their own class back, then run as usual.
            self.unit.storage.wait_gathered()
            return func(*args, **kwargs)
        param = next((a for a in args if self.owns(a)), None)
        if param is None:  # a resting parameter inside a container argument (torch.cat([...]), say)
            param = next((a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if self.owns(a)), None)
        if func in (torch.Tensor.__repr__, torch.Tensor.__format__):
            return self._description(param)
        if func in _CONVERSIONS and args and args[0] is param:
            device, dtype = _CONVERSIONS[func](*args, **kwargs)
            if _same_device(device, param.device) and dtype in (None, param.dtype):
                return param
            raise self.error(
                param,
                "cannot be moved or cast after sharding: move and cast the model "
                "before building the engine (choose dtypes with MixedPrecision)",
            )
        if func == _DATA_SETTER and args[1] is args[0]:
            return None  # module._apply() setting a parameter's data to itself
        if func is torch.Tensor.copy_ and args[0] is param and self.unit.write_param(param, args[1]):
            return param
        if func is torch.Tensor.detach and self.exported is not None and param is args[0]:
            return self.exported[self.unit.slot_of(param)]
        if func in (torch.equal, torch.Tensor.equal) and len(args) == 2:
            return self._equal(param, *args)
        raise self.error(param, f"cannot be read by {_describe(func)}")

    def _equal(self, param: nn.Parameter, a: Any, b: Any) -> bool:
        """``torch.equal``: from metadata where it decides, else from the digests of a
        ``comparable_parameters()`` stretch (exact, NaN included), else refused."""
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape != b.shape:
            return False
        digests = self.digests
        if digests is not None and digests.active and digests.knows(a) and digests.knows(b):
            return digests.equal(a, b)
        if a is b:
            return True  # as torch.equal answers unless the parameter holds NaN
        raise self.error(
            param,
            "cannot be compared by torch.equal with another tensor of its shape outside "
            "`with engine.comparable_parameters():` (every rank enters together; Lightning's strategy "
            "opens it around BaseFinetuning callbacks' epoch hook)",
        )

    def owns(self, value: Any) -> bool:
        return isinstance(value, nn.Parameter) and type(value) in self.guard_classes.values()

    @staticmethod
    def _plain(func: Any, args: tuple, kwargs: dict) -> Any:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def _description(self, param: nn.Parameter) -> str:
        return (
            f"Parameter '{self.unit.name_of(param)}' sharded at rest by ZeRO-3 (shape {tuple(param.shape)}, "
            f"{param.dtype}, {param.device}); read it inside engine.gathered_parameters()"
        )

    def error(self, param: nn.Parameter | None, what: str) -> ParameterAtRestError:
        name = (
            f"'{self.unit.name_of(param)}' of {self.unit.label}"
            if param is not None
            else f"a parameter of {self.unit.label}"
        )
        return ParameterAtRestError(
            f"ZeRO-3 parameter {name} {what}: between uses its values are sharded across the ranks and "
            "not held by any one of them. Read or edit parameters inside `with engine.gathered_parameters():` "
            "(every rank enters together), take full values with engine.full_state_dict() or "
            "model.state_dict() (every rank calls), load them with model.load_state_dict() or "
            "engine.load_full_state_dict(), or run them inside a call of the unit's module or of a module "
            "outside the units (the unit is gathered for it)."
        )


# DTensor's own methods that read the local piece without passing through __torch_function__.
_DTENSOR_READS = ("to_local", "full_tensor", "redistribute", "__repr__")


def _dtensor_reads(param_class: type[nn.Parameter], guard: ParameterGuard) -> dict[str, Callable[..., Any]]:
    """A resting tensor-parallel parameter's local piece has no storage either: these refuse too."""
    if not issubclass(param_class, DTensor):
        return {}

    def guarded(name: str) -> Callable[..., Any]:
        own = getattr(param_class, name)

        def read(self: nn.Parameter, *args: Any, **kwargs: Any) -> Any:
            if guard.unit.storage.refreshing:
                guard.unit.storage.wait_gathered()  # stages 1/2: the values arrive, then read as usual
                return own(self, *args, **kwargs)
            if name == "__repr__":
                return guard._description(self)
            raise guard.error(self, f"cannot be read by '{name}'")

        return read

    return {name: guarded(name) for name in _DTENSOR_READS}


def guard_class(param_class: type[nn.Parameter], guard: ParameterGuard) -> type[nn.Parameter]:
    """The at-rest class of parameters of ``param_class`` in the guarded unit."""

    def deepcopy(self: nn.Parameter, memo: dict) -> nn.Parameter:
        # Parameter.__deepcopy__ makes type(self) of the copy: waiting first gives the
        # parameter its own class back (stages 1/2); at rest (stage 3) reading it is refused.
        if guard.unit.storage.refreshing:
            guard.unit.storage.wait_gathered()
        return param_class.__deepcopy__(self, memo)

    return type(
        param_class.__name__,
        (param_class,),
        {
            "__torch_function__": classmethod(lambda cls, *a, **k: guard(*a, **k)),
            "__deepcopy__": deepcopy,
            **_dtensor_reads(param_class, guard),
        },
    )


# ---------------------------------------------------------------- digests: torch.equal answered exactly
# ``torch.equal`` between two stage-3 parameters at rest, answered exactly.
#
# No rank holds a resting parameter's values, so comparing two of them needs
# communication, which a tensor operation may only start where every rank runs
# the same code. ``engine.comparable_parameters()`` marks such a stretch (every
# rank enters it together; Lightning's strategy wraps ``BaseFinetuning``'s
# epoch hook in it, whose ``filter_on_optimizer`` compares parameters this
# way). Inside, the first comparison that metadata cannot settle gathers the
# model once, unit by unit as ``full_state_dict`` does, and keeps one SHA-256 per
# parameter; comparisons are then answered from those until the values change
# (every rank changes them alike, so every rank gathers again alike). Outside,
# such a comparison is refused (``guard.py``).
#
# Exact: ``torch.equal`` compares values, and equal bytes are equal values
# except for two cases handled here: ``-0.0 == 0.0`` (normalised by adding
# ``0.0``) and NaN, which equals nothing (recorded as no digest).


class DigestedUnit(Protocol):
    """What digests need of a unit: its parameters and their full master values."""

    params: list[nn.Parameter]

    @property
    def resting_master(self) -> torch.Tensor: ...

    def gather_full_master(self) -> torch.Tensor: ...

    def full_param_views(self, full: torch.Tensor) -> list[torch.Tensor]: ...


class ParameterDigests:
    """Made before the units (each unit's guard asks it), told the units once they exist (``track``)."""

    def __init__(self) -> None:
        self.units: Sequence[DigestedUnit] = ()
        self._ids: set[int] = set()
        self.active = False
        self._digests: dict[int, bytes | None] | None = None  # id(param) -> digest; None: holds NaN
        self._computed_at: list[int] = []  # each master shard's version counter when they were computed

    def track(self, units: Sequence[DigestedUnit]) -> None:
        self.units = units
        self._ids = {id(p) for unit in units for p in unit.params}

    @contextlib.contextmanager
    def comparable(self) -> Iterator[None]:
        if self.active:  # nested: the outer stretch owns the digests
            yield
            return
        self.active = True
        try:
            yield
        finally:
            self.active = False
            self._digests = None  # parameters change after the stretch: never reuse digests

    def knows(self, tensor: object) -> bool:
        return isinstance(tensor, torch.nn.Parameter) and id(tensor) in self._ids

    def equal(self, a: torch.nn.Parameter, b: torch.nn.Parameter) -> bool:
        # Any write to the values (a step, a load, gathered_parameters' write-back) bumps a master
        # shard's version counter, which its views share: digests from before it are stale.
        # (Of the master as it rests: a version needs no values, and its file may hold them.)
        versions = [unit.storage.resting_master._version for unit in self.units]
        if self._digests is None or versions != self._computed_at:
            self._digests, self._computed_at = self._compute(), versions
        digest_a, digest_b = self._digests[id(a)], self._digests[id(b)]
        return digest_a is not None and digest_a == digest_b

    def _compute(self) -> dict[int, bytes | None]:
        digests: dict[int, bytes | None] = {}
        for unit in self.units:
            full = unit.storage.gather_full_master()
            for param, view in zip(unit.params, unit.full_param_views(full)):
                value = (view.to(param.dtype) + 0.0).reshape(-1).cpu()
                if torch.isnan(value).any():
                    digests[id(param)] = None
                    continue
                digest = hashlib.sha256(f"{param.dtype} {tuple(param.shape)}".encode())
                digest.update(value.view(torch.uint8).numpy())
                digests[id(param)] = digest.digest()
            del full
        return digests
