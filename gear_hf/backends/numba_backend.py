"""The numba backend: the CPU kernels (`gear_hf.kernels.cpu`) for compression, reads and the fused decode attention.

Where a call's arguments fall outside a kernel although the format is served (a float16 output, cos/sin covering
part of the head: models whose format the kernels still compress and attend), that call computes with the torch
oracle, bit for bit what the kernel would give (`supports` refuses formats; call-level checks only pick the loop).
"""

from __future__ import annotations

import functools
import importlib

import numpy as np
import torch

from ..compress import compress
from ..compress.quant import BITS
from ..format import layer_formats, stream_specs
from .base import Backend, import_problem
from .torch_backend import TorchBackend

_ORACLE = TorchBackend()


@functools.lru_cache(maxsize=None)
def _kernels():
    return importlib.import_module("gear_hf.kernels.cpu")  # imports numba: only once a numba backend runs


class NumbaBackend(Backend):
    name = "numba"
    ops = ("compress", "reconstruct", "attend")
    install_hint = "pip install 'gear-hf[cpu]'"
    rotates_in_read = True
    centers_exact_tokens = True

    def unavailable(self, device, forced=False):
        if getattr(device, "type", device) != "cpu":
            return f"it runs the CPU kernels and the tensors are on {getattr(device, 'type', device)}"
        return import_problem("numba")

    def supports(self, op, config, head_dim, dtype):
        specs = [spec for fmt in layer_formats(config) for spec in fmt.specs]
        extra = sorted({name for spec in specs for name in spec.extra_terms})
        if extra:
            return f"the CPU kernels do not implement the term(s) {extra}"
        if op == "attend":
            return attend_supported(config, head_dim, dtype)
        if op == "compress":
            if dtype not in (torch.float32, torch.bfloat16):
                return f"model dtype {dtype}: the CPU compression kernels read float32 and bf16 chunks"
            for spec in specs:
                if spec.range_search:
                    return "range_search: the CPU compression kernels take min/max ranges"
                if not spec.allocated and spec.bits not in BITS:
                    return f"{spec.bits}-bit codes"
            return None
        if op == "reconstruct":
            probe = torch.empty(0, dtype=torch.float32)
            for spec in specs:
                if not _kernels().decompress_supported(spec, head_dim, probe):
                    return f"storage {spec} is not read by the CPU kernels"
            return None
        return super().supports(op, config, head_dim, dtype)

    def compress(self, spec, x, channel_bits):
        cpu = _kernels()
        if not cpu.compress_supported(spec, x):  # (a chunk shape the cache's layout does not produce)
            return _ORACLE.compress(spec, x, channel_bits)
        return compress(x, spec, channel_bits=channel_bits, backbone=cpu.compress_backbone, factors=cpu.fit_factors)

    def encode_tokens(self, spec, exact, written, fields, affine=None):
        cpu = _kernels()
        if not cpu.encode_supported(spec, exact):
            return False
        cpu.encode_staged(exact, written, fields, spec, affine)
        return True

    def decode_centers(self, fields):
        cpu = _kernels()
        return cpu.decode_centers(fields) if cpu.centers_supported(fields) else None

    def reads_tail(self, spec, head_dim):
        return _kernels().tail_format(spec, head_dim)

    def all_finite(self, x):
        flag = _kernels().all_finite(x)
        return torch.isfinite(x).all() if flag is None else flag

    def reconstruct(self, store, chunks, out_dtype, out=None, rotary=None, scratch=None):
        cpu = _kernels()
        if out is None and out_dtype in (torch.float32, torch.bfloat16):
            B, H = store.fields["codes"].shape[:2]
            out = torch.empty(B, H, chunks * store.chunk_len, store.head_dim, dtype=out_dtype)
        if cpu.decompress_supported(store.spec, store.head_dim, out, rotary):
            return cpu.decompress_run(self.prepared(store, chunks), out, rotary)
        return _ORACLE.reconstruct(store, chunks, out_dtype, out, rotary, scratch)

    def rotate(self, x, cos, sin, out, scratch=None):
        cpu = _kernels()
        if cpu.rotate_supported(x, cos, out):
            return cpu.rotate_into(x, cos, sin, out)
        return _ORACLE.rotate(x, cos, sin, out, scratch)

    def step_reason(self, head_dim, query_len, rotary_dim, softcap):
        from ..kernels import step_reason

        return step_reason(head_dim, query_len, rotary_dim, softcap)

    def attend(self, query, keys, values, layout, *, scaling, inv_freq, attention_scaling, sliding_window, shared,
               query_rotary=None):
        cpu = _kernels()
        query_tables = None
        if query_rotary is not None:  # (the model's tables of the step's tokens: the same for every layer)
            query_tables = shared.per_step(("query rotation", *map(id, query_rotary), query.shape, query.dtype),
                                           query_rotary, lambda: cpu.query_rotation_tables(query, query_rotary))
        return cpu.decode_attention(query, keys, values, layout, scaling=scaling, inv_freq=inv_freq,
                                    attention_scaling=attention_scaling, sliding_window=sliding_window,
                                    rope_tables=shared.rope_halves(layout.positions, inv_freq),
                                    query_rotary=query_rotary, query_tables=query_tables)

    def rotates_queries(self, query, cos):
        return _kernels().rotates_query(query, cos)

    # derived state: the prepared run of the first `chunks` chunks (views of the fields; float32 copies of what the
    # loops cannot read in place), one per run length, rebuilt after a write
    def prepare(self, store):
        for key in [k for k in store.derived if k[0] == self.name and store.derived[k][0] != store.version]:
            del store.derived[key]

    def view_derived(self, store, view, chunks, stream):
        return {"numba_run": self.prepared(store, chunks)}

    def prepared(self, store, chunks: int):
        key = (self.name, chunks)
        entry = store.derived.get(key)
        if entry is None or entry[0] != store.version:
            run = _kernels().prepare(store.run(chunks), store.spec, store.chunk_len, store.head_dim, chunks)
            entry = store.derived[key] = (store.version, run, _owned_nbytes(run, store.fields.values()))
        return entry[1]

    @staticmethod
    def derived_nbytes(store) -> int:
        return sum(entry[2] for key, entry in store.derived.items() if key[0] == NumbaBackend.name)


