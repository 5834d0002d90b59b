"""What a GearCache owns between steps, in bytes: the headline, and what it is made of.

    owned        = held + spare + kernel state + workspaces: every tensor the cache keeps alive (what to size a
                   device from; `bits_per_element` is this)
    held         by tokens: codes, scales/minimums (and allocated key widths), low-rank factors, outlier values and
                   indices, the full-precision sink and buffer (and a dense window's tokens), the position tables
                   when stored (by component)
    spare        capacity allocated beyond the tokens (stores grow in bounded steps: gear_hf.cache.storage)
    kernel state what the kernels derived and keep: per store (prepared runs, sorted outliers) and shared by the
                 layers (`KernelState`: split-KV workspace, tables, rope halves)
    workspaces   what the cache keeps from one step for the next: nothing between steps (the rotary tables and the
                 query energy of key-width allocation are per step: dropped when a step ends)

No layer owns more than the dense cache would: a sliding layer whose window cannot gain stores
dense (`GearLayer.dense`; `dense_layers` says why), positions that follow from the pads are not stored, and the
full-precision buffer grows exactly as transformers' cache does. What remains above dense is named in `above_dense`.

Per-step temporaries (`StepWorkspace`, the layout's memos) are dropped when a step ends and not counted. Bits per
element are given as stored, and as they would be with every floating tensor held by tokens in 16 bits (an fp32
model's buffer is fp32: the 16-bit figure is the one to compare with an fp16/bf16 model).
"""

from __future__ import annotations

import torch

from ..compress.allocation import allocated_mean_bits

COMPONENTS = ("codes", "scales", "lowrank", "sparse_values", "sparse_indices", "buffer", "positions")


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _held_by_component(cache, cap: int | None) -> dict[str, int]:
    """Bytes that tokens occupy, by component; cap: count floating tensors at most `cap` bytes/element."""
    layout = cache.layout
    counts = layout.counts
    nb = layout.chunk_len
    out = dict.fromkeys(COMPONENTS, 0)
    for layer in cache.layers:
        if layer.dense is not None:  # a dense window: its real tokens (its padding columns are spare, as in HF's)
            out["buffer"] += sum(_window_tokens(layout, layer)) * _capped(layer.dense.column_nbytes(),
                                                                          layer.dense.keys, cap)
            continue
        for stream in layer.streams:
            own = stream.own(counts)  # (a held chunk: in the buffer, not a decode chunk)
            for store, tokens in ((stream.sink, own.sink), (stream.buffer, own.buffer)):
                if store.capacity:
                    out["buffer"] += sum(tokens) * store.token_nbytes(cap)
            if stream.prefill is not None and stream.prefill.fields and not layer.released.prompt:
                for p in counts.prompt:
                    if p:
                        for name, n in stream.prefill.chunk_nbytes(p, cap).items():
                            out[name] = out.get(name, 0) + n  # (an extra term may add a component)
            live = sum(max(c - layer.released.chunks, 0) for c in own.chunks)
            if live and stream.decode.fields:
                for name, n in stream.decode.chunk_nbytes(nb, cap).items():
                    out[name] = out.get(name, 0) + live * n
            # each row's allocated key widths (for its next chunks) and its buffer's channel centers
            out["scales"] += _nbytes(stream.channel_bits) + stream.buffer.row_state_nbytes()
    if layout.tables is not None:  # (none while they follow from the pads: `RowLayout.positions`)
        out["positions"] = 4 * (sum(counts.held(nb)) + layout.batch * layout.rect_length)
    return out


def _capped(nbytes: int, like: torch.Tensor | None, cap: int | None) -> int:
    """nbytes of tensors like `like`, counted at most `cap` bytes per element."""
    if like is None or cap is None or like.element_size() <= cap:
        return nbytes
    return nbytes // like.element_size() * cap


def _window_tokens(layout, layer) -> list[int]:
    """Per row, the real tokens among the columns a dense window holds (a row with holes: at most its columns)."""
    columns = layer.dense.columns
    held = layout.counts.held(layout.chunk_len)
    before = layout.tokens_before(layout.rect_length - columns)
    return [min(columns, h - b) for h, b in zip(held, before)]


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


