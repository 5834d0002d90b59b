"""How a KV cache is compressed: `GearConfig` (ten settings + `Advanced`), the paper presets and the recommendations.

Light: imports torch-free modules only (no transformers, no backend, no kernel)."""

from ..compress.quant import BITS
from .advanced import PAPER_ADVANCED, Advanced
from .core import BACKENDS, SETTING_NAMES, GearConfig, expect_config
from .names import METHODS, parse_preset_name
from .presets import DEFAULT_RECOMMENDED, PAPER_SETTINGS, RECOMMENDED
from .saved import CONFIG_VERSION, DEFAULTS_BY_VERSION, VERSION_KEY

__all__ = ["Advanced", "BACKENDS", "BITS", "CONFIG_VERSION", "DEFAULTS_BY_VERSION", "DEFAULT_RECOMMENDED", "GearConfig",
           "METHODS", "PAPER_ADVANCED", "PAPER_SETTINGS", "RECOMMENDED", "SETTING_NAMES", "VERSION_KEY",
           "expect_config", "parse_preset_name"]
