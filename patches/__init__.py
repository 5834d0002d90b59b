"""Per-architecture specs, installed as `gear_hf.patches` (setup.cfg maps this folder there).

Each module is a short declarative `ArchitectureSpec`; the attention logic lives once, in
`gear_hf.attention`. To support a new architecture, add a module here and list it in `_MODULES`.
"""

if __name__ != "gear_hf.patches":
    raise ImportError(
        f"this folder is the package gear_hf.patches and must not be imported as {__name__!r}: "
        "install gear_hf (pip install -e .) and `import gear_hf.patches`"
    )

import importlib
from dataclasses import dataclass, field
from typing import Callable

import torch

_MODULES = ("llama", "mistral", "qwen2")


def _no_extra_kwargs(module: torch.nn.Module) -> dict:
    return {}


@dataclass(frozen=True)
class ArchitectureSpec:
    """Where gear_hf finds what it patches in one architecture, and its quirks."""

    model_type: str
    attention_class: str  # class name of the attention module in the modeling file
    attention_kwargs: Callable[[torch.nn.Module], dict] = field(default=_no_extra_kwargs)
    rotary_attr: str = "rotary_emb"  # on the base model
    notes: str = ""

    def attention_modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        return [m for m in model.modules() if type(m).__name__ == self.attention_class]

    def base_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return getattr(model, "base_model", model)

    def rotary_emb(self, model: torch.nn.Module) -> torch.nn.Module:
        base = self.base_model(model)
        rotary = getattr(base, self.rotary_attr, None)
        if rotary is None:
            raise NotImplementedError(f"{self.model_type}: no rotary module at base_model.{self.rotary_attr}")
        return rotary


def _registry() -> dict[str, ArchitectureSpec]:
    specs = {}
    for name in _MODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        for spec in module.SPECS:
            specs[spec.model_type] = spec
    return specs


REGISTRY: dict[str, ArchitectureSpec] = _registry()


def supported_model_types() -> list[str]:
    return sorted(REGISTRY)


def spec_for(model: torch.nn.Module) -> ArchitectureSpec:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in REGISTRY:
        raise NotImplementedError(
            f"gear_hf does not support model_type {model_type!r} ({type(model).__name__}); "
            f"supported: {', '.join(supported_model_types())}"
        )
    return REGISTRY[model_type]
