"""A DeepSpeed config (``ds_config.json`` or its dict) read as our settings: ``from_deepspeed``."""

from .common import AUTO, DeepSpeedSettings
from .reading import from_deepspeed, read_deepspeed_config

__all__ = ["AUTO", "DeepSpeedSettings", "from_deepspeed", "read_deepspeed_config"]
