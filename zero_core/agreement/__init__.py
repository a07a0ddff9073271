"""Every "ranks agree" of the core: the setup (``setup.py``), the optimizer step (``step_agreement.py``),
flags any rank may raise, all on one packing of values (``flags.py``). Checkpoints agree on each filesystem
step's outcome through ``checkpoint/agreed_steps.py``, over the same collectives."""

from .flags import agree_on_values, differing_values, true_on_any_rank, with_negations
from .setup import agree_on_setup, describe_optimizer, describe_setup, describe_value, first_difference
from .step_agreement import StepAgreement, agree_on_step

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
