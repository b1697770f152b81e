"""MXNet's 2-bit threshold quantization, 16 codes to a 32-bit word."""
from __future__ import annotations

import math
from typing import Optional

import torch

from gradcomp.backends import kernel
from gradcomp.compressors.base import Compressor, check_gradient
from gradcomp.payload import Payload, PayloadLayout


class TwoBit(Compressor):
    """``acc >= t`` sends ``+t``, ``acc <= -t`` sends ``-t``, anything else sends 0.

    Payload: ``codes`` int32 ``[ceil(n / 16)]``; the bit layout is documented in
    :mod:`gradcomp.backends`. With error feedback the residual keeps ``acc - sent``.
    """

    uses_error_feedback = True

    def __init__(self, threshold: float = 0.5):
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
            raise TypeError(f"TwoBit(threshold=...) must be a positive number, got {type(threshold).__name__}")
        if not math.isfinite(threshold) or threshold <= 0:
            raise ValueError(f"TwoBit(threshold={threshold!r}): threshold must be finite and > 0")
        # Kernels compare in float32; store the float32 value so every backend agrees.
        self.threshold = float(torch.tensor(threshold, dtype=torch.float32))
        if self.threshold <= 0 or not math.isfinite(self.threshold):
            raise ValueError(f"TwoBit(threshold={threshold!r}) is not a positive finite float32")

    def layout(self, numel: int, dtype: torch.dtype) -> PayloadLayout:
        return PayloadLayout((("codes", torch.int32, (numel + 15) // 16),))

    def compress(self, tensor, residual=None, residual_out=None, backend: Optional[str] = None) -> Payload:
        check_gradient(tensor)
        payload = self.layout(tensor.numel(), tensor.dtype).allocate(tensor.device)
        op = kernel("twobit_compress", tensor.device, backend)
        op(tensor, residual, residual_out, self.threshold, payload["codes"])
        return payload

    def decompress_add(self, payload: Payload, out: torch.Tensor, backend: Optional[str] = None) -> None:
        kernel("twobit_decompress_add", out.device, backend)(payload["codes"], self.threshold, out)

    def __repr__(self) -> str:
        return f"TwoBit(threshold={self.threshold})"
