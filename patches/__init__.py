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

_MODULES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "gemma2", "gemma3", "phi3", "olmo2", "granite")

# q/k/v before RoPE, each [B, H, q, d], from the attention module and its input hidden states [B, q, hidden].
Projection = Callable[[torch.nn.Module, torch.Tensor], "tuple[torch.Tensor, torch.Tensor, torch.Tensor]"]


def _no_extra_kwargs(module: torch.nn.Module) -> dict:
    return {}


def config_sliding_window(module: torch.nn.Module) -> dict:
    """Mistral-style: one window for every layer, from the config (None: full attention)."""
    return {"sliding_window": getattr(module.config, "sliding_window", None)}


def layer_sliding_window(module: torch.nn.Module) -> dict:
    """Per-layer windows (`layer_types`): the attention module's own `sliding_window` (None on full layers)."""
    return {"sliding_window": getattr(module, "sliding_window", None)}


def _shared_rotary(rotary: torch.nn.Module, module: torch.nn.Module) -> torch.nn.Module:
    return rotary  # one rotary module for every layer


def split_heads(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """[B, q, H*d] -> [B, H, q, d]."""
    return x.view(*x.shape[:-1], -1, module.head_dim).transpose(1, 2)


def separate_projections(module: torch.nn.Module, hidden_states: torch.Tensor):
    """Llama-style: q_proj / k_proj / v_proj (their biases, if any, applied by the projections)."""
    return (split_heads(module, module.q_proj(hidden_states)), split_heads(module, module.k_proj(hidden_states)),
            split_heads(module, module.v_proj(hidden_states)))


def per_head_qk_norm(module: torch.nn.Module, hidden_states: torch.Tensor):
    """Qwen3 / Gemma 3: separate projections, then RMSNorm over each head's d channels of q and k (before RoPE,
    so the cache keeps normalized, unrotated keys)."""
    shape = (*hidden_states.shape[:-1], -1, module.head_dim)
    query = module.q_norm(module.q_proj(hidden_states).view(shape)).transpose(1, 2)
    key = module.k_norm(module.k_proj(hidden_states).view(shape)).transpose(1, 2)
    return query, key, split_heads(module, module.v_proj(hidden_states))


@dataclass(frozen=True)
class ArchitectureSpec:
    """Where gear_hf finds what it patches in one architecture, and its quirks (data or small hooks; the
    forward itself is `gear_hf.attention.gear_attention_forward`, shared by all).

    project: q/k/v before RoPE (`Projection`); projection_attrs: the submodules it needs (checked at enable).
    attention_kwargs: extra keyword arguments the stock forward passes to the attention function
    (sliding_window, softcap); a `softcap` also keeps the fused kernel off (it does not cap logits).
    layer_rotary: the rotary embedding of one attention module, from the base model's rotary module (Gemma 3
    has one module holding a local and a global RoPE); called as rotary(x, positions) -> (cos, sin) and
    exposing inv_freq / attention_scaling / rope_type.
    """

    model_type: str
    attention_class: str  # class name of the attention module in the modeling file
    attention_kwargs: Callable[[torch.nn.Module], dict] = field(default=_no_extra_kwargs)
    project: Projection = field(default=separate_projections)
    projection_attrs: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    rotary_attr: str = "rotary_emb"  # on the base model (or its language model)
    layer_rotary: Callable[[torch.nn.Module, torch.nn.Module], object] = field(default=_shared_rotary)
    notes: str = ""

    def attention_modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        return [m for m in model.modules() if type(m).__name__ == self.attention_class]

    def is_patchable(self, module: torch.nn.Module) -> bool:
        """Whether `module` has everything the shared forward uses."""
        return all(hasattr(module, a) for a in (*self.projection_attrs, "o_proj", "layer_idx", "head_dim"))

    def base_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return getattr(model, "base_model", model)

    def rotary_emb(self, model: torch.nn.Module) -> torch.nn.Module:
        base = self.base_model(model)
        # multimodal wrappers (Gemma 3): the rotary module lives on the text model
        rotary = getattr(base, self.rotary_attr, None) or getattr(getattr(base, "language_model", None),
                                                                 self.rotary_attr, None)
        if rotary is None:
            raise NotImplementedError(f"{self.model_type}: no rotary module at base_model.{self.rotary_attr}")
        return rotary

    def rotary_for(self, model: torch.nn.Module, module: torch.nn.Module):
        """The rotary embedding `module` (an attention module of `model`) uses."""
        return self.layer_rotary(self.rotary_emb(model), module)


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
