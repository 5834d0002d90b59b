"""gear_hf: GEAR-compressed KV caches for Hugging Face Transformers, without forking modeling code.

    import gear_hf
    gear_hf.enable(model, gear_hf.GearConfig.preset("gear", bits=2))
    out = model.generate(**batch, max_new_tokens=256)
    gear_hf.disable(model)

`import gear_hf` stays light: transformers is imported on first use of the cache/API, triton never here.
"""

from .config import GearConfig

__version__ = "0.1.0"

_LAZY = {
    "enable": "api", "disable": "api", "enabled": "api", "is_enabled": "api", "last_cache": "api",
    "GearCache": "cache",
}

__all__ = ["GearConfig", "GearCache", "enable", "disable", "enabled", "is_enabled", "last_cache",
           "supported_model_types"]


def _hint_when_transformers_is_loaded() -> None:
    """cache_implementation="gear" on a model not enabled: transformers' error gets a hint to call enable
    (hf_compat.install_cache_implementation_hint; api installs it too). Only when transformers is already loaded,
    so that `import gear_hf` never imports it."""
    import sys

    if "transformers" in sys.modules:
        from .hf_compat import install_cache_implementation_hint

        install_cache_implementation_hint()


_hint_when_transformers_is_loaded()


def supported_model_types() -> list[str]:
    from .patches import supported_model_types as _supported

    return _supported()


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'gear_hf' has no attribute {name!r}")
