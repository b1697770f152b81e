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


#: Elements per scale of the chunk-scaled 2-bit code (four code words).
CHUNK = 64
#: The ternary threshold as a share of a chunk's mean magnitude (Ternary Weight Networks, Li & Liu 2016:
#: ``0.7 E|x|`` approximates the L2-optimal threshold for Gaussian and uniform data).
CHUNK_THRESHOLD = 0.7


def chunk_sums(x: torch.Tensor) -> torch.Tensor:
    """Sums of ``x`` float32 ``[chunks, 64]`` per row, by the halving tree every backend uses:
    ``s[j] += s[j + h]`` for ``h = 32, 16, ..., 1`` (the order fixes the rounding)."""
    half = x.shape[1] // 2
    while half >= 1:
        x = x[:, :half] + x[:, half: 2 * half]
        half //= 2
    return x[:, 0]


def chunk_scales(acc: torch.Tensor):
    """``(keep, alpha)`` of the chunk-scaled code for float32 ``acc`` ``[n]``: per element whether it
    is sent (``|acc| > 0.7 * mean |acc|`` of its chunk, finite), per chunk the magnitude sent
    (the mean ``|acc|`` of the kept elements, 0 if none). Non-finite elements count as 0."""
    n = acc.numel()
    chunks = (n + CHUNK - 1) // CHUNK
    magnitude = torch.zeros(chunks * CHUNK, dtype=torch.float32, device=acc.device)
    finite = torch.isfinite(acc)
    magnitude[:n] = torch.where(finite, acc.abs(), torch.zeros_like(acc))
    magnitude = magnitude.view(chunks, CHUNK)
    lengths = torch.full((chunks,), CHUNK, dtype=torch.float32, device=acc.device)
    if n % CHUNK:
        lengths[-1] = n % CHUNK
    tau = chunk_sums(magnitude) / lengths * torch.tensor(CHUNK_THRESHOLD, dtype=torch.float32)
    keep = magnitude > tau.unsqueeze(1)
    count = keep.sum(dim=1)
    kept = chunk_sums(torch.where(keep, magnitude, torch.zeros_like(magnitude)))
    alpha = torch.where(count > 0, kept / count.clamp(min=1).to(torch.float32), torch.zeros_like(kept))
    return keep.reshape(-1)[:n], alpha


def pack_codes(code: torch.Tensor, codes: torch.Tensor, bits: int = 2) -> None:
    """Pack int64 ``bits``-bit ``code`` ``[n]`` into int32 ``codes``, ``32 // bits`` to a word, element ``i``
    at bits ``bits * (i % (32 // bits))`` (the word's spare high bits stay zero)."""
    per_word = 32 // bits
    words = codes.numel()
    padded = torch.zeros(words * per_word, dtype=torch.int64, device=code.device)
    padded[: code.numel()] = code
    shifts = torch.arange(per_word, device=code.device, dtype=torch.int64) * bits
    packed = (padded.view(words, per_word) << shifts).sum(dim=1)  # fits in 32 bits, unsigned
    codes.copy_(torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32))


def unpack_codes(codes: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """The int64 ``bits``-bit codes ``[n]`` of int32 ``codes`` (the inverse of :func:`pack_codes`)."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, device=codes.device, dtype=torch.int64) * bits
    return ((codes.to(torch.int64).unsqueeze(1) >> shifts) & ((1 << bits) - 1)).reshape(-1)[:n]


@implements("twobit_chunk_compress", "torch")
def twobit_chunk_compress(grad, residual_in, residual_out, codes, scales) -> None:
    checks.check_twobit_chunk_compress(grad, residual_in, residual_out, codes, scales)
    acc = compensate(grad, residual_in)
    keep, alpha = chunk_scales(acc)
    scales.copy_(alpha)
    a = alpha.repeat_interleave(CHUNK)[: acc.numel()]
    positive, negative = keep & (acc > 0), keep & (acc < 0)
    code = torch.zeros(acc.shape, dtype=torch.int64, device=acc.device)
    code[positive] = _CODE_POS
    code[negative] = _CODE_NEG
    code[~torch.isfinite(acc)] = _CODE_NONFINITE
    if residual_out is not None:
        residual = acc.clone()
        residual[positive] = acc[positive] - a[positive]
        residual[negative] = acc[negative] + a[negative]
        residual_out.copy_(residual)
    pack_codes(code, codes)


@implements("twobit_chunk_decompress_add", "torch")
def twobit_chunk_decompress_add(codes, scales, out) -> None:
    checks.check_twobit_chunk_decompress_add(codes, scales, out)
    n = out.numel()
    code = unpack_codes(codes, n, 2)
    a = scales.repeat_interleave(CHUNK)[:n]
    nan = torch.full_like(a, float("nan"))
    out.add_(torch.where(code == 1, a, torch.where(code == 2, -a, torch.where(code == 0, torch.zeros_like(a), nan))))


_THREEBIT_LEVELS, _THREEBIT_NONFINITE = 3, 7


def threebit_scales(acc: torch.Tensor) -> torch.Tensor:
    """Float32 ``[ceil(n / 128)]``: each chunk's largest finite ``|acc|`` divided by 3 (0 if none)."""
    n, chunk = acc.numel(), checks.THREEBIT_CHUNK
    chunks = -(-n // chunk)
    magnitude = torch.zeros(chunks * chunk, dtype=torch.float32, device=acc.device)
    magnitude[:n] = torch.where(torch.isfinite(acc), acc.abs(), torch.zeros_like(acc))
    return magnitude.view(chunks, chunk).amax(dim=1) / torch.tensor(float(_THREEBIT_LEVELS), dtype=torch.float32)


def threebit_decoded(code: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``float(code - 3) * s`` element by element, NaN for code 7 (int64 ``code``, float32 ``s``, ``[n]``)."""
    value = (code - _THREEBIT_LEVELS).to(torch.float32) * s
    return torch.where(code == _THREEBIT_NONFINITE, torch.full_like(s, float("nan")), value)


@implements("threebit_compress", "torch")
def threebit_compress(grad, residual_in, residual_out, codes, scales) -> None:
    n = checks.check_threebit_compress(grad, residual_in, residual_out, codes, scales)
    acc = compensate(grad, residual_in)
    scale = threebit_scales(acc)
    scales.copy_(scale)
    s = scale.repeat_interleave(checks.THREEBIT_CHUNK)[:n]
    finite = torch.isfinite(acc)
    quantized = torch.round(acc / torch.where(s > 0, s, torch.ones_like(s))).clamp(-_THREEBIT_LEVELS, _THREEBIT_LEVELS)
    q = torch.where(finite & (s > 0), quantized, torch.zeros_like(acc))
    code = torch.where(finite, q.to(torch.int64) + _THREEBIT_LEVELS, torch.full_like(q, _THREEBIT_NONFINITE,
                                                                                      dtype=torch.int64))
    if residual_out is not None:
        residual_out.copy_(torch.where(finite, acc - threebit_decoded(code, s), acc))
    pack_codes(code, codes, bits=3)


@implements("threebit_decompress_add", "torch")
def threebit_decompress_add(codes, scales, out) -> None:
    n = checks.check_threebit_decompress_add(codes, scales, out)
    s = scales.repeat_interleave(checks.THREEBIT_CHUNK)[:n]
    out.add_(threebit_decoded(unpack_codes(codes, n, 3), s))
