"""Typed, frozen configuration for the ZeRO core, validated on construction.

Every field has a safe default; a bad value raises ``ValueError`` naming the
field and what to do, before any model state is touched.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field, fields
from functools import cache

from .memory_budget import (
    MemoryBudget,
    MemoryBudgetLike,
    as_memory_budget,
    budget_of_setting,
    check_memory_budget,
    format_memory_budget_text,
    memory_budget_of_text,
    parse_memory_budget_text,
)
from .offload_plan import OFFLOAD_MODES, OffloadPlan, check_offload
from .precision import SKIPS_DOC, MixedPrecision, check_loss_scaling
from .settings import (
    SETTING_KEY,
    KeywordForm,
    Setting,
    TextSpelling,
    check_flags,
    complete,
    is_count,
    join_names,
    parse_bool,
    parse_class_names,
    parse_optional_int,
    parse_prefetch,
    setting,
)
from .stage_plan import StagePlan
from .wire_plan import WirePlan, check_wire
from .wrap_policy import WrapPolicy, WrapPolicyLike, as_wrap_policy, wrap_policy_of_names

__all__ = ["OFFLOAD_MODES", "ZeroConfig", "user_settings"]  # OFFLOAD_MODES: offload_plan.py


@dataclass(frozen=True)
class ZeroConfig:
    """The handful of knobs of the ZeRO core.

    Each user-facing field is declared once, with :func:`zero_core.settings.setting` (its one-line doc, its text
    form, an example); :func:`user_settings` lists them, and the Lightning, Fabric and Accelerate adapters are
    generated from that list. ``mixed_precision`` is not among them: each framework's own precision flag sets it.
    """

    stage: int = setting(
        3,
        doc="1 shards optimizer state, 2 also gradients, 3 also parameters",
        values="1, 2 or 3",
        parse=int,
        example=2,
        # --zero_stage is Accelerate's DeepSpeed flag.
        flag="--zero_sharding_stage",
    )
    # zero_core.fit at setup (memory/fit.py): the stage, prefetch, offload and activation checkpointing chosen for
    # this memory per rank from the model and one sample batch; the engine runs what it chose (engine.config).
    memory_budget: MemoryBudget | None = setting(
        None,
        doc="choose the stage, prefetch, offload and activation checkpointing at setup to fit this memory per rank, "
        "measured on the model's example_input_array: a size (\"20GiB\", the device's), parts "
        '("device=20GiB,host=200GiB,disk=2TB") or "auto" (the device\'s own); none: the settings as given',
        values='a size, device=/host=/disk= sizes, "auto", or none',
        parse=parse_memory_budget_text,
        format=format_memory_budget_text,
        example="device=8GiB",
        # Lightning and Fabric take a MemoryBudget, a size or its text; Accelerate's text is kept in its exact
        # spelling ("20GiB" reads as "device=20GiB"), read into a MemoryBudget when the config is made.
        keyword=KeywordForm(annotation=MemoryBudgetLike, default=None, to_config=as_memory_budget),
        text=TextSpelling(
            name="memory_budget",
            annotation=str | None,
            default=None,
            normalize=parse_memory_budget_text,
            resolve=memory_budget_of_text,
        ),
    )
    # The size-based wrap policy claims a module once its unclaimed parameters reach this size.
    bucket_size_mb: float = setting(
        25.0,
        doc="target size (MiB) of a unit, and so of one reduce-scatter, when units are chosen by size",
        values="a number > 0",
        parse=float,
        example=8.0,
    )
    # "auto": 1 until the first optimizer step, then chosen from the gather and compute
    # times measured in the next steps (prefetch_tuning.py), within prefetch_cap_mb.
    prefetch: int | str = setting(
        1,
        doc='stage 3: units all-gathered ahead of the one computing (0: off), or "auto" (from measured times)',
        values='an integer >= 0, or "auto"',
        parse=parse_prefetch,
        example="auto",
    )
    prefetch_cap_mb: float = setting(
        256.0,
        doc='with prefetch "auto": the most memory (MiB) the units gathered ahead may take',
        values="a number > 0 (inf: no cap)",
        parse=float,
        example=64.0,
    )
    mixed_precision: MixedPrecision = field(default_factory=MixedPrecision)
    # fp16 loss scaling: DeepSpeed's fp16 keys, with its meaning; the defaults are torch GradScaler's values
    # (precision.py checks them, optim/loss_scaling.py runs them). Without fp16 they change nothing.
    loss_scale: float = setting(
        0.0,
        doc="fp16: a fixed loss scale (an overflow still skips its step); 0: dynamic",
        values="a number >= 0",
        parse=float,
        example=1024.0,
    )
    initial_loss_scale: float = setting(
        2.0**16,
        doc="fp16, dynamic: the loss scale of the first step",
        values="a number > 0",
        parse=float,
        example=1024.0,
    )
    loss_scale_window: int = setting(
        2000,
        doc="fp16, dynamic: the scale doubles once this many steps since the last overflow ran clean, and "
        "again every this many",
        values="an integer >= 1",
        parse=int,
        example=1000,
    )
    loss_scale_hysteresis: int = setting(
        1,
        doc="fp16, dynamic: the overflows that halve the scale only at the last (1: each one)",
        values="an integer >= 1",
        parse=int,
        example=2,
    )
    consecutive_hysteresis: bool = setting(
        False,
        doc="fp16, dynamic: refill the hysteresis after each clean step, not only when the scale doubles",
        values="true or false",
        parse=parse_bool,
        example=True,
    )
    min_loss_scale: float = setting(
        0.0,
        doc="fp16, dynamic: the scale halves no lower; an overflow at it stops the run; 0: no floor",
        values="a number >= 0",
        parse=float,
        example=1.0,
    )
    skip_nonfinite_steps: bool = setting(False, doc=SKIPS_DOC, values="true or false", parse=parse_bool, example=True)
    # Without classes, units are chosen by size (bucket_size_mb); what no unit claims is the root unit's.
    wrap_policy: WrapPolicy = setting(
        default_factory=WrapPolicy,
        doc="the module classes that become units (transformer blocks; Accelerate: their class names); "
        "none: units chosen by size",
        values="module classes (Accelerate: class names), or none",
        parse=parse_class_names,
        format=join_names,
        example=("GPTBlock",),
        # Lightning and Fabric take a class, classes or a WrapPolicy; Accelerate's text can only
        # name classes, which are looked up in the model when it is sharded.
        keyword=KeywordForm(annotation=WrapPolicyLike, default=None, to_config=as_wrap_policy),
        text=TextSpelling(
            name="wrap_classes",
            annotation=tuple[str, ...],
            default=(),
            normalize=parse_class_names,
            resolve=wrap_policy_of_names,
        ),
    )
    broadcast_buffers: bool = setting(
        True,
        doc="broadcast buffers (BatchNorm statistics) from rank 0 before each training forward, as DDP does",
        values="true or false",
        parse=parse_bool,
        example=False,
    )
    # Faster, but a plain tensor view of a parameter kept from before the step (a cached
    # p.detach()/p.data, a kept state_dict()) may show old values until its unit's next
    # forward (or any touch of a parameter object) waits for its own all-gather. Off: the
    # step waits, as DDP's values are current.
    overlap_param_refresh: bool = setting(
        False,
        doc="stages 1/2: return from the optimizer step before the updated parameters are all-gathered",
        values="true or false",
        parse=parse_bool,
        example=True,
    )
    # FSDP's HYBRID_SHARD, DeepSpeed's MiCS: parameters are all-gathered and gradients
    # reduce-scattered inside a group (consecutive ranks, one node's as torchrun numbers
    # them); only the gradient shards are all-reduced across groups. Memory per rank
    # follows the formulas with this size in place of the world size.
    shard_group_size: int | None = setting(
        None,
        doc="hybrid sharding: shard inside groups of this many consecutive ranks (usually one node's) and "
        "replicate across them; None: one group of every rank",
        values="an integer >= 1 dividing the data-parallel size, or none",
        parse=parse_optional_int,
        example=2,
    )
    # A 2-D mesh (data_parallel × tensor_parallel, mesh.py): each layer split across this many consecutive
    # ranks by the model's own parallelize_module, ZeRO sharding across the other dimension. The core takes
    # the mesh itself (ZeroEngine(device_mesh=...)); the Lightning strategy builds it from this size.
    tensor_parallel_size: int = setting(
        1,
        doc="tensor parallelism: split each layer across this many consecutive ranks (a 2-D device mesh, "
        "handed to configure_model as self.device_mesh) and shard across the rest; 1: none",
        values="an integer >= 1 dividing the world size",
        parse=int,
        example=2,
    )
    # DeepSpeed's stage3_param_persistence_threshold: no all-gathers in forward or backward
    # for those units, their gradients still reduce-scattered, their parameters all-gathered
    # once after each step, as in stage 2. Memory: 16Ψ_L/N + 4Ψ_S + 12Ψ_S/N for traffic
    # 3Ψ_L + 2Ψ_S (fp32, Adam; L: the large units, S: the small ones).
    persistence_threshold: int = setting(
        0,
        doc="stage 3: units with fewer parameters than this stay gathered between steps; 0: every unit sharded",
        values="an integer >= 0",
        parse=int,
        example=1000,
    )

    # ZeRO-Offload: the optimizer steps offloaded units on the host; "nvme" (ZeRO-Infinity): their per-element
    # state lives in files between steps, a few units in memory during it (offload/state_files.py).
    offload_optimizer: str = setting(
        "none",
        doc='"cpu": the fp32 master shard, optimizer state and gradient shard in host memory, the step on the '
        'host; "nvme": likewise, with the optimizer state in files under offload_dir between steps; '
        '"none": on the device',
        values='"none", "cpu" or "nvme"',
        parse=str,
        example="nvme",
    )
    # Stage 3: a sharded unit's parameter shard rests on the host (or in a file: offload/shard_files.py), staged to
    # the device per gather (unit/storage.py).
    offload_params: str = setting(
        "none",
        doc='stage 3: "cpu": the parameter shards at rest in host memory, copied to the device for each '
        'gather; "nvme": in files under offload_dir, read back for each gather; "none": on the device',
        values='"none", "cpu" or "nvme" (stage 3)',
        parse=str,
        example="nvme",
    )
    # The paper's P_a+cpu (passes/activation_offload.py; with partition_activations only the slices are kept).
    offload_activations: bool = setting(
        False,
        doc="keep what each unit's forward saves for backward in host memory until backward needs it "
        "(a CPU device: nothing moves)",
        values="true or false",
        parse=parse_bool,
        example=True,
    )
    # The paper's P_a: an activation-checkpointed block's inputs split across the tensor-parallel ranks
    # (passes/partitioned_activations.py).
    partition_activations: bool = setting(
        False,
        doc="with tensor parallelism: each checkpointed block (torch's checkpoint_wrapper) keeps 1/TP of its "
        "inputs for backward, all-gathered across the tensor-parallel ranks before it is recomputed",
        values="true or false",
        parse=parse_bool,
        example=True,
    )
    offload_dir: str | None = setting(
        None,
        doc="with offload_optimizer or offload_params 'nvme': the directory (on a fast local disk) for the "
        "per-run scratch files",
        values="a directory path, or none",
        parse=lambda text: None if text.strip().lower() in ("", "none") else text,
        example="/local_nvme",
    )
    offload_fraction: float = setting(
        1.0,
        doc="with offload_optimizer: the share of the optimizer state offloaded, largest units first; "
        "the rest stays on the device (nvme: in memory)",
        values="a number in (0, 1]",
        parse=float,
        example=0.5,
    )
    offload_units_in_memory: int = setting(
        2,
        doc="with 'nvme' offload: the most units whose optimizer state (and, apart, whose parameter shards "
        "waiting to be written) are in memory at once",
        values="an integer >= 1",
        parse=int,
        example=3,
    )

    # ZeRO-Offload's overlap: each offloaded unit steps on the host as soon as its gradient shard is final
    # (passes/step_in_backward.py); nothing may touch the gradients or hyperparameters between backward and step.
    offload_step_in_backward: bool = setting(
        False,
        doc="with offload_optimizer: each offloaded unit steps on the host while backward goes on; clipping, "
        "fp16 and changing hyperparameters between backward and optimizer.step() are then refused",
        values="true or false",
        parse=parse_bool,
        example=True,
    )

    # checkpoint/background_save.py: every adapter's saves (Lightning's, Fabric's, save_state, ZeroTrainer's)
    # return once the state is in host memory; the next save, a load, or the end of training waits for them.
    asynchronous_checkpoints: bool = setting(
        False,
        doc="save checkpoints in the background: the state copied to host memory, the files written while "
        "training goes on, the directory complete only once every rank's write succeeded; a failed write is "
        "raised on every rank at the next optimizer step, save or load",
        values="true or false",
        parse=parse_bool,
        example=True,
    )
    asynchronous_checkpoints_fallback: bool = setting(
        False,
        doc="an asynchronous save that host memory cannot stage is written synchronously instead (a warning "
        "with the numbers), rather than refused; every rank decides alike",
        values="true or false",
        parse=parse_bool,
        example=True,
    )

    # ZeRO++ (wire_plan.py): the compute gathers' values quantized on the wire; the masters stay exact.
    quantize_weights: bool = setting(
        False,
        doc="stage 3 (ZeRO++'s qwZ): the forward's and backward's parameter all-gathers carry int8 blocks with "
        "an fp32 scale each (about half of bf16's bytes); the fp32 masters, checkpoints and exports stay exact",
        values="true or false (stage 3)",
        parse=parse_bool,
        example=True,
    )
    secondary_shard_group_size: int | None = setting(
        None,
        doc="stage 3 (ZeRO++'s hpZ): after its forward each unit stays in pieces over groups of this many "
        "consecutive ranks (a node), so its backward's all-gather stays inside the group; the same numbers, "
        "P/k more parameter elements per unit until its backward; None: off",
        values="an integer >= 1 dividing the shard group and smaller than it, or none (stage 3)",
        parse=parse_optional_int,
        example=8,
    )
    quantize_gradients: bool = setting(
        False,
        doc="stages 2 and 3 (ZeRO++'s qgZ): gradients reduce as all-to-alls of int4 (or int8) blocks with an "
        "fp32 scale each, summed in fp32; in two hops (inside, then across secondary groups) with "
        "secondary_shard_group_size, and quantized across shard groups under hybrid sharding",
        values="true or false (stages 2 and 3)",
        parse=parse_bool,
        example=True,
    )
    gradient_quantization_bits: int = setting(
        4,
        doc="with quantize_gradients: the bits per gradient value on the wire (4: a quarter of bf16's bytes, "
        "as ZeRO++; 8: half, closer values)",
        values="4 or 8",
        parse=int,
        example=8,
    )
    quantization_block_size: int = setting(
        128,
        doc="with quantize_weights or quantize_gradients: the elements per quantization block, each sending "
        "one fp32 scale (smaller: closer values, more scales)",
        values="an integer >= 1",
        parse=int,
        example=512,
    )

    def __post_init__(self) -> None:
        if self.stage not in (1, 2, 3):
            raise ValueError(
                f"ZeroConfig.stage={self.stage!r} is invalid; use 1 (optimizer state), "
                "2 (+ gradients) or 3 (+ parameters)."
            )
        if not self.bucket_size_mb > 0:
            raise ValueError("ZeroConfig.bucket_size_mb must be > 0 (the default is 25).")
        if self.prefetch != "auto" and not is_count(self.prefetch, minimum=0):
            raise ValueError(
                f"ZeroConfig.prefetch={self.prefetch!r} is invalid: use an integer >= 0 (0 turns prefetch off) "
                'or "auto" (chosen from measured times).'
            )
        if not 0 < self.prefetch_cap_mb <= float("inf") or isinstance(self.prefetch_cap_mb, bool):
            raise ValueError("ZeroConfig.prefetch_cap_mb must be > 0 (the default is 256; float('inf') for no cap).")
        if not isinstance(self.mixed_precision, MixedPrecision):
            raise ValueError("ZeroConfig.mixed_precision must be a zero_core.MixedPrecision.")
        check_loss_scaling(self)
        if not isinstance(self.wrap_policy, WrapPolicy):
            raise ValueError("ZeroConfig.wrap_policy must be a zero_core.WrapPolicy.")
        flags = ("overlap_param_refresh", "broadcast_buffers", "skip_nonfinite_steps", "asynchronous_checkpoints")
        check_flags(self, (*flags, "asynchronous_checkpoints_fallback"))
        if not is_count(self.persistence_threshold, minimum=0):
            raise ValueError(
                f"ZeroConfig.persistence_threshold={self.persistence_threshold!r} is invalid: "
                "use a number of parameters >= 0 "
                "(stage-3 units smaller than it stay gathered; 0 keeps every unit sharded)."
            )
        if self.shard_group_size is not None and not is_count(self.shard_group_size, minimum=1):
            raise ValueError(
                f"ZeroConfig.shard_group_size={self.shard_group_size!r} is invalid: "
                "use a positive number of ranks that divides "
                "the world size (usually the devices per node), or None to shard across every rank."
            )
        if not is_count(self.tensor_parallel_size, minimum=1):
            raise ValueError(
                f"ZeroConfig.tensor_parallel_size={self.tensor_parallel_size!r} is invalid: use a positive "
                "number of ranks that divides the world size (usually at most the devices per node); 1: none."
            )
        check_offload(self)
        check_wire(self)
        if self.memory_budget is not None and not isinstance(self.memory_budget, MemoryBudget):
            object.__setattr__(self, "memory_budget", budget_of_setting(self.memory_budget))  # "20GiB", as users write
        check_memory_budget(self)

    @property
    def steps_in_backward(self) -> bool:
        """Offloaded units step during backward (``offload_step_in_backward`` with ``offload_optimizer``: without
        an offloaded optimizer there is no host step to overlap, and the setting changes nothing)."""
        return self.offload.step_in_backward

    @property
    def offload(self) -> OffloadPlan:
        """The offload settings, typed: where each unit's tensors rest (``OffloadPlan.for_unit``)."""
        return OffloadPlan.from_config(self)

    @property
    def wire(self) -> WirePlan:
        """How the collectives travel (ZeRO++): ``WirePlan``."""
        return WirePlan.from_config(self)

    @property
    def plan(self) -> StagePlan:
        return StagePlan.for_stage(self.stage)

    @property
    def bucket_numel(self) -> int:
        """The bucket size in fp32 elements, the unit of the size-based policy."""
        return max(1, int(self.bucket_size_mb * 2**20 / 4))


@cache
def user_settings() -> tuple[Setting, ...]:
    """The settings users set through the adapters, in ``ZeroConfig``'s field order."""
    hints = typing.get_type_hints(ZeroConfig)
    defaults = ZeroConfig()
    return tuple(
        complete(f, hints[f.name], getattr(defaults, f.name)) for f in fields(ZeroConfig) if SETTING_KEY in f.metadata
    )
