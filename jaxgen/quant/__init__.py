"""Quantized weight / activation / KV formats and the algorithms that make them.

Never imports `model/` or `engine/`: algorithms work on arrays and on callables handed in.
"""

from jaxgen.quant.formats import FORMATS, QArray, QuantizationError, quantize_rtn
from jaxgen.quant.matmul import matmul

__all__ = ["FORMATS", "QArray", "QuantizationError", "matmul", "quantize_rtn"]
