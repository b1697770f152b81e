"""Argument checks shared by every backend's public ops, run before any kernel writes.

A kernel trusts its sizes: a residual shorter than the gradient, or a code buffer shorter
than ``ceil(n / 16)`` words, would make it read or write past the end of an allocation.
So every registered op (torch, numba, cuda) checks dtypes, shapes and sizes first and
raises ``TypeError`` (a wrong dtype) or ``ValueError`` (a wrong shape or size) saying
which argument is wrong. The checks read only metadata, never tensor data, so they cost
no device synchronisation.

:func:`topk_index_problem` also reads the indices (for the torch reference and for the
error messages of the other backends, whose decoders check indices inside the kernel).
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

GRAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_vector(
    op: str, name: str, tensor: Optional[torch.Tensor], dtypes: Sequence[torch.dtype], numel: Optional[int] = None
) -> None:
    """``tensor`` (if not ``None``) is a flat contiguous tensor of one of ``dtypes`` with
    ``numel`` elements (any count when ``numel`` is ``None``)."""
    if tensor is None:
        return
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in dtypes:
        raise TypeError(f"{op}: {name} must be {' or '.join(str(d) for d in dtypes)}, got {tensor.dtype}")
    if tensor.dim() != 1 or not tensor.is_contiguous():
        raise ValueError(f"{op}: {name} must be a flat contiguous tensor, got shape {tuple(tensor.shape)}")
    if numel is not None and tensor.numel() != numel:
        raise ValueError(f"{op}: {name} must have {numel} elements, got {tensor.numel()}")


def _check_index_dtype(op: str, indices: torch.Tensor, n: int) -> None:
    if indices.dtype == torch.int32 and n >= 2**31:
        raise TypeError(f"{op}: indices must be int64 for n >= 2**31 (n={n})")


def check_compress(op: str, grad, residual_in, residual_out) -> int:
    """The gradient and its residuals; returns ``n``."""
    check_vector(op, "grad", grad, GRAD_DTYPES)
    n = grad.numel()
    check_vector(op, "residual_in", residual_in, (torch.float32,), n)
    check_vector(op, "residual_out", residual_out, (torch.float32,), n)
    return n


def check_twobit_compress(grad, residual_in, residual_out, codes) -> int:
    """Returns ``n``; ``codes`` must be int32 ``[ceil(n / 16)]``."""
    n = check_compress("twobit_compress", grad, residual_in, residual_out)
    check_vector("twobit_compress", "codes", codes, (torch.int32,), (n + 15) // 16)
    return n


def check_twobit_decompress_add(codes, out) -> int:
    """Returns ``n = out.numel()``; ``codes`` must be int32 ``[ceil(n / 16)]``."""
    check_vector("twobit_decompress_add", "out", out, (torch.float32,))
    n = out.numel()
    check_vector("twobit_decompress_add", "codes", codes, (torch.int32,), (n + 15) // 16)
    return n


def check_twobit_chunk_compress(grad, residual_in, residual_out, codes, scales) -> int:
    """Returns ``n``; ``codes`` int32 ``[ceil(n / 16)]``, ``scales`` float32 ``[ceil(n / 64)]``."""
    n = check_compress("twobit_chunk_compress", grad, residual_in, residual_out)
    check_vector("twobit_chunk_compress", "codes", codes, (torch.int32,), (n + 15) // 16)
    check_vector("twobit_chunk_compress", "scales", scales, (torch.float32,), (n + 63) // 64)
    return n


def check_twobit_chunk_decompress_add(codes, scales, out) -> int:
    """Returns ``n = out.numel()``; ``codes`` int32 ``[ceil(n / 16)]``, ``scales`` float32 ``[ceil(n / 64)]``."""
    check_vector("twobit_chunk_decompress_add", "out", out, (torch.float32,))
    n = out.numel()
    check_vector("twobit_chunk_decompress_add", "codes", codes, (torch.int32,), (n + 15) // 16)
    check_vector("twobit_chunk_decompress_add", "scales", scales, (torch.float32,), (n + 63) // 64)
    return n


#: Elements per scale of the chunk-scaled 3-bit code, and its codes per int32 word.
THREEBIT_CHUNK = 128
THREEBIT_PER_WORD = 10


def check_threebit_compress(grad, residual_in, residual_out, codes, scales) -> int:
    """Returns ``n``; ``codes`` int32 ``[ceil(n / 10)]``, ``scales`` float32 ``[ceil(n / 128)]``."""
    n = check_compress("threebit_compress", grad, residual_in, residual_out)
    check_vector("threebit_compress", "codes", codes, (torch.int32,), -(-n // THREEBIT_PER_WORD))
    check_vector("threebit_compress", "scales", scales, (torch.float32,), -(-n // THREEBIT_CHUNK))
    return n


def check_threebit_decompress_add(codes, scales, out) -> int:
    """Returns ``n = out.numel()``; ``codes`` int32 ``[ceil(n / 10)]``, ``scales`` float32 ``[ceil(n / 128)]``."""
    check_vector("threebit_decompress_add", "out", out, (torch.float32,))
    n = out.numel()
    check_vector("threebit_decompress_add", "codes", codes, (torch.int32,), -(-n // THREEBIT_PER_WORD))
    check_vector("threebit_decompress_add", "scales", scales, (torch.float32,), -(-n // THREEBIT_CHUNK))
    return n


def check_topk_compress(grad, residual_in, residual_out, values, indices) -> Tuple[int, int]:
    """Returns ``(n, k)``: ``k = values.numel() <= n`` and ``k`` indices."""
    op = "topk_compress"
    n = check_compress(op, grad, residual_in, residual_out)
    check_vector(op, "values", values, GRAD_DTYPES)
    k = values.numel()
    check_vector(op, "indices", indices, INDEX_DTYPES, k)
    if k > n:
        raise ValueError(f"{op}: top-k of n={n} elements cannot keep k={k} (needs k <= n)")
    _check_index_dtype(op, indices, n)
    return n, k


def check_topk_decompress_add(values, indices, out) -> Tuple[int, int]:
    """Returns ``(n, k)``: ``n = out.numel()``, ``k`` values and ``k <= n`` indices.

    The indices themselves are checked by each backend's decoder (see
    :func:`topk_index_problem`): this reads metadata only.
    """
    op = "topk_decompress_add"
    check_vector(op, "out", out, (torch.float32,))
    n = out.numel()
    check_vector(op, "values", values, GRAD_DTYPES)
    k = values.numel()
    check_vector(op, "indices", indices, INDEX_DTYPES, k)
    if k > n:
        raise ValueError(f"{op}: {k} entries cannot be distinct positions of an output of {n} elements")
    _check_index_dtype(op, indices, n)
    return n, k


def topk_index_problem(indices: torch.Tensor, n: int) -> Optional[str]:
    """What is wrong with top-k ``indices`` for an output of ``n`` elements, or ``None``.

    Valid indices lie in ``[0, n)`` and strictly increase (so there are no duplicates).
    O(k) vectorised torch ops and one host synchronisation in the common (valid) case.
    """
    k = indices.numel()
    if k == 0:
        return None
    # Strictly increasing with the first >= 0 and the last < n means every index is in range.
    ok = (indices[0] >= 0) & (indices[-1] < n)
    if k > 1:
        ok = ok & (indices[1:] > indices[:-1]).all()
    if bool(ok):
        return None
    # Rare path: name the first offending position.
    out_of_range = ((indices < 0) | (indices >= n)).nonzero()
    if out_of_range.numel():
        j = int(out_of_range[0])
        return f"top-k index {int(indices[j])} at position {j} is outside [0, {n})"
    j = int((indices[1:] <= indices[:-1]).nonzero()[0]) + 1
    what = "duplicate" if int(indices[j]) == int(indices[j - 1]) else "unsorted"
    return (
        f"top-k indices must strictly increase: {what} index {int(indices[j])} at position {j} "
        f"after {int(indices[j - 1])}"
    )


def check_topk_indices(op: str, indices: torch.Tensor, n: int) -> None:
    """Raise ``ValueError`` naming the first bad index (see :func:`topk_index_problem`)."""
    problem = topk_index_problem(indices, n)
    if problem is not None:
        raise ValueError(f"{op}: {problem}; nothing was written")