def _owned_nbytes(run, fields) -> int:
    """Bytes of the arrays of a prepared run that are not views of the store's fields (copies it owns)."""
    spans = []
    for t in fields:
        if t.numel():
            start = t.untyped_storage().data_ptr()
            spans.append((start, start + t.untyped_storage().nbytes()))
    arrays = [v for v in vars(run).values() if isinstance(v, np.ndarray)]
    arrays += [a for v in vars(run).values() if isinstance(v, tuple) for a in v if isinstance(a, np.ndarray)]
    owned = 0
    for array in arrays:
        at = array.__array_interface__["data"][0]
        if array.nbytes and not any(lo <= at < hi for lo, hi in spans):
            owned += array.nbytes
    return owned


@functools.lru_cache(maxsize=64)  # (asked once per layer and step; GearConfig is frozen)
def attend_supported(config, head_dim: int, query_dtype: torch.dtype) -> str | None:
    """None when the CPU kernels' `decode_attention` covers a cache of this GearConfig (storage the read kernels
    decompress, keys before RoPE, a float32, bf16 or fp16 model), else why not. Configurations that compress nothing
    (fp16) keep the reference path: it is stock attention bit for bit."""
    if not config.compresses:
        return "nothing is compressed (the reference path is stock attention bit for bit)"
    if not config.pre_rope:
        return "pre_rope=False (keys stored after RoPE) is only implemented by the torch path"
    if query_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"query dtype {query_dtype} (the CPU kernel reads float32, bf16 and fp16 models)"
    if head_dim % 2:
        return f"head_dim={head_dim} is odd (RoPE rotates halves)"
    probe = torch.empty(0, dtype=torch.float32)
    for stream in ("key", "value"):
        for spec in stream_specs(config, stream):
            if not _kernels().decompress_supported(spec, head_dim, probe):
                return f"{stream} storage {spec} is not read by the CPU kernels"
    return None
