"""Top-k sparsification: send the ``k`` entries of largest magnitude."""
from __future__ import annotations

import math
from typing import Optional

import torch

from gradcomp.backends import kernel
from gradcomp.compressors.base import Compressor, check_gradient
from gradcomp.payload import Payload, PayloadLayout
from gradcomp.validation import check_layout


class TopK(Compressor):
    """Exact top-k by magnitude, ``k = max(1, ceil(ratio * n))``.

    Payload: ``values`` ``[k]`` in the gradient's dtype, then ``indices`` ``[k]`` int32
    (int64 when ``n >= 2**31``), ascending. Ties go to the lower index, so every backend
    selects the same set and the result is deterministic.
    """

    uses_error_feedback = True

    def __init__(self, ratio: float = 0.01):
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
            raise TypeError(f"TopK(ratio=...) must be a number in (0, 1], got {type(ratio).__name__}")
        if not math.isfinite(ratio) or not 0.0 < ratio <= 1.0:
            raise ValueError(f"TopK(ratio={ratio!r}): ratio must be finite and in (0, 1], e.g. 0.01 for 1%")
        self.ratio = float(ratio)

    def k(self, numel: int) -> int:
        """How many entries a ``[numel]`` tensor sends."""
        return min(numel, max(1, math.ceil(self.ratio * numel)))

    @staticmethod
    def index_dtype(numel: int) -> torch.dtype:
        return torch.int64 if numel >= 2**31 else torch.int32

    def layout(self, numel: int, dtype: torch.dtype) -> PayloadLayout:
        k = self.k(numel)
        return PayloadLayout((("values", dtype, k), ("indices", self.index_dtype(numel), k)))

    def compress(self, tensor, residual=None, residual_out=None, backend: Optional[str] = None) -> Payload:
        check_gradient(tensor)
        payload = self.layout(tensor.numel(), tensor.dtype).allocate(tensor.device)
        op = kernel("topk_compress", tensor.device, backend)
        op(tensor, residual, residual_out, payload["values"], payload["indices"])
        return payload

    def check_payload(self, payload: Payload, numel: int) -> None:
        """Raise ``ValueError`` unless the layout fits ``[numel]`` and the indices lie in
        ``[0, numel)`` strictly increasing (so no duplicates). O(k), one host sync."""
        check_layout(self, payload, numel)
        indices = payload["indices"]
        k = indices.numel()
        if k == 0:
            return
        # Strictly increasing with the first >= 0 and the last < n means every index is in range.
        ok = (indices[0] >= 0) & (indices[-1] < numel)
        if k > 1:
            ok = ok & (indices[1:] > indices[:-1]).all()
        if bool(ok):
            return
        # Rare path: say exactly what is wrong, with the first offending position.
        out_of_range = ((indices < 0) | (indices >= numel)).nonzero()
        if out_of_range.numel():
            j = int(out_of_range[0])
            raise ValueError(f"top-k index {int(indices[j])} at position {j} is outside [0, {numel})")
        j = int((indices[1:] <= indices[:-1]).nonzero()[0]) + 1
        what = "duplicate" if int(indices[j]) == int(indices[j - 1]) else "unsorted"
        raise ValueError(
            f"top-k indices must strictly increase: {what} index {int(indices[j])} at position {j} "
            f"after {int(indices[j - 1])}"
        )

    def decompress_add(self, payload: Payload, out: torch.Tensor, backend: Optional[str] = None) -> None:
        kernel("topk_decompress_add", out.device, backend)(payload["values"], payload["indices"], out)

    def __repr__(self) -> str:
        return f"TopK(ratio={self.ratio})"