def workspace_bytes(cache) -> int:
    """What the cache keeps beyond its stores: the rotary memo (cos/sin of the step's reads) and the step's query
    energy (what key widths are allocated from): both emptied when the step ends, so 0 between steps."""
    return cache._rotary.nbytes() + sum(_nbytes(layer.query_energy) for layer in cache.layers)


def allocated_bytes(cache) -> int:
    """Every tensor of the stores and the layout, spare capacity included."""
    total = sum(_nbytes(t) for t in cache.layout.tables or ())
    for layer in cache.layers:
        if layer.dense is not None:
            total += layer.dense.nbytes()
        for stream in layer.streams:
            total += stream.sink.nbytes() + stream.buffer.nbytes() + _nbytes(stream.channel_bits)
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
        if layer.dense is not None:
            total += sum(_window_tokens(layout, layer)) * H * d * 2
            continue
        gone = sum(p for p in layout.counts.prompt) if layer.released.prompt else 0
        gone += layer.released.chunks * layout.chunk_len * layout.batch
        total += (held - gone) * H * d * 2
    return total


def memory_report(cache) -> dict:
    held = _held_by_component(cache, None)
    held_16 = _held_by_component(cache, 2)
    held_bytes, held_bytes_16 = sum(held.values()), sum(held_16.values())
    allocated = allocated_bytes(cache)
    kernel_state = derived_bytes(cache)
    workspaces = workspace_bytes(cache)
    owned = allocated + kernel_state + workspaces
    owned_16 = owned - held_bytes + held_bytes_16  # (what tokens hold at 16 bits, the rest as stored)
    elements = _elements(cache)
    dtype = cache.model_dtype
    dtype_bits = torch.finfo(dtype).bits if dtype is not None else 16
    per_element = 8 / elements if elements else 0.0
    dense = elements * dtype_bits // 8
    report = {
        **held,
        "owned_bytes": owned,  # every tensor the cache keeps alive: the headline
        "held_bytes": held_bytes,  # by tokens (the components above)
        "spare_bytes": allocated - held_bytes,  # capacity beyond the tokens
        "kernel_state_bytes": kernel_state,  # kernels' derived state, per store and shared
        "workspace_bytes": workspaces,  # kept from one step for the next (rotary memo, allocation statistics)
        "held_bytes_16bit": held_bytes_16,
        "tokens": sum(cache.layout.counts.held(cache.layout.chunk_len)),  # over rows (and beams)
        "rows": cache.layout.batch,
        "row_tokens": max(cache.layout.counts.held(cache.layout.chunk_len), default=0),  # the longest row's
        "elements": elements,
        "model_dtype": str(dtype).replace("torch.", "") if dtype is not None else None,
        "dense_bytes": dense,  # the same tokens uncompressed in the model's dtype
        "fp16_bytes": elements * 2,
        "bits_per_element": owned * per_element,  # owned: everything counted
        "held_bits_per_element": held_bytes * per_element,  # held by tokens only
        "bits_per_element_16bit": owned_16 * per_element,  # owned, with what tokens hold in 16-bit floats
        "vs_model_dtype": owned / dense if elements else 0.0,
        "vs_16bit": owned_16 / (elements * 2) if elements else 0.0,
        "method": cache.gear_config.describe(),
        "name": cache.gear_config.name,  # the recommendation or preset it is ("balanced", "gear-2")
        "backends": cache.backend_names,
        "key_bits_allocated": _key_bits_allocated(cache),
        "key_bits": cache.gear_config.key_bits if cache.gear_config.compresses else None,
        "head_dim": cache.shape[1] if cache.shape is not None else None,
        "dense_layers": _dense_layers(cache),  # {why: [layer index]}: layers that store what dense would
    }
    report["above_dense"] = _above_dense_reasons(cache, report) if owned > dense else []
    return report


def _dense_layers(cache) -> dict[str, list[int]]:
    """The layers that store dense (`GearLayer.dense_why`), grouped by why."""
    out: dict[str, list[int]] = {}
    for i, layer in enumerate(cache.layers):
        if layer.dense_why:
            out.setdefault(layer.dense_why, []).append(i)
    return out


