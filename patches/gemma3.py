"""Gemma 3 (`gemma3_text`, and the text side of the multimodal `gemma3`): Gemma 2's layout (alternating
sliding/global layers, `query_pre_attn_scalar`) plus per-head q/k RMSNorms before RoPE, no soft-capping in the
attention function (stock passes none), and per-layer-type RoPE: one rotary module holds a local (sliding) and a
global inverse frequency table and is called with the layer type. Each layer reads back its keys with its own
table, and the fused kernel gets that table's inv_freq."""

from dataclasses import dataclass

import torch

from . import ArchitectureSpec, layer_sliding_window, per_head_qk_norm


@dataclass(frozen=True)
class LayerTypeRotary:
    """The RoPE of one layer type of a multi-table rotary module, with the single-table interface."""

    rotary: torch.nn.Module
    layer_type: str

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor):
        return self.rotary(x, position_ids, self.layer_type)

    @property
    def inv_freq(self) -> torch.Tensor:
        return getattr(self.rotary, f"{self.layer_type}_inv_freq")

    @property
    def attention_scaling(self) -> float:
        return getattr(self.rotary, f"{self.layer_type}_attention_scaling")

    @property
    def rope_type(self) -> str:
        return self.rotary.rope_type[self.layer_type]


def _rotary_of_layer_type(rotary, module):
    if not isinstance(getattr(rotary, "rope_type", None), dict):
        raise NotImplementedError(f"{type(rotary).__name__}: expected one RoPE table per layer type "
                                  f"(rope_type a dict), got rope_type={getattr(rotary, 'rope_type', None)!r}")
    return LayerTypeRotary(rotary, module.layer_type)


SPECS = [
    ArchitectureSpec(model_type=model_type, attention_class="Gemma3Attention", project=per_head_qk_norm,
                     projection_attrs=("q_proj", "k_proj", "v_proj", "q_norm", "k_norm"),
                     attention_kwargs=layer_sliding_window, layer_rotary=_rotary_of_layer_type)
    for model_type in ("gemma3_text", "gemma3")
]
