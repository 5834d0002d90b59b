"""The decode-path cost model: under backend="auto", whether a CUDA decode step of one layer takes the fused kernel
or the memory-bound fallback (the reconstruction kernel writes the history dense, then the model's SDPA).

For each path, with its kernels run one after the other,

    time = sum over its kernels of max(bytes / bandwidth, warp instructions / issue rate) + launches * launch_s

    fused     one kernel reads the compressed history (+ the buffer) once and issues, per token, KV head and
              16-row query tile, `fused_instructions(config, tensor_core)` warp instructions (the tensor-core kernel
              for 16-bit models, the register kernel for float32 ones): the main-loop figure of the compile
              report (`python scripts/dev/compile_check.py --sass-report`, results/decode-kernel-sass), from its
              per-term breakdown; 2 launches (main + split merge)
    fallback  the reconstruction kernel reads the compressed history and writes it dense in the model dtype
              (`reconstruct_instructions(config)` per element, 32 elements per warp instruction), then SDPA reads
              the dense history and the buffer (memory-bound at `bandwidth`); `FALLBACK_LAUNCHES` launches (a
              reconstruction per store, the sink/buffer rotations and copies, SDPA)

and the fused kernel is chosen when its time is not larger. Bytes per token come from the format's fields
(`chunk_fields`, the memory report's declarations). The constants of `Calibration` are what one H200 run
measured (results/gpu) or stated assumptions; `calibrate` (or GEAR_HF_COST) replaces them once the GPU benchmark
(scripts/bench_decode_attention.py, scripts/bench_gpu_generate.py) has timed both paths on a machine.

Everything here is arithmetic on Python numbers (no tensors, no device): tests call `choose_decode_path` directly.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields, replace

# Main-loop warp instructions per token and KV head of the fused kernel (compile report, sm_90, head_dim 128, bf16,
# GQA 4, q_len 1, 32-token blocks, 4 warps; results/decode-kernel-sass/decode-kernel-sass.md, "what each of GEAR's
# terms costs": the loop compiled without each term, / 8 tokens per warp-instruction of the loop body).
BACKBONE = {2: 108.5, 3: 146.0, 4: 114.0}  # the quantized backbone alone (codes, stats, RoPE, dots, softmax)
# What the terms cost on top of it (gear-2's rows; 16-bit factors: gear2-f16's). Removed one at a time the four
# terms cost more than removed together (they share loads and addresses), so a format with both outliers and
# low-rank factors takes the joint figure ("all four": gear-2 108.5 + 118.1 = 226.6, the report's total 227).
OUTLIERS = 50.6 + 38.4  # value outliers + key outliers, each removed alone
LOWRANK = {8: 34.3 + 32.0, 16: 21.3 + 24.6}  # key + value low-rank terms, by factor bits, each removed alone
OUTLIERS_AND_LOWRANK = {8: 945 / 8, 16: 812 / 8}  # all four removed together
# GearConfig() (allocated key widths as bit planes, 3-bit rotated values, sinks) measured 172 in the same report;
# its backbone at 3 bits is 146, so the planes and the rotation cost the difference.
PLANES_AND_ROTATION = 172.0 - BACKBONE[3]
# The tensor-core kernel (Triton backend, fp16/bf16 queries: `kernels.tensor_core_reason`), same report and counting
# (`python scripts/dev/compile_check.py --sass-report`, its "tensor-core" lines; results/decode-kernel-sass): its
# main loop against the register kernel's for the two formats the report compiles. Other formats take the ratio of
# the measured one they resemble (outliers: gear-2's; else GearConfig()'s), an estimate until the report counts them.
TENSOR_CORE_MEASURED = {"gear2": (227.0, 190.5), "default": (172.0, 128.5)}  # (register, tensor-core)
# The reconstruction kernel's SASS per element written, (keys, values): the compile report's
# (`python scripts/dev/compile_check.py --reconstruct-report`; sm_90, head_dim 128, bf16, 64-token tiles, 4 warps,
# Triton 3.9's ptxas, 0 spills) whole-program figure of a prompt chunk (its main loop for each of a program's 4 tiles
# + the setup and the key outliers' scatter once): what a long history is made of. Main loop alone: gear-2 10.1 / 9.3,
# GearConfig() 11.5 / 10.9, every shipped configuration <= 11.7 (the target: <= 12); before the tiled kernel:
# 64.2 / 33.0 and 39.0 / 32.8.
RECONSTRUCT_INSTRUCTIONS = {"gear2": (11.9, 10.7), "default": (12.6, 11.7)}


def reconstruct_instructions(config) -> float:
    """SASS per element (keys and values alike) the reconstruction kernel issues for a config: GearConfig()'s figure
    for allocated key widths or a rotation, gear-2's for every other format. Assumption (not compiled by the
    report): formats other than those two cost what the nearest of them does; gear-2's has every term (outliers,
    low-rank factors), so formats without them likely cost less."""
    near = "default" if config.key_bit_allocation == "query" or config.rotation != "none" else "gear2"
    return sum(RECONSTRUCT_INSTRUCTIONS[near]) / 2


FALLBACK_LAUNCHES = 8  # keys and values: prompt-chunk and decode-chunk reconstruction, buffer rotation/copies; SDPA
FUSED_LAUNCHES = 2


@dataclass(frozen=True)
class Calibration:
    """Machine constants of the cost model (H200 unless calibrated)."""

    # fp16 SDPA read 268.6 MB in 0.073 ms at T=8k, batch 8, Llama-3-8B heads (results/gpu/README.md): measured
    bandwidth: float = 268.6e6 / 0.073e-3  # bytes/s
    # the fused kernel issued 171M warp instructions (326/token/kv-head static count x 8192 x 8 x 8) in 0.74 ms
    # (results/gpu, the best launch variant): measured rate of that kernel, ~22% of peak issue
    fused_issue_rate: float = 171e6 / 0.74e-3  # warp instructions/s
    # assumption (not measured): a streaming kernel with many warps in flight issues at half of the H200's peak
    # (132 SMs x 4 schedulers x 1.98 GHz)
    reconstruct_issue_rate: float = 0.5 * 132 * 4 * 1.98e9
    launch_s: float = 5e-6  # assumption: per kernel launch, eager (CUDA graphs take most of it away)


DEFAULT = Calibration()


def calibration() -> Calibration:
    """The calibration in force: DEFAULT, with the fields of the JSON object in GEAR_HF_COST (if set) replaced."""
    text = os.environ.get("GEAR_HF_COST", "").strip()
    return calibrate(DEFAULT, **json.loads(text)) if text else DEFAULT


def calibrate(base: Calibration = DEFAULT, **measured: float) -> Calibration:
    known = {f.name for f in fields(Calibration)}
    unknown = sorted(set(measured) - known)
    if unknown:
        raise ValueError(f"unknown calibration field(s) {unknown}; known: {sorted(known)}")
    return replace(base, **{k: float(v) for k, v in measured.items()})


def fused_instructions(config, tensor_core: bool = False) -> float:
    """Main-loop warp instructions per token and KV head (one 16-row query tile) of the fused kernel for a config,
    from the compile report's backbone and per-term figures; tensor_core: of the tensor-core kernel (scaled by
    `TENSOR_CORE_MEASURED`)."""
    count = _register_instructions(config)
    if tensor_core:
        outliers = config.uses_outliers and config.outlier_ratio > 0
        register, tc = TENSOR_CORE_MEASURED["gear2" if outliers else "default"]
        count *= tc / register
    return count


def _register_instructions(config) -> float:
    allocated = config.key_bit_allocation == "query"
    bits = max(round(config.value_bits), 2 if allocated else round(config.key_bits))
    count = BACKBONE.get(bits, BACKBONE[4])  # 8 bits: the 4-bit figure (not measured)
    if allocated or config.rotation != "none":
        count += PLANES_AND_ROTATION
    outliers = config.uses_outliers and config.outlier_ratio > 0
    if outliers and config.uses_lowrank:
        count += OUTLIERS_AND_LOWRANK[config.factor_bits]
    elif outliers:
        count += OUTLIERS
    elif config.uses_lowrank:
        count += LOWRANK[config.factor_bits]
    return count


def compressed_bytes_per_token(config, head_dim: int) -> float:
    """Bytes one decode-chunk token of one KV head stores, keys + values (the format's declared fields, 16-bit
    side information)."""
    import torch

    from ..format import layer_formats

    n = config.buffer_size
    total = 0
    for fmt in layer_formats(config):
        total += sum(f.nbytes() for f in fmt.fields(fmt.decode, n, head_dim, torch.bfloat16))
    return total / n


@dataclass(frozen=True)
class PathCosts:
    fused_s: float
    fallback_s: float

    @property
    def choice(self) -> str:
        return "fused" if self.fused_s <= self.fallback_s else "fallback"


def decode_path_costs(config, *, tokens: int, batch: int, kv_heads: int, query_heads: int, head_dim: int,
                      query_len: int = 1, buffered: int = 0, model_bytes: int = 2, tensor_core: bool | None = None,
                      cal: Calibration | None = None) -> PathCosts:
    """Estimated seconds of one layer's decode attention on each path. tokens: compressed tokens per row (the
    longest row's); buffered: full-precision tokens per row (sink + buffer); model_bytes: bytes per element of the
    model dtype; tensor_core: whether the fused path is the tensor-core kernel (None: as the Triton backend decides,
    for 2-byte models; False: the register kernel)."""
    if tensor_core is None:
        tensor_core = model_bytes == 2
    cal = cal or calibration()
    heads = batch * kv_heads
    dense_elements = heads * (tokens + buffered) * head_dim * 2  # keys + values
    buffer_bytes = heads * buffered * head_dim * 2 * model_bytes
    compressed = heads * tokens * compressed_bytes_per_token(config, head_dim)
    tiles = -(-(query_heads // kv_heads) * query_len // 16)
    fused_issue = fused_instructions(config, tensor_core) * (tokens + buffered) * heads * tiles
    fused = max((compressed + buffer_bytes) / cal.bandwidth, fused_issue / cal.fused_issue_rate) \
        + FUSED_LAUNCHES * cal.launch_s
    dense_written = heads * tokens * head_dim * 2 * model_bytes
    reconstruct_issue = heads * tokens * head_dim * 2 * reconstruct_instructions(config) / 32
    reconstruct = max((compressed + dense_written) / cal.bandwidth, reconstruct_issue / cal.reconstruct_issue_rate)
    sdpa = dense_elements * model_bytes / cal.bandwidth
    return PathCosts(fused, reconstruct + sdpa + FALLBACK_LAUNCHES * cal.launch_s)


def choose_decode_path(config, **shape) -> str:
    """"fused" or "fallback" for one layer's decode step (`decode_path_costs`' arguments)."""
    return decode_path_costs(config, **shape).choice
