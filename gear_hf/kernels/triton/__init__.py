"""Fused GEAR decode attention: attend straight from compressed storage, given as tensors (`views`).

For each (row, KV head, 16-row tile of the M = group * q_len query rows) one program (or `num_splits` programs,
flash-decoding style) streams over that row's tokens in row-local order

    [ sink (full precision) | prompt chunk | decode chunks of n_b | buffer (full precision, or per token) ]

and a second small kernel merges the splits: two launches per layer-step, no allocation (workspaces are cached
per device and size), no memset. Compressed blocks are decoded in registers, never written back:

* codes of 2, 4 or 8 bits loaded as 32-bit words (`_unpack_words`: shifts and masks in registers; a key word
  holds 4 channels' bytes, a value word 32/bits channels of one token); 3 bits (8 codes in 3 bytes, a 2-bit and
  a 1-bit plane, as gear_hf.compress.quant packs) byte by byte (`_unpack_3bit_units`), each byte loaded once;
* keys (per channel over token groups): unpack along tokens, dequantize with the group's scale/minimum (one row
  of statistics per block when a group spans whole blocks), add the low-rank term A·Bᵀ as a tensor-core dot
  accumulating into the dequantized tile (rank padded to 16 in registers: only A's R columns, loaded once per
  block for both halves, and Bᵀ's R rows, loaded once per chunk, are read; int8 factors: their per-column
  scales folded into Bᵀ), un-rotate Walsh–Hadamard-rotated keys (two [BN, d/2]x[d/2, d/2] dots),
  rotate the pre-RoPE key by its stored position (cos/sin from the rotary module's inv_freq, so
  llama3/linear/yarn scaling is covered) and take q·k (tl.dot); the softmax scale and the rotary
  attention_scaling are folded into the query once;
* key outliers (fixed 2k per channel over a chunk) come sorted by token within their chunk with per-16-token
  offsets (`views.prepare_derived`, once per chunk): each block reads only its own outliers and adds their
  exact score terms v·(q_j cos ± q_{j±d/2} sin) through a one-hot tl.dot — no score buffer, no atomics;
* values (per token over channel groups): unpack along channels (each word once), dequantize with statistics
  loaded once per group, add the token's outliers, accumulate P·V̂ with tl.dot and the low-rank term as
  (P·A)·Bᵀ, two small dots (never A·Bᵀ); rotated values are attended in the rotated basis (the sink and buffer
  values rotated on the fly) and the output is un-rotated once per row in the merge kernel (P·V·H·H = P·V);
* a buffer held per token (`views.CodedTailView`: 8-bit codes, or 4-bit codes of the rotated vector, one scale
  and minimum per token) is read as stored, in 16-token steps (`buffer_tiles._buffer_block`): keys code*scale+min then
  RoPE, values in the attended basis (a rotated tail as stored when values are attended rotated); this step's own
  tokens, exact in `StreamView.buffer`, in a second online-softmax step of the blocks that hold any;
* online softmax in float32 (exp2), causal inside the new tokens and the sliding window on row-local indices
  (padding is not stored, so a row's indices are exactly its real tokens); blocks wholly outside the window
  are skipped, not just masked;
* cos/sin: the float32 angle pos*inv_freq (as HF computes it), reduced to [-pi, pi] exactly enough (~1e-6 rad
  at 3e4 rad), then the hardware sin/cos approximations on the GPU (exact ones in the interpreter).

Launches run inside `torch.cuda.device(query.device)`, on that device's current stream (layers spread over
several GPUs by a `device_map`). Integer arguments that change during generation (lengths, split count,
strides that grow with the storage) are not specialized on, so the kernel compiles once per configuration.

Operands of tl.dot are cast to the model dtype (fp16/bf16: tensor cores) or stay float32 (`ieee`); under the
CPU interpreter bf16 is upcast to float32 (the interpreter computes bf16 dots wrong). Everything else is
float32. Supported: keys axis="channel", values axis="token" (the defaults) or "channel" (read like keys; without
value outliers), pre_rope=True, every bit width (and key widths allocated per channel, read from their bit planes),
rotation, int8 factors and group size, except key outliers of rotated keys; the other combinations use the torch
path (see gear_hf.backends.triton_backend.fused_supported).

The modules, host to device:

* `launch` - `decode_attention`: checks, tiling, the split count, workspaces and the two launches;
* `args` - one argument builder per stream kind (`key_run_args`, `value_run_args`): a run's pointers, head
  strides and constexprs under names, turned into the kernel's parameters of that run;
* `sizing` - the split count from SM counts and resident programs (properties of the device and of a compiled
  configuration), and the Hadamard table builder; what is derived from a cache's data (sorted key outliers,
  workspaces, tables) the caller passes in (the store's `derived`, the cache's `KernelState`);
* `decode_kernel` - the main kernel and the kernel merging its splits;
* `tc_kernel`, `tc_tiles` - the tensor-core kernel (`decode_attention(..., tensor_core=True)`, what the Triton
  backend runs for fp16/bf16 queries: `gear_hf.kernels.tensor_core_reason`): the same program layout and merge,
  with per-token value statistics folded into the probabilities, bit planes read as aligned words with their
  offsets computed once per chunk, and outliers scattered into a zeroed scratch tile (one store each) and read
  back dense instead of compared per element and slot; the compile report counts it next to this kernel;
* `tiles` - one block of compressed or full-precision tokens, key outliers;
* `ops` - dots, sin/cos and RoPE, low-rank factors, the Hadamard un-rotation, the online-softmax step;
* `unpack` - packed codes, 3-bit units, bit planes and 16-bit rows unpacked in registers.

Nothing here imports a cache: the kernels take tensors and views (`gear_hf.kernels.views`).
"""
