"""Top-k sparsification: send the ``k`` entries of largest magnitude."""
from __future__ import annotations

import math
from typing import Optional

import torch

from gradcomp.backends import kernel
from gradcomp.backends.checks import topk_index_problem
from gradcomp.compressors.base import Compressor, check_gradient
from gradcomp.compressors.registry import spec_name
from gradcomp.payload import Payload, PayloadLayout
from gradcomp.validation import check_layout


@spec_name("topk", params=("density",))
class TopK(Compressor):
    """Exact top-k by magnitude, ``k = max(1, ceil(density * n))``.

    ``density`` is the fraction of entries kept (0.01 keeps 1%). Spec: ``"topk:0.01"``.

    Payload: ``values`` ``[k]`` in the gradient's dtype, then ``indices`` ``[k]`` int32
    (int64 when ``n >= 2**31``), ascending. Ties go to the lower index, so every backend
    selects the same set and the result is deterministic.
    """

    uses_error_feedback = True
    sparsifies = True

    DEFAULT_DENSITY = 0.01

    def __init__(self, density: float = DEFAULT_DENSITY):
        #: The fraction of entries kept, in (0, 1].
        self.density = self._checked_density(density)

    @staticmethod
    def _checked_density(density) -> float:
        if isinstance(density, bool) or not isinstance(density, (int, float)):
            raise TypeError(
                f"TopK(density=...) must be a number in (0, 1], got {type(density).__name__}"
            )
        if not math.isfinite(density) or not 0.0 < density <= 1.0:
            raise ValueError(
                f"TopK(density={density!r}): the fraction of entries kept must be finite "
                "and in (0, 1], e.g. 0.01 for 1%"
            )
        return float(density)

    def k(self, numel: int) -> int:
        """How many entries a ``[numel]`` tensor sends."""
        return min(numel, max(1, math.ceil(self.density * numel)))

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
        problem = topk_index_problem(payload["indices"], numel)
        if problem is not None:
            raise ValueError(problem)

    def sent_indices(self, payload: Payload) -> torch.Tensor:
        return payload["indices"]

    def decompress_add(self, payload: Payload, out: torch.Tensor, backend: Optional[str] = None) -> None:
        kernel("topk_decompress_add", out.device, backend)(payload["values"], payload["indices"], out)

    def __repr__(self) -> str:
        return f"TopK(density={self.density!r})"
