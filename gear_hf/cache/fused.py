"""The cache-facing side of the fused decode kernels: what takes a GearCache layer, builds its views and calls a
kernel that takes only tensors (`gear_hf.kernels`, which imports nothing from `gear_hf.cache`), and the pure-torch
oracle and fixtures the kernels are checked against (tests, benchmarks, compile_check; no triton import).

* `cache_decode_attention` - the Triton decode attention over one layer (`GearCache.kernel_views`);
* `reference_decode_attention` computes, in float32, what the fused decode kernels must produce: every row's
  tokens in row-local order (`row_local_tokens`), reconstructed by the torch engine (`ChunkStore.reconstruct`, i.e.
  `gear_hf.compress.decompress`), rotated at their stored positions, and attended with a causal (and optional
  sliding-window) softmax;
* `build_cache` fills a `GearCache` with random keys/values through its public entry point (`store_and_read`),
  with left padding and several steps.
"""

from __future__ import annotations

import types

import torch

from ..compress.rope import rope_tables, rotate_half


def cache_decode_attention(cache, layer_idx: int, query: torch.Tensor, *, scaling: float,
                           inv_freq: torch.Tensor, attention_scaling: float = 1.0,
                           sliding_window: int | None = None, out: torch.Tensor | None = None, reader=None,
                           **tuning) -> torch.Tensor:
    """Fused attention of `query` [B,Hq,q,d] over layer `layer_idx` of a GearCache (`GearCache.kernel_views`:
    during a step what it attends to, between steps what the layer holds). Returns [B, q, Hq, d]. reader: a backend
    whose `reads_tail` hands a coded buffer as stored (the Triton backend's), else it is handed decoded."""
    from ..kernels.decode import decode_attention  # imports triton: only on this path

    keys, values, layout = cache.kernel_views(layer_idx, query.shape[2], query.device, reader=reader)
    shared = cache.kernel_state  # the cache's workspace and tables, as its own fused steps use them
    return decode_attention(query, keys, values, layout, scaling=scaling, inv_freq=inv_freq,
                            attention_scaling=attention_scaling, sliding_window=sliding_window, out=out,
                            workspace=shared.workspace, tables=shared.tables, scratch=shared.scratch, **tuning)


def row_local_tokens(cache, layer_idx: int, dtype=torch.float32):
    """Per row: (keys [H, L, d] before RoPE, values [H, L, d]) in row-local order, reconstructed in `dtype`."""
    cfg = cache.gear_config
    layer = cache.layers[layer_idx]
    nb = cfg.buffer_size
    out = []
    streams = []
    for stream in (layer.key_stream, layer.value_stream):
        sink = stream.sink.data.to(dtype) if cfg.sink_tokens and stream.sink.data is not None else None
        prompt = stream.prefill.reconstruct(1, dtype) if stream.prefill is not None and stream.prefill.fields else None
        counts = stream.own(cache.layout.counts)  # (a stream with a held chunk: one chunk fewer, a longer buffer)
        chunks = max(counts.chunks, default=0)
        decode = stream.decode.reconstruct(chunks, dtype) if chunks else None
        streams.append((sink, prompt, decode, stream.buffer.tokens().to(dtype), counts))
    for b in range(cache.batch_size_):
        row = []
        for sink, prompt, decode, buf, counts in streams:
            s, p, c, f = counts.rows()[b]
            parts = []
            if s:
                parts.append(sink[b, :, :s])
            if p:
                parts.append(prompt[b, :, :p])
            if c:
                parts.append(decode[b, :, : c * nb])
            parts.append(buf[b, :, :f])
            row.append(torch.cat(parts, dim=1))
        out.append(tuple(row))
    return out


