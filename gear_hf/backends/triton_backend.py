"""The Triton backend: the fused decode attention on CUDA (`gear_hf.kernels.decode`), the quantize + pack kernel
(`gear_hf.kernels.quant`) inside compression, and the reconstruction kernel (`gear_hf.kernels.triton.reconstruct`):
one launch per store and layer-step writes the store's chunks decompressed, keys rotated, in the model dtype, into
the step's workspace (the reference path's reads, and the memory-bound fallback the cost model picks on decode
steps, `gear_hf.backends.cost`). Full-precision tokens (sink, buffer) are rotated by torch. The fused attention reads
a buffer held per token in the 8-bit or rotated 4-bit format as stored (`reads_tail`); the reconstruction path reads
it decoded by the oracle (`CodedTokenStore.tokens`).

Without a GPU the kernels run only in Triton's interpreter (TRITON_INTERPRET=1 set before they are imported: tests).
"""

from __future__ import annotations

import torch

from ..compress import compress
from ..format import layer_formats
from .base import Backend, import_problem
from .torch_backend import TorchBackend

_ORACLE = TorchBackend()


class TritonBackend(Backend):
    name = "triton"
    ops = ("compress", "reconstruct", "attend")
    install_hint = "pip install 'gear-hf[triton]'"
    rotates_in_read = True

    def unavailable(self, device, forced=False):
        from ..kernels import interpreting

        if getattr(device, "type", device) != "cuda" and not (forced and interpreting()):  # (before importing it)
            problem = import_problem("triton", "triton.language") if forced else None
            return problem or ("it needs CUDA tensors (forced, with TRITON_INTERPRET=1 set before gear_hf.kernels is "
                               "imported, it runs the kernels in Triton's CPU interpreter, for tests)")
        return import_problem("triton", "triton.language")

    def supports(self, op, config, head_dim, dtype):
        if op == "compress":  # the quantizer serves the chunks it covers (one width, min/max); the oracle the rest
            return None
        if op == "attend":
            if config.extra_terms:
                return f"the fused kernel does not implement the term(s) {list(config.extra_terms)}"
            return fused_supported(config, head_dim, 1)
        if op == "reconstruct":
            from ..kernels import reconstruct_supported

            for fmt in layer_formats(config):
                for spec in fmt.specs:
                    reason = reconstruct_supported(spec, head_dim)
                    if reason:
                        return reason
            return None
        return super().supports(op, config, head_dim, dtype)

    def compress(self, spec, x, channel_bits):
        from .. import kernels

        n, d = x.shape[2], x.shape[3]
        quantize_pack = kernels.quantize_pack if kernels.quantize_pack_supports(spec, n, d) else None
        return compress(x, spec, quantize_pack=quantize_pack, channel_bits=channel_bits)

    def reconstruct(self, store, chunks, out_dtype, out=None, rotary=None, scratch=None):
        from .. import kernels

        spec, d = store.spec, store.head_dim
        device = store.fields["codes"].device
        partial = rotary is not None and rotary[0].shape[-1] != d  # (partial rotary: the torch path's)
        served = out_dtype in (torch.float16, torch.bfloat16, torch.float32) \
            and not kernels.reconstruct_supported(spec, d)
        if partial or not served or (device.type != "cuda" and not kernels.interpreting()):
            return _ORACLE.reconstruct(store, chunks, out_dtype, out, rotary, scratch)
        if out is None:
            B, H = store.fields["codes"].shape[:2]
            out = torch.empty(B, H, chunks * store.chunk_len, d, dtype=out_dtype, device=device)
        if rotary is not None:
            rotary = tuple(t if t.stride(-1) == 1 else t.contiguous() for t in rotary)
        from ..kernels.views import ChunkRunView  # no triton import

        view = ChunkRunView.of(store)
        derived = self.view_derived(store, view, chunks, "key") if spec.axis == "channel" else {}
        return kernels.reconstruct_run(view, chunks, out, rotary, derived, _tables(store))

    def rotate(self, x, cos, sin, out, scratch=None):
        return _ORACLE.rotate(x, cos, sin, out, scratch)

    def step_reason(self, head_dim, query_len, rotary_dim, softcap):
        from ..kernels import step_reason

        return step_reason(head_dim, query_len, rotary_dim, softcap)

    def reads_tail(self, spec, head_dim):
        from ..kernels.views import tail_format  # no triton import

        # 8-bit codes, 4-bit codes of the rotated vector (`buffer_tiles._buffer_block`), at the kernels' head_dims
        return tail_format(spec, head_dim) and head_dim >= 32 and not head_dim & (head_dim - 1)

    def attend(self, query, keys, values, layout, *, scaling, inv_freq, attention_scaling, sliding_window, shared):
        from ..kernels import tensor_core_reason
        from ..kernels.decode import decode_attention  # imports triton: only on this path

        # the tensor-core kernel where it serves the step (16-bit queries), else the register kernel; the cache's
        # step_paths name which ran ("fused-tc" / "fused"), shared.attend_reason why not the tensor-core one
        reason = tensor_core_reason(query.dtype)
        shared.attend_path, shared.attend_reason = ("fused", reason) if reason else ("fused-tc", None)
        return decode_attention(query, keys, values, layout, scaling=scaling, inv_freq=inv_freq,
                                attention_scaling=attention_scaling, sliding_window=sliding_window,
                                workspace=shared.workspace, tables=shared.tables, tensor_core=reason is None,
                                scratch=shared.scratch)

    # derived state: key outliers sorted by token per chunk (`kernels.views.prepare_derived`), computed for each
    # chunk once, after it is written, into tensors the store owns
    def prepare(self, store):
        state = store.derived.get(self.name)
        if state is not None and state["version"] != store.version:
            state["valid_chunks"] = min(state["valid_chunks"], store.first_changed)
            state["version"] = store.version

    def view_derived(self, store, view, chunks_used: int, stream: str) -> dict:
        """The store's key outliers sorted by token (`views.prepare_derived`), for a run stored per channel with
        outliers (stream "key"; the reconstruction kernel asks for any run stored per channel)."""
        from ..kernels.views import key_outlier_count, prepare_derived

        if stream != "key" or chunks_used <= 0 or key_outlier_count(view) == 0:
            return {}
        state = store.derived.get(self.name)
        if state is None or state["capacity"] < chunks_used:
            state = self._allocate(store, view, max(chunks_used, store.capacity), state)
        done = state["valid_chunks"]
        if done < chunks_used:
            one = prepare_derived(_chunks_of(view, done, chunks_used), chunks_used - done)
            per = {name: t.shape[-1] // (chunks_used - done) for name, t in one.items() if name != "key_outlier_tile"}
            for name, t in one.items():
                target = state["tensors"][name]
                if name == "key_outlier_tile":
                    target[:, :, done:chunks_used] = t
                else:
                    target[:, :, done * per[name] : chunks_used * per[name]] = t
            state["valid_chunks"] = chunks_used
        # whole (contiguous) tensors, as the store's fields are passed: the kernel reads the first chunks_used chunks
        return dict(state["tensors"])

    def _allocate(self, store, view, capacity: int, old):
        from ..kernels.views import prepare_derived

        probe = prepare_derived(_chunks_of(view, 0, 1), 1)  # one chunk: the shapes per chunk
        tensors = {}
        for name, t in probe.items():
            shape = (*t.shape[:2], capacity * t.shape[-1]) if name != "key_outlier_tile" else \
                (*t.shape[:2], capacity, t.shape[-1])
            tensors[name] = torch.zeros(shape, dtype=t.dtype, device=t.device)
        state = {"tensors": tensors, "capacity": capacity, "valid_chunks": 0, "version": store.version}
        if old is not None:  # keep what was derived (a store that grew kept its chunks)
            done = old["valid_chunks"]
            for name, t in old["tensors"].items():
                if name == "key_outlier_tile":
                    tensors[name][:, :, :done] = t[:, :, :done]
                else:
                    per = t.shape[-1] // old["capacity"]
                    tensors[name][:, :, : done * per] = t[:, :, : done * per]
            state["valid_chunks"] = done
        store.derived[self.name] = state
        return state

    @staticmethod
    def derived_nbytes(store) -> int:
        state = store.derived.get(TritonBackend.name)
        tensors = list(state["tensors"].values()) if state is not None else []
        tensors += list(store.derived.get("triton tables", {}).values())
        return sum(t.numel() * t.element_size() for t in tensors)


def _tables(store):
    """(key, build) -> table, kept in the store's derived state (small constant tables: the Hadamard matrix)."""
    tables = store.derived.setdefault("triton tables", {})

    def get(key, build):
        if key not in tables:
            tables[key] = build()
        return tables[key]
    return get


def _chunks_of(view, first: int, last: int):
    """The ChunkRunView restricted to chunks [first, last) (its fields sliced along dim 2: chunks are independent)."""
    import dataclasses

    fields = {}
    for name in view.FIELDS:
        t = getattr(view, name)
        e = view.extent(name)
        fields[name] = t[:, :, first * e : last * e]
    return dataclasses.replace(view, **fields, derived={})


# -- what the fused decode kernels cover, for a configuration (the kernels themselves take tensors and numbers) ----
def fused_supported(config, head_dim: int, query_len: int, *, rotary_dim: int | None = None,
                    softcap: float | None = None) -> str | None:
    """None when the fused decode kernel covers this configuration and step, else the reason it does not.

    rotary_dim: channels per head the model's RoPE rotates (None: all); softcap: the attention-logit soft cap
    the model's attention function is given (Gemma 2), None when it has none."""
    if not config.pre_rope:
        return "pre_rope=False (keys stored after RoPE) is only implemented by the torch path"
    if config.compresses and config.key_axis != "channel":
        return (f"key_axis={config.key_axis!r}: the fused kernel reads keys stored per channel (key_axis='channel') "
                "only")
    if config.compresses and config.value_axis == "channel" and config.uses_outliers:
        return (f"value_axis='channel' with value outliers (method={config.method!r}): the fused kernel adds value "
                "outliers per token only")
    if head_dim < 32 or head_dim & (head_dim - 1):
        return f"head_dim={head_dim}: the fused kernel needs a power of two >= 32"
    from ..kernels import step_reason

    reason = step_reason(head_dim, query_len, rotary_dim, softcap)
    if reason:
        return reason
    if config.compresses:
        from ..compress.quant import codes_per_unit

        reason = _fused_storage_reason(config)
        if reason:
            return reason
        block = config.buffer_size & -config.buffer_size  # largest power of two dividing n_b
        if block < 16:
            return f"buffer_size={config.buffer_size} is not a multiple of 16 (kernel tiles are 16 tokens at least)"
        for bits, group, allocated in ((config.key_bits, config.key_group, config.key_bit_allocation == "query"),
                                       (config.value_bits, config.value_group, False)):
            unit = codes_per_unit(bits, allocated)
            if group % unit and not config.coarse_groups:
                return f"group size {group} is not a multiple of the {unit} codes of a {bits}-bit packing unit"
    return None


def _fused_storage_reason(config) -> str | None:
    """Storage options that the fused decode kernel does not read; the torch path does."""
    from ..kernels.views import MAX_FUSED_RANK  # no triton import

    if config.uses_lowrank and max(config.rank_prefill, config.rank_decode) > MAX_FUSED_RANK:
        return (f"rank_prefill={config.rank_prefill}/rank_decode={config.rank_decode}: the fused kernel reads "
                f"low-rank factors of rank <= {MAX_FUSED_RANK}")
    if config.rotation in ("keys", "both") and config.uses_outliers and config.outlier_ratio > 0:
        return (f"rotation={config.rotation!r} with key outliers (method={config.method!r}): the fused kernel adds "
                "key outliers in the unrotated basis only")
    return None
