"""Pure-PyTorch GEAR compression engine: the readable reference and the oracle for the kernels.

Nothing here imports transformers.
"""

from .gear import ChunkSpec, CompressedChunk, compress, decompress, side_dtype
from .lowrank import lowrank_fit
from .outliers import outliers_per_vector, select_outliers
from .quant import dequantize, pack_codes, packed_length, quantize, unpack_codes
from .rotation import hadamard, rotate

__all__ = ["ChunkSpec", "CompressedChunk", "compress", "decompress", "side_dtype", "lowrank_fit",
           "outliers_per_vector", "select_outliers", "dequantize", "pack_codes", "packed_length", "quantize",
           "unpack_codes", "hadamard", "rotate"]
