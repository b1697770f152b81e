"""The registered ``numba`` ops: thin wrappers from torch tensors to the compiled kernels
(the counterpart of :mod:`gradcomp.backends.cuda_ops`).

Tensors reach the kernels as zero-copy NumPy views of their memory; half-precision
tensors as their raw bits (see :func:`as_array`). An in-place residual is passed as one
array and the marker ``True`` (see :func:`residual_arg`), because two aliasing arrays
would fail LLVM's runtime overlap check and run the scalar fallback loop.
"""
from __future__ import annotations

import numpy as np
import torch

from gradcomp.backends import checks, implements, implements_parts
from gradcomp.backends.numba import group_parts, threebit, topk, topk_decode, topk_parts, twobit, twobit_chunk
from gradcomp.backends.numba.concurrency import serialized
from gradcomp.backends.parts import check_parts, check_selections, spans

# Half-precision tensors cross into Numba as their bits; the integer dtype names the format.
_HALF_BITS = {torch.float16: np.int16, torch.bfloat16: np.uint16}

_TOPK_WORKSPACE = topk.Workspace()


def as_array(tensor):
    """A zero-copy NumPy view of a CPU contiguous tensor (half formats as bits), or None."""
    if tensor is None:
        return None
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"numba backend needs contiguous CPU tensors, got {tensor.device} shape {tuple(tensor.shape)}")
    bits = _HALF_BITS.get(tensor.dtype)
    if bits is None:
        return tensor.numpy()
    return tensor.view(torch.int16).numpy().view(bits)


def residual_arg(residual_in, residual_out):
    """``residual_out`` for a kernel: ``True`` when it is ``residual_in`` (in place)."""
    if residual_out is not None and residual_in is not None and residual_out.data_ptr() == residual_in.data_ptr():
        return True
    return as_array(residual_out)


@implements("twobit_compress", "numba")
@serialized
def twobit_compress(grad, residual_in, residual_out, threshold: float, codes) -> None:
    checks.check_twobit_compress(grad, residual_in, residual_out, codes)
    twobit.compress_kernel(
        as_array(grad), as_array(residual_in), residual_arg(residual_in, residual_out), np.float32(threshold),
        as_array(codes).view(np.uint8),
    )


@implements("twobit_decompress_add", "numba")
@serialized
def twobit_decompress_add(codes, threshold: float, out) -> None:
    checks.check_twobit_decompress_add(codes, out)
    twobit.decompress_add_kernel(as_array(codes).view(np.uint8), np.float32(threshold), as_array(out))


@implements("twobit_chunk_compress", "numba")
@serialized
def twobit_chunk_compress(grad, residual_in, residual_out, codes, scales) -> None:
    checks.check_twobit_chunk_compress(grad, residual_in, residual_out, codes, scales)
    twobit_chunk.compress_kernel(as_array(grad), as_array(residual_in), residual_arg(residual_in, residual_out),
                                 as_array(codes).view(np.uint32), as_array(scales))


@implements("twobit_chunk_decompress_add", "numba")
@serialized
def twobit_chunk_decompress_add(codes, scales, out) -> None:
    checks.check_twobit_chunk_decompress_add(codes, scales, out)
    twobit_chunk.decompress_add_kernel(as_array(codes).view(np.uint32), as_array(scales), as_array(out))


@implements("threebit_compress", "numba")
@serialized
def threebit_compress(grad, residual_in, residual_out, codes, scales) -> None:
    checks.check_threebit_compress(grad, residual_in, residual_out, codes, scales)
    threebit.compress_kernel(as_array(grad), as_array(residual_in), residual_arg(residual_in, residual_out),
                             as_array(codes).view(np.uint32), as_array(scales))


@implements("threebit_decompress_add", "numba")
@serialized
def threebit_decompress_add(codes, scales, out) -> None:
    checks.check_threebit_decompress_add(codes, scales, out)
    threebit.decompress_add_kernel(as_array(codes).view(np.uint32), as_array(scales), as_array(out))


@implements("topk_compress", "numba")
@serialized
def topk_compress(grad, residual_in, residual_out, values, indices) -> None:
    n, k = checks.check_topk_compress(grad, residual_in, residual_out, values, indices)
    if k == 0:  # nothing is sent (TopK gives k = 0 only for an empty tensor): residual = acc
        if residual_out is not None:
            residual_out.copy_(grad.float() if residual_in is None else grad.float() + residual_in)
        return
    _select(as_array(grad), as_array(residual_in), residual_arg(residual_in, residual_out), as_array(values),
            as_array(indices))


def _select(grad, residual_in, residual_out, values, indices) -> None:
    """:func:`~gradcomp.backends.numba.topk.compress_kernel` on NumPy views (``residual_out`` as
    :func:`residual_arg` gives it), the workspace grown after; the caller holds the kernel lock."""
    work_index, work_bits, work_bound = _TOPK_WORKSPACE.candidates(indices.dtype)
    needed = topk.compress_kernel(grad, residual_in, residual_out, values, indices, topk.chunk_count(grad.size),
                                  _TOPK_WORKSPACE.hist, work_index, work_bits, work_bound)
    _TOPK_WORKSPACE.grow(indices.dtype, *needed)


