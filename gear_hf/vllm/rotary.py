"""Keys reach a vLLM backend after RoPE: un-rotate them to pre-RoPE before compressing (DESIGN §2, "Keys before
RoPE"), rotate the reconstruction back when it is read. Positions are the tokens' indices in their sequence
(j*bs + t for token t of block j: plain decoder LMs, no M-RoPE).

cos/sin come from gear_hf.compress.rope.rope_tables with the inv_freq of the model's Hugging Face rotary module,
built from
the config vLLM loaded (LlamaRotaryEmbedding reads the rope parameters of Llama/Qwen2/Mistral configs, including
llama3 scaling): vLLM's own rotary module is not reachable from an attention backend.
"""

from __future__ import annotations

import numpy as np
import torch

from gear_hf.compress.rope import apply_rotary, rope_angles, rope_tables


class KeyRotary:
    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float = 1.0) -> None:
        self.inv_freq = inv_freq.float()
        self.attention_scaling = float(attention_scaling)
        self._halves: tuple[np.ndarray, np.ndarray] | None = None  # cos/sin at positions 0.. (grown on demand)

    def halves(self, length: int) -> tuple[np.ndarray, np.ndarray]:
        """cos/sin [>=length, d/2] float32 at positions 0, 1, ... with attention_scaling folded in (one half of
        `rope_tables`' equal halves), as the paged kernel rotates keys read from pages."""
        held = 0 if self._halves is None else self._halves[0].shape[0]
        if held < length:
            angles = rope_angles(torch.arange(max(length, 2 * held)), self.inv_freq)
            self._halves = ((angles.cos() * self.attention_scaling).numpy(),
                            (angles.sin() * self.attention_scaling).numpy())
        return self._halves

    @classmethod
    def from_hf_config(cls, hf_config, head_size: int) -> "KeyRotary":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        config = getattr(hf_config, "text_config", hf_config)
        if getattr(config, "head_dim", None) is None:
            config.head_dim = head_size
        rotary = LlamaRotaryEmbedding(config)
        if 2 * rotary.inv_freq.numel() != head_size:
            raise ValueError(f"GEAR pre_rope needs RoPE over the whole head ({head_size} channels); this model "
                             f"rotates {2 * rotary.inv_freq.numel()}: set pre_rope=false in GEAR_HF_VLLM_CONFIG")
        return cls(rotary.inv_freq, rotary.attention_scaling)

    def _tables(self, first_position: torch.Tensor, block_size: int, scaling: float, device: torch.device):
        positions = first_position.to(device)[:, None] + torch.arange(block_size, device=device)  # [N, bs]
        cos, sin = rope_tables(positions, self.inv_freq.to(device), scaling)  # [N, bs, d] float32
        return cos.unsqueeze(1), sin.unsqueeze(1)  # [N, 1, bs, d]

    def rotate(self, keys: torch.Tensor, first_position: torch.Tensor) -> torch.Tensor:
        """keys [N,H,bs,d] pre-RoPE -> post-RoPE (model dtype), in float32."""
        cos, sin = self._tables(first_position, keys.shape[2], self.attention_scaling, keys.device)
        return apply_rotary(keys.float(), cos, sin).to(keys.dtype)

    def unrotate(self, keys: torch.Tensor, first_position: torch.Tensor) -> torch.Tensor:
        """keys [N,H,bs,d] post-RoPE -> pre-RoPE: the rotation by the opposite angles (and 1/scaling)."""
        cos, sin = self._tables(first_position, keys.shape[2], 1.0 / self.attention_scaling, keys.device)
        return apply_rotary(keys.float(), cos, -sin).to(keys.dtype)
