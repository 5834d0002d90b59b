"""What a GearCache holds between steps, in bytes: by tokens (held) and by spare capacity (reserved).

Everything the cache keeps is counted: codes, scales/minimums (and allocated key widths), low-rank factors, outlier
values and indices, the full-precision sink and buffer, and the position bookkeeping. Per-step temporaries are not
kept and not counted. Bits per element are given as stored, and as they would be with every floating tensor in 16 bits
(an fp32 model's buffer is fp32: the 16-bit figure is the one to compare with an fp16/bf16 model).
"""

from __future__ import annotations

import torch

from ..compress.allocation import allocated_mean_bits

COMPONENTS = ("codes", "scales", "lowrank", "sparse_values", "sparse_indices", "buffer", "positions")


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _itemsize(t: torch.Tensor, cap: int | None) -> int:
    return min(t.element_size(), cap) if cap and t.is_floating_point() else t.element_size()


def _held_by_component(cache, cap: int | None) -> dict[str, int]:
    """Bytes that tokens occupy, by component; cap: count floating tensors at most `cap` bytes/element."""
    layout = cache.layout
    counts = layout.counts
    nb = layout.chunk_len
    out = dict.fromkeys(COMPONENTS, 0)
    for layer in cache.layers:
        for stream in layer.streams:
            for store, tokens in ((stream.sink, counts.sink), (stream.buffer, counts.buffer)):
                if store.data is not None:
                    H, d = store.data.shape[1], store.data.shape[3]
                    out["buffer"] += sum(tokens) * H * d * _itemsize(store.data, cap)
            if stream.prefill is not None and stream.prefill.fields and not layer.released.prompt:
                for p in counts.prompt:
                    if p:
                        for name, n in stream.prefill.chunk_nbytes(p, cap).items():
                            out[name] = out.get(name, 0) + n  # (an extra term may add a component)
            live = sum(max(c - layer.released.chunks, 0) for c in counts.chunks)
            if live and stream.decode.fields:
                for name, n in stream.decode.chunk_nbytes(nb, cap).items():
                    out[name] = out.get(name, 0) + live * n
            out["scales"] += _nbytes(stream.channel_bits)  # each row's allocated key widths (for its next chunks)
    if layout.positions is not None:
        out["positions"] = 4 * (sum(counts.held(nb)) + layout.batch * layout.rect_length)
    return out


def derived_bytes(cache) -> int:
    """What the kernels derived from the storage and keep (prepared runs, sorted outliers: each store's), and what
    they share across layers (workspaces, rotary and rotation tables: the cache's `kernel_state`)."""
    total = cache.kernel_state.nbytes()
    for layer in cache.layers:
        for stream in layer.streams:
            for store in (stream.prefill, stream.decode):
                if store is not None:
                    total += store.derived_nbytes()
    return total


def allocated_bytes(cache) -> int:
    """Every tensor the cache keeps between steps, spare capacity and scratch columns included."""
    total = _nbytes(cache.layout.positions) + _nbytes(cache.layout.rect_to_local)
    for layer in cache.layers:
        total += _nbytes(layer.query_energy)  # kept until every row's key widths are allocated
        for stream in layer.streams:
            total += _nbytes(stream.sink.data) + _nbytes(stream.buffer.data) + _nbytes(stream.channel_bits)
            for store in (stream.prefill, stream.decode):
                if store is not None:
                    total += sum(_nbytes(t) for t in store.fields.values())
    return total


def _elements(cache) -> int:
    """Key and value elements the layers represent (a sliding layer no longer represents what it released)."""
    layout = cache.layout
    if cache.shape is None:
        return 0
    H, d = cache.shape
    held = sum(layout.counts.held(layout.chunk_len))
    total = 0
    for layer in cache.layers:
        gone = sum(p for p in layout.counts.prompt) if layer.released.prompt else 0
        gone += layer.released.chunks * layout.chunk_len * layout.batch
        total += (held - gone) * H * d * 2
    return total


def memory_report(cache) -> dict:
    held = _held_by_component(cache, None)
    held_16 = _held_by_component(cache, 2)
    held_bytes, held_bytes_16 = sum(held.values()), sum(held_16.values())
    allocated = allocated_bytes(cache)
    derived = derived_bytes(cache)
    elements = _elements(cache)
    dtype = cache.model_dtype
    dtype_bits = torch.finfo(dtype).bits if dtype is not None else 16
    bits = held_bytes * 8 / elements if elements else 0.0
    bits_16 = held_bytes_16 * 8 / elements if elements else 0.0
    return {
        **held,
        "held_bytes": held_bytes,
        "reserved_bytes": allocated - held_bytes,
        "derived_bytes": derived,  # kernels' prepared state and shared workspaces
        "total_bytes": allocated + derived,
        "held_bytes_16bit": held_bytes_16,
        "tokens": sum(cache.layout.counts.held(cache.layout.chunk_len)),
        "elements": elements,
        "model_dtype": str(dtype).replace("torch.", "") if dtype is not None else None,
        "dense_bytes": elements * dtype_bits // 8,  # the same tokens uncompressed in the model's dtype
        "fp16_bytes": elements * 2,
        "bits_per_element": bits,  # as stored, held by tokens, everything counted
        "bits_per_element_16bit": bits_16,  # as if every floating tensor were 16-bit
        "vs_model_dtype": held_bytes / (elements * dtype_bits / 8) if elements else 0.0,
        "vs_16bit": held_bytes_16 / (elements * 2) if elements else 0.0,
        "method": cache.gear_config.describe(),
        "backends": cache.backend_names,
        "key_bits_allocated": _key_bits_allocated(cache),
        "key_bits": cache.gear_config.key_bits if cache.gear_config.compresses else None,
        "head_dim": cache.shape[1] if cache.shape is not None else None,
    }


def _key_bits_allocated(cache) -> float | None:
    """The mean key width a head really gets with key_bit_allocation="query" (key_bits·head_dim rounded down to
    whole bits: compress/allocation.py), else None."""
    config = cache.gear_config
    if config.key_bit_allocation != "query" or not config.compresses or cache.shape is None:
        return None
    return allocated_mean_bits(config.key_bits, cache.shape[1])


def summary(report: dict) -> str:
    """One line for humans."""
    mib = 1 << 20
    return (f"{report['method']}: {report['tokens']} tokens/layer, {report['bits_per_element']:.2f} bits/element "
            f"held ({report['bits_per_element_16bit']:.2f} with 16-bit floats) = "
            f"{100 * report['vs_model_dtype']:.1f}% of {report['model_dtype']} KV, "
            f"{report['held_bytes'] / mib:.2f} MiB held + {report['reserved_bytes'] / mib:.2f} MiB reserved"
            + (f" + {report['derived_bytes'] / mib:.2f} MiB kernel state" if report.get("derived_bytes") else "")
            + _allocation_note(report))


def _allocation_note(report: dict) -> str:
    """Where a head's key bits could not be the asked mean exactly (key_bits·head_dim not whole), say so."""
    allocated, asked = report.get("key_bits_allocated"), report.get("key_bits")
    if allocated is None or asked is None or abs(allocated - asked) < 1e-12:
        return ""
    d = report["head_dim"]
    return (f"; keys allocated {allocated:.4g} bits/channel on average (key_bits={asked} times head_dim {d} is not "
            f"whole: rounded down to {round(allocated * d)} bits per head)")
