"""Pure-PyTorch GEAR compression engine: the readable reference and the oracle for the kernels.

Nothing here imports transformers.
"""

from .gear import ChunkSpec, CompressedChunk, compress, decompress
from .lowrank import lowrank_fit
from .outliers import outliers_per_side, select_outliers
from .quant import dequantize, pack_codes, quantize, unpack_codes

__all__ = ["ChunkSpec", "CompressedChunk", "compress", "decompress", "lowrank_fit", "outliers_per_side",
           "select_outliers", "dequantize", "pack_codes", "quantize", "unpack_codes"]