def reference_decode_attention(cache, layer_idx: int, query: torch.Tensor, *, scaling: float, inv_freq: torch.Tensor,
                               attention_scaling: float = 1.0, sliding_window: int | None = None,
                               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[B, q, Hq, d] float32: attention of query [B,Hq,q,d] over the cache layer after the current step.

    dtype=float32 (default) is the oracle. dtype=bf16/fp16 emulates the reference path of gear_hf.attention in
    that dtype (tokens reconstructed in it, cos/sin and the rotation in it, softmax attention with its
    matmuls) — the error that path itself makes, to size a tolerance."""
    B, Hq, QL, D = query.shape
    limits = cache.rect_to_local[:, cache.rect_length - QL: cache.rect_length].long()
    out = torch.zeros(B, QL, Hq, D, dtype=torch.float32, device=query.device)
    for b, (keys, values) in enumerate(row_local_tokens(cache, layer_idx, dtype)):
        Hkv, L, _ = keys.shape
        G = Hq // Hkv
        pos = cache.positions[b, :L].to(query.device)
        cos, sin = rope_tables(pos, inv_freq.to(query.device), attention_scaling)
        k_rot = keys * cos.to(dtype) + rotate_half(keys) * sin.to(dtype)  # [Hkv, L, D]
        q = query[b].to(dtype)  # [Hq, QL, D]
        scores = torch.matmul(q, k_rot.repeat_interleave(G, dim=0).transpose(-1, -2)).float() * scaling
        t = torch.arange(L, device=query.device)
        lim = limits[b][:, None]  # [QL, 1]
        visible = t[None, :] <= lim
        if sliding_window:
            visible &= (lim - t[None, :]) < sliding_window
        scores = scores.masked_fill(~visible[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0).to(dtype)  # rows that see nothing -> zeros
        out[b] = torch.matmul(probs, values.repeat_interleave(G, dim=0)).float().transpose(0, 1)
    return out


def build_cache(gear_config, *, batch: int, kv_heads: int, head_dim: int, steps: list[int],
                pad: list[int] | None = None,
                dtype=torch.float32, device="cpu", seed: int = 0, num_layers: int = 1, position_offset: int = 0,
                outlier_channels: int = 2, value_bias: float = 0.0):
    """A GearCache after len(steps) forward steps (steps[0] = prompt columns, left-padded by pad[b]).

    Keys get a few large fixed channels (like real keys) so the per-channel quantization and the outliers
    matter; values a fixed per-channel offset of up to +-value_bias (like a value bias: what a centered value buffer
    takes out). Returns (cache, last_step_keys, last_step_values)."""
    from .gear_cache import GearCache

    pad = pad or [0] * batch
    gen = torch.Generator(device="cpu").manual_seed(seed)
    query_gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    cache = GearCache(types.SimpleNamespace(num_hidden_layers=num_layers), gear_config)
    mask = torch.zeros(batch, 0, dtype=torch.long)
    scale = torch.ones(head_dim)
    scale[torch.randperm(head_dim, generator=gen)[:outlier_channels]] = 8.0
    # (its own generator: the tokens stay as without it)
    bias = (torch.rand(head_dim, generator=torch.Generator().manual_seed(seed + 2)) * 2 - 1) * value_bias
    k = v = None
    for i, q in enumerate(steps):
        new = torch.ones(batch, q, dtype=torch.long)
        if i == 0:
            for b, p in enumerate(pad):
                new[b, :p] = 0
        mask = torch.cat([mask, new], dim=1)
        pos = (mask.cumsum(1) - 1).clamp(min=0)[:, -q:] + position_offset
        cache.observe_attention_mask(mask.to(device))
        for layer in range(num_layers):
            k = (torch.randn(batch, kv_heads, q, head_dim, generator=gen) * scale).to(dtype).to(device)
            v = (torch.randn(batch, kv_heads, q, head_dim, generator=gen) + bias).to(dtype).to(device)
            query = None
            if gear_config.key_bit_allocation == "query":  # (own generator: the keys/values stay as without it)
                # one query per KV head, stronger on the large channels, for the key widths it allocates
                query = (torch.randn(batch, kv_heads, q, head_dim, generator=query_gen) * scale.sqrt()).to(dtype)
                query = query.to(device)
            cache.store_and_read(layer, k, v, pos.to(device), query=query)
    return cache, k, v