def _above_dense_reasons(cache, report: dict) -> list[str]:
    """Why the cache owns more than the dense cache of the same tokens (real ones: no padding) would, from what the
    report counted (said, not hidden). A dense cache of a left-padded batch owns its padding columns too."""
    config, counts = cache.gear_config, cache.layout.counts
    reasons = []
    if report["positions"]:
        reasons.append("positions stored beside the tokens (a mask with holes, or position_ids other than each row's "
                       "token index)")
    if report["spare_bytes"] and len(set(counts.held(cache.layout.chunk_len))) > 1:
        reasons.append("rows of unequal length: the full-precision buffer and the dense windows are as long as the "
                       "longest row's, as a padded dense cache is")
    if report["workspace_bytes"] or report["kernel_state_bytes"]:
        reasons.append("kernel state and workspaces beside the tokens")
    if config.compresses and (any(counts.prompt) or any(counts.chunks)) and report["scales"] + report["lowrank"] \
            + report["sparse_values"] + report["sparse_indices"] + report["codes"] > 0:
        reasons.append("compressed chunks beside a full-precision buffer")
    return reasons or [f"spare capacity ({report['spare_bytes']} bytes)"]


def _key_bits_allocated(cache) -> float | None:
    """The mean key width a head really gets with key_bit_allocation="query" (key_bits·head_dim rounded down to
    whole bits: compress/allocation.py), else None."""
    config = cache.gear_config
    if config.key_bit_allocation != "query" or not config.compresses or cache.shape is None:
        return None
    return allocated_mean_bits(config.key_bits, cache.shape[1])


def summary(report: dict) -> str:
    """One line for humans: the configuration's name, what the cache owns against the same tokens uncompressed (in
    the model's dtype and in 16 bits), then what it is made of."""
    mib = 1 << 20
    if report["model_dtype"] is None:  # nothing stored yet: no dtype to compare with
        return f"{report['name']}: empty (nothing stored yet), owns {report['owned_bytes'] / mib:.2f} MiB"
    owned, rows = report["owned_bytes"], report["rows"]
    against = [f"{report['dense_bytes'] / mib:.2f} MiB {report['model_dtype']} ({100 * report['vs_model_dtype']:.1f}%)"]
    if report["model_dtype"] not in ("bfloat16", "float16"):
        against.append(f"{report['fp16_bytes'] / mib:.2f} MiB at 16 bits ({100 * owned / report['fp16_bytes']:.1f}%)")
    rest = [f"held by tokens {report['held_bits_per_element']:.2f} bits ({report['held_bytes'] / mib:.2f} MiB)",
            f"spare capacity {report['spare_bytes'] / mib:.2f} MiB"]
    if report["kernel_state_bytes"] or report["workspace_bytes"]:
        rest.append(f"kernel state + workspaces {(report['kernel_state_bytes'] + report['workspace_bytes']) / mib:.2f}"
                    " MiB")
    shape = (f"{rows} rows of up to {report['row_tokens']} tokens" if rows > 1 else f"{report['row_tokens']} tokens")
    return (f"{report['name']}: {shape}/layer, owns {owned / mib:.2f} MiB instead of " + " or ".join(against)
            + f", {report['bits_per_element']:.2f} bits/element ({report['method']}); " + ", ".join(rest)
            + _allocation_note(report)
            + "".join(f"; {_layers(idx)} dense (why: {why})" for why, idx in report.get("dense_layers", {}).items())
            + "".join(f"; more than the dense cache: {why}" for why in report.get("above_dense", [])))


def _layers(indices: list[int]) -> str:
    many = len(indices) > 1
    return f"layer{'s' if many else ''} {', '.join(map(str, indices))} store{'' if many else 's'}"


def _allocation_note(report: dict) -> str:
    """Where a head's key bits could not be the asked mean exactly (key_bits·head_dim not whole), say so."""
    allocated, asked = report.get("key_bits_allocated"), report.get("key_bits")
    if allocated is None or asked is None or abs(allocated - asked) < 1e-12:
        return ""
    d = report["head_dim"]
    return (f"; keys allocated {allocated:.4g} bits/channel on average (key_bits={asked} times head_dim {d} is not "
            f"whole: rounded down to {round(allocated * d)} bits per head)")
