"""CPU kernels (numba), for the fused decode attention and the reference path (the numba backend runs them:
`gear_hf.backends.numba_backend`).

* `read` - a chunk run decompressed, and keys rotated, in one pass (`decompress_into`, or `prepared` (memoised per
  state of the storage) and `decompress_run` every step; `rotate_into`); its loops are in `dequant`
* `compress` - a chunk's outliers, quantized backbone and residual (`compress_backbone`), and the finiteness check
  of what is compressed (`all_finite`); its stages are in `outlier_select`, `quantize` and `pack`
* `lowrank` - the low-rank factors fitted to that residual (`fit_factors`)
* `attend` - the fused decode attention over a layer's storage (`decode_attention`, what the Triton kernel computes;
  `gear_hf.backends.numba_backend.attend_supported` says which configurations it reads); `attend_args` hands it
  the storage views (runs prepared once per write, the coded buffer's fields in place); `query` makes its query rows
  (a query handed before RoPE rotated there, bit for bit as the host would: `rotates_query`)
* `centers` - a centered buffer's stored centers as the (scales, centers) the kernels read (`decode_centers`)
* `tail` - the buffer held per token, 8 bits or 4 bits rotated: the step's tokens encoded into it (`encode_staged`,
  bit for bit `compress` with `format.INT8_TOKENS` / `INT8_ROTATED_TOKENS` / `INT4_TOKENS`); `attend` reads its
  codes directly
* `arrays` - torch tensors as the numpy arrays the loops read
* `jit` - `kernel`, the loops' numba.njit, cached on disk under a hash of every source here (numba alone keys a
  function on its own file, missing a changed helper of another)
* `threads` - how many threads `attend` splits its (row, KV head) pairs over: torch's count, where numba's threading
  layer is thread-safe

Each entry point has a `*_supported` check (or returns None) for what it covers; the torch code is the oracle they
equal (bit for bit, except where a low-rank term is summed or fitted: to float32 rounding). numba is imported on
first use only (`import gear_hf` stays light); compiled loops are cached on disk (`jit`).
"""

from .attend import decode_attention, query_rotation_tables, rotates_query
from .centers import centers_supported, decode_centers
from .compress import all_finite, compress_backbone, compress_supported
from .lowrank import fit_factors
from .read import (
                   Run,
                   decompress_into,
                   decompress_run,
                   decompress_supported,
                   prepare,
                   prepared,
                   rotate_into,
                   rotate_supported,
)
from .tail import encode_staged, encode_supported, tail_format

__all__ = ["Run", "all_finite", "centers_supported", "compress_backbone", "compress_supported", "decode_attention",
           "query_rotation_tables", "rotates_query", "decode_centers",
           "decompress_into", "decompress_run", "decompress_supported", "encode_staged", "encode_supported",
           "fit_factors", "prepare", "prepared", "rotate_into", "rotate_supported", "tail_format"]
