"""A DeepSpeed config (``ds_config.json`` or its dict) read as our settings: ``from_deepspeed``; its optimizer
and scheduler sections built as DeepSpeed builds them: ``build_optimizer``, ``build_scheduler``."""

from .batch_size import GlobalBatch
from .common import AUTO, DeepSpeedSettings
from .optimizer_sections import auto_keys, build_scheduler
from .optimizers import build_optimizer, built_from_config
from .reading import from_deepspeed, muon_clipping_problem, read_deepspeed_config

__all__ = [
    "AUTO",
    "DeepSpeedSettings",
    "GlobalBatch",
    "auto_keys",
    "build_optimizer",
    "build_scheduler",
    "built_from_config",
    "from_deepspeed",
    "muon_clipping_problem",
    "read_deepspeed_config",
]