@implements_parts("topk_compress", "numba")
@serialized
def topk_compress_parts(grad, residual_in, residual_out, values, indices, parts) -> None:
    """Every part's top-k (:mod:`gradcomp.backends.parts`): the parts of one chunk in one serial call
    (:mod:`~gradcomp.backends.numba.topk_parts`), each larger part by the parallel kernel; bitwise the per-part op."""
    op = "topk_compress"
    n = checks.check_compress(op, grad, residual_in, residual_out)
    checks.check_vector(op, "values", values, checks.GRAD_DTYPES)
    checks.check_vector(op, "indices", indices, checks.INDEX_DTYPES, values.numel())
    check_selections(op, parts, n, values.numel())
    if indices.dtype == torch.int32 and n >= 2**31:  # the selection passes group positions through them
        raise ValueError(f"{op}: a group of {n} elements needs int64 indices")
    g, r_in, r_out = as_array(grad), as_array(residual_in), residual_arg(residual_in, residual_out)
    v, i = as_array(values), as_array(indices)
    small = [part for part in parts if topk.chunk_count(part.numel) == 1]
    if small:
        lo, numel, first, k = (np.array(column, dtype=np.int64) for column in zip(*small))
        work_index, work_bits, work_bound = _TOPK_WORKSPACE.candidates(i.dtype)
        needed = topk_parts.compress_parts_kernel(g, r_in, r_out, v, i, lo, lo + numel, first, first + k,
                                                  _TOPK_WORKSPACE.hist, work_index, work_bits, work_bound)
        _TOPK_WORKSPACE.grow(i.dtype, *needed)
    for part in parts:
        if topk.chunk_count(part.numel) > 1:
            piece, entries = slice(part.lo, part.lo + part.numel), slice(part.first, part.first + part.k)
            _select(g[piece], None if r_in is None else r_in[piece],
                    r_out if r_out is None or r_out is True else r_out[piece], v[entries], i[entries])


@implements("topk_decompress_add", "numba")
@serialized
def topk_decompress_add(values, indices, out) -> None:
    n, _ = checks.check_topk_decompress_add(values, indices, out)
    if topk_decode.decompress_add_kernel(as_array(values), as_array(indices), as_array(out)):
        problem = checks.topk_index_problem(indices, n)
        raise ValueError(f"topk_decompress_add: {problem}; nothing was written")


# -- the batched forms over a group's parts (gradcomp.backends.parts): one lock, one view of each array ------
def _compress_parts(op: str, block: int, per_unit: int, divides: bool):
    """``op``'s batched compress: every part in one call of :func:`group_parts.compress_kernel
    <gradcomp.backends.numba.group_parts.compress_kernel>`; ``divides``: the kernel takes a ``divisor`` (else a
    divisor is applied first, by the same float32 division)."""
    threebits = op.startswith("threebit")

    @implements_parts(op, "numba")
    @serialized
    def compress_parts(grad, residual_in, residual_out, words, parts, divisor=None) -> None:
        n = checks.check_compress(op, grad, residual_in, residual_out)
        checks.check_vector(op, "words", words, (torch.int32,))
        checks.check_vector(op, "divisor", divisor, (torch.float32,), n)
        check_parts(op, parts, n, words.numel())
        if divisor is not None and not divides:
            grad, divisor = grad.float() / divisor, None
        group_parts.compress_kernel(as_array(grad), as_array(residual_in), residual_arg(residual_in, residual_out),
                                    as_array(words).view(np.uint32), group_parts.units(tuple(parts), block, per_unit),
                                    as_array(divisor), threebits)

    return compress_parts


def _decompress_parts(op: str, decompress_kernel):
    @implements_parts(op, "numba")
    @serialized
    def decompress_add_parts(words, parts, out) -> None:
        checks.check_vector(op, "out", out, (torch.float32,))
        checks.check_vector(op, "words", words, (torch.int32,))
        check_parts(op, parts, out.numel(), words.numel())
        w, o = as_array(words).view(np.uint32), as_array(out)
        f = w.view(np.float32)
        for part in parts:
            codes, scales = spans(op, part)
            decompress_kernel(w[codes], f[scales], o[part.lo: part.lo + part.numel])

    return decompress_add_parts


threebit_compress_parts = _compress_parts("threebit_compress", threebit.TILE, threebit.PART_TILES, divides=True)
threebit_decompress_add_parts = _decompress_parts("threebit_decompress_add", threebit.decompress_add_kernel)
twobit_chunk_compress_parts = _compress_parts("twobit_chunk_compress", twobit_chunk.CHUNK, twobit_chunk.PART_CHUNKS,
                                              divides=False)
twobit_chunk_decompress_add_parts = _decompress_parts("twobit_chunk_decompress_add", twobit_chunk.decompress_add_kernel)
