"""What float8 quantizes and into what: the two float8 formats, the matmul ops whose operands
take them, and the powers of two each matmul dtype holds exactly — a scale is one, so that
scaling and unscaling add no error of their own."""
from __future__ import annotations

from dataclasses import dataclass

from tensorflow.core.framework import types_pb2


@dataclass(frozen=True)
class Format:
    """One float8 format: its name, DataType and largest finite value."""

    name: str
    dtype: int
    max: float


E4M3 = Format("float8_e4m3fn", types_pb2.DT_FLOAT8_E4M3FN, 448.0)  # weights and activations: no Inf
E5M2 = Format("float8_e5m2", types_pb2.DT_FLOAT8_E5M2, 57344.0)  # gradients: 5 exponent bits, Inf exists

# The two-operand matmuls whose operands are quantized: op -> number of data inputs it must have.
MATMUL_OPS = {"MatMul": 2, "BatchMatMul": 2, "BatchMatMulV2": 2, "Einsum": 2, "Conv2D": 2}
# dtype -> (lowest, highest): 2**x is exact in dtype for every whole x between them. float16
# down to its smallest subnormal (its range is narrow: scales need all of it); float32 and
# bfloat16 their normal range, where 2**-x is normal too. A step reads it for the scale or
# for its reciprocal, whichever it holds in the matmul's dtype.
EXACT_POWERS = {types_pb2.DT_HALF: (-24, 15), types_pb2.DT_BFLOAT16: (-126, 126), types_pb2.DT_FLOAT: (-126, 126)}
