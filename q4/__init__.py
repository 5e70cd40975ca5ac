"""q4: 4-bit (NF4/FP4) and 8-bit blockwise quantization on one set of native
kernels, shared by the PyTorch (q4torch) and JAX (q4jax) front ends.

This package is framework-neutral: the kernel library loader, the format
constants (read from the library), the numpy-level QuantState schema and
numpy entry points to the CPU kernels.
"""

from q4 import checkpoint
from q4._src.formats import (
    QUANT_TYPES,
    check_blocksize,
    code_table,
    max_blocksize,
    min_blocksize,
    nested_blocksize,
)
from q4._src.kernels import (
    dequantize_4bit,
    dequantize_blockwise,
    gemm_4bit,
    gemm_4bit_grad_input,
    int8_grad_input,
    int8_linear,
    int8_quantize_rows,
    quantize_4bit,
    quantize_blockwise,
    quantize_nested,
)
from q4._src.native import (
    KernelError,
    NativeLibraryError,
    cpu_features,
    cpu_has_amx,
    cpu_has_avx2,
    cpu_has_avx512,
    cpu_has_avx512_bf16,
    cpu_isa,
    cuda_device_count,
    has_cuda,
    library_path,
    num_threads,
    set_cpu_isa,
    set_num_threads,
)
from q4._src.quant_state import QuantState, QuantStateError
from q4._src.report import QuantizeReport, ReportRow

__version__ = "0.1.0"

__all__ = [
    "QUANT_TYPES",
    "QuantizeReport",
    "ReportRow",
    "KernelError",
    "NativeLibraryError",
    "QuantState",
    "QuantStateError",
    "check_blocksize",
    "checkpoint",
    "code_table",
    "cpu_has_avx2",
    "cpu_has_avx512",
    "cpu_has_amx",
    "cpu_has_avx512_bf16",
    "cpu_features",
    "cpu_isa",
    "cuda_device_count",
    "dequantize_4bit",
    "dequantize_blockwise",
    "gemm_4bit",
    "gemm_4bit_grad_input",
    "has_cuda",
    "int8_grad_input",
    "int8_linear",
    "int8_quantize_rows",
    "library_path",
    "max_blocksize",
    "min_blocksize",
    "nested_blocksize",
    "num_threads",
    "quantize_4bit",
    "quantize_blockwise",
    "quantize_nested",
    "set_cpu_isa",
    "set_num_threads",
]
