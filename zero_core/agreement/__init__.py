"""Every "ranks agree" of the core: the setup (``setup.py``), the optimizer step (``step.py``), flags any
rank may raise (``flags.py``), all on one packing of values (``packing.py``). Checkpoints agree on each
filesystem step's outcome through ``checkpoint/agreed_steps.py``, over the same collectives."""

from .flags import agree_on_values, true_on_any_rank
from .packing import differing_values, with_negations
from .setup import agree_on_setup, describe_optimizer, describe_setup, describe_value, first_difference
from .step import StepAgreement, agree_on_step

__all__ = [
    "StepAgreement",
    "agree_on_values",
    "agree_on_setup",
    "agree_on_step",
    "describe_optimizer",
    "describe_setup",
    "describe_value",
    "differing_values",
    "first_difference",
    "true_on_any_rank",
    "with_negations",
]
