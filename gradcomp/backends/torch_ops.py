"""Reference kernels in pure torch. Every other backend is tested against these.

They favour obviously-correct over fast: several passes over memory, int64 temporaries.
Contracts are in :mod:`gradcomp.backends`.
"""
from __future__ import annotations

from typing import Optional

import torch

from gradcomp.backends import checks, implements

_CODE_POS, _CODE_NEG, _CODE_NONFINITE = 1, 2, 3


def compensate(grad: torch.Tensor, residual_in: Optional[torch.Tensor]) -> torch.Tensor:
    """``acc = float32(grad) + residual_in`` as a new float32 tensor."""
    acc = grad.to(torch.float32, copy=True)
    if residual_in is not None:
        acc.add_(residual_in)
    return acc


@implements("twobit_compress", "torch")
def twobit_compress(grad, residual_in, residual_out, threshold: float, codes) -> None:
    checks.check_twobit_compress(grad, residual_in, residual_out, codes)
    acc = compensate(grad, residual_in)
    t = torch.tensor(threshold, dtype=torch.float32, device=acc.device)
    nonfinite = ~torch.isfinite(acc)
    positive = (acc >= t) & ~nonfinite
    negative = (acc <= -t) & ~nonfinite
    code = torch.zeros(acc.shape, dtype=torch.int64, device=acc.device)
    code[positive] = _CODE_POS
    code[negative] = _CODE_NEG
    code[nonfinite] = _CODE_NONFINITE
    if residual_out is not None:
        residual = acc.clone()
        residual[positive] = acc[positive] - t
        residual[negative] = acc[negative] + t
        residual_out.copy_(residual)
    words = codes.numel()
    padded = torch.zeros(words * 16, dtype=torch.int64, device=acc.device)
    padded[: acc.numel()] = code
    shifts = torch.arange(16, device=acc.device, dtype=torch.int64) * 2
    packed = (padded.view(words, 16) << shifts).sum(dim=1)  # fits in 32 bits, unsigned
    codes.copy_(torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32))


def twobit_decode(codes: torch.Tensor, threshold: float, numel: int) -> torch.Tensor:
    """Decoded float32 ``[numel]``: ``+t``, ``-t``, ``0`` or NaN per element."""
    shifts = torch.arange(16, device=codes.device, dtype=torch.int64) * 2
    code = ((codes.to(torch.int64).unsqueeze(1) >> shifts) & 3).reshape(-1)[:numel]
    table = torch.tensor([0.0, threshold, -threshold, float("nan")], dtype=torch.float32, device=codes.device)
    return table[code]


@implements("twobit_decompress_add", "torch")
def twobit_decompress_add(codes, threshold: float, out) -> None:
    checks.check_twobit_decompress_add(codes, out)
    out.add_(twobit_decode(codes, threshold, out.numel()))


def topk_select(acc: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (int64, ascending) of the ``k`` largest ``|acc|``, ties to the lower index.

    Magnitude is the bit pattern of ``|acc|`` as an integer, which orders NaN > inf >
    finite; all NaNs count as ``0x7FFFFFFF`` and tie. Packing ``(magnitude, -index)`` into one
    int64 key makes every key unique, so ``torch.topk`` has no ties left to break arbitrarily.
    """
    n = acc.numel()
    magnitude = acc.view(torch.int32).to(torch.int64) & 0x7FFFFFFF
    # NaN payload bits are not portable (GPUs produce one canonical NaN, x86 keeps the
    # input's bits), so every NaN gets the same magnitude, above inf.
    magnitude = torch.where(torch.isnan(acc), torch.full_like(magnitude, 0x7FFFFFFF), magnitude)
    index = torch.arange(n, dtype=torch.int64, device=acc.device)
    key = (magnitude << 32) | (0xFFFFFFFF - index)
    return torch.topk(key, k, sorted=False).indices.sort().values


@implements("topk_compress", "torch")
def topk_compress(grad, residual_in, residual_out, values, indices) -> None:
    checks.check_topk_compress(grad, residual_in, residual_out, values, indices)
    acc = compensate(grad, residual_in)
    selected = topk_select(acc, values.numel())
    values.copy_(acc[selected])
    indices.copy_(selected)
    if residual_out is not None:
        acc[selected] -= values.to(torch.float32)
        residual_out.copy_(acc)


@implements("topk_decompress_add", "torch")
def topk_decompress_add(values, indices, out) -> None:
    n, _ = checks.check_topk_decompress_add(values, indices, out)
    # Out-of-range, duplicate or unsorted indices raise before anything is written; valid
    # indices are unique, so index_add_ has no collisions to order.
    checks.check_topk_indices("topk_decompress_add", indices, n)
    out.index_add_(0, indices.to(torch.int64), values.to(torch.float32))
