"""Weight-only quantization by module swap: int8 per-channel and int4 group-wise linears, an int8 embedding.

The formats and the CPU modules are in `formats`; `dot` has the integer-dot-product forms (AVX-512 VNNI CPUs) and
`cuda` tinygemm's int4. `quantized_linear` picks among them for a device and dtype. `mxfp4` is the MXFP4 format
(gpt-oss's experts, GGUF's MXFP4) and `experts` the expert stacks of mixture-of-experts layers on CPU, which
`experts.expert_stack` picks as `quantized_linear` picks a linear.
"""
# No `from __future__ import annotations`: TorchScript reads the linears' annotations as types.
import torch

from engine.model.quant import cuda as quant_cuda, dot as quant_dot
from engine.config import QUANT_MODES, QuantMode
from engine.model.quant.formats import (GROUP_SIZE, Affine4Bit, Int4Linear, Int8Embedding, Int8Linear,
                                        PackedLinear, dense_copy_bytes, int4_matmul, int4_supported,
                                        kernel_dense_weights, quantize_4bit, quantize_int8)

__all__ = ["GROUP_SIZE", "QUANT_MODES", "QuantMode", "Affine4Bit", "Int4Linear", "Int8Embedding", "Int8Linear",
           "PackedLinear", "dense_copy_bytes", "int4_matmul", "int4_supported", "kernel_dense_weights", "quantize_4bit",
           "quantize_int8", "quantized_linear"]


def quantized_linear(weight: torch.Tensor | Affine4Bit, bias: torch.Tensor | None, mode: str,
                     dtype: torch.dtype, keep_dense: bool = False,
                     device: torch.device = torch.device("cpu")) -> PackedLinear:
    """The module replacing an nn.Linear in `mode` ("int8" or "int4"), with a dense copy for big calls if asked,
    its buffers on `device`.

    A bfloat16 model on a CPU with AVX-512 VNNI gets the integer-dot-product forms of engine/model/quant/dot.py, one on
    CUDA int4 through tinygemm (engine/model/quant/cuda.py). int4 keeps 4-bit sources exact and quantizes float
    sources; a GGUF tensor stored with more bits (Q5, Q6_K, Q8_0) is passed in dequantized with `mode` "int8" by
    the loader, so its precision is not thrown away.
    """
    if device.type == "cuda" and mode == "int4" and int4_supported(weight.shape):
        four_bit = weight if isinstance(weight, Affine4Bit) else quantize_4bit(weight)
        return quant_cuda.Int4CudaLinear(four_bit, bias, dtype, keep_dense, device)
    dot = device.type == "cpu" and quant_dot.dot_kernels_serve(dtype)
    if mode == "int4" and int4_supported(weight.shape) and device.type == "cpu":
        four_bit = weight if isinstance(weight, Affine4Bit) else quantize_4bit(weight)
        return (quant_dot.Int4DotLinear if dot else Int4Linear)(four_bit, bias, dtype, keep_dense)
    dense = weight.dequantize() if isinstance(weight, Affine4Bit) else weight
    if dot and int4_supported(dense.shape):  # the kernel's blocks of 32 inputs, as int4's groups
        return quant_dot.Int8DotLinear(*quantize_int8(dense), bias, dtype, keep_dense)
    return Int8Linear(*quantize_int8(dense), bias, dtype, keep_dense).to(device)
