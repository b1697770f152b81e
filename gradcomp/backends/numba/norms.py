"""The norms of a step's gradients and of their quotients by denominators, in one pass, bitwise torch's.

An optimizer stage reads two statistics of a step's gradients: the spike guard's ``rms(g / d)`` and the live level's
``rms(g)`` (:mod:`gradcomp.optim.step_norms`). torch computes them as ``_foreach_norm(_foreach_div(grads, denoms))``
and ``_foreach_norm(grads)``: three passes and a new tensor as large as the gradients. ``quotient_norms`` reads each
gradient and denominator once and writes nothing but the norms, with the same bits. torch's float32 norm of a
contiguous tensor (the last-dimension path of its CPU reduction) sums the squares in ``W`` lanes (element ``i`` into
lane ``i % W``: a product, then a sum, in order), folds the lanes into lane 0 left to right, adds the tail's squares in
whole groups of ``T`` in order and the last few as fused multiply-adds, then takes the square root (of one element: its
magnitude). ``W`` and ``T`` are what torch's build compiled (its vector width; its compiler's vectorisation of the tail
loop): they are found once, by comparing with torch on probes of every tail length, and where no candidate matches
every probe the form declines (returns ``None``) and the caller's torch form runs.
"""
from __future__ import annotations

import logging
from typing import List, Optional, Tuple

import numpy as np
import torch
from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from gradcomp.backends import implements_form
from gradcomp.backends.numba.concurrency import serialized

logger = logging.getLogger(__name__)

#: ``(W, T)`` candidates for torch's reduction, the likeliest first: AVX2 and AVX-512 vector widths.
CANDIDATES = ((8, 4), (16, 4), (16, 8), (8, 1), (16, 1))


def _pointer(builder, address):
    return builder.inttoptr(address, ir.PointerType(ir.FloatType()))


@intrinsic
def f32_at(typingctx, address):
    """The float32 pointer at the integer ``address`` (a tensor's ``data_ptr()``)."""
    if not isinstance(address, types.Integer):
        return None
    return types.CPointer(types.float32)(address), lambda context, builder, signature, args: _pointer(builder, args[0])


@intrinsic
def fma32(typingctx, a, b, c):
    """``a * b + c`` rounded once (float32)."""
    if not all(value == types.float32 for value in (a, b, c)):
        return None

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32] * 3), "llvm.fma.f32")
        return builder.call(fn, args)

    return types.float32(a, b, c), codegen


def _lane_sums(width: int):
    @intrinsic
    def lane_sums(typingctx, g_address, d_address, rows, sums):
        """``sums[j] += (g / d)[rW + j]^2`` and ``sums[W + j] += g[rW + j]^2`` for ``r < rows``, ``j < W``, as
        ``W``-lane LLVM vector code (a product, then a sum: torch's vector lanes)."""
        if not (isinstance(sums, types.Array) and sums.dtype == types.float32 and sums.layout == "C"):
            return None

        def codegen(context, builder, signature, args):
            lanes = ir.VectorType(ir.FloatType(), width)
            g_at, d_at = _pointer(builder, args[0]), _pointer(builder, args[1])
            data = context.make_array(signature.args[3])(context, builder, value=args[3]).data
            at_quotients = builder.bitcast(data, lanes.as_pointer())
            at_squares = builder.bitcast(builder.gep(data, [ir.Constant(ir.IntType(64), width)]), lanes.as_pointer())
            quotients = cgutils.alloca_once_value(builder, builder.load(at_quotients, align=4))
            squares = cgutils.alloca_once_value(builder, builder.load(at_squares, align=4))
            with cgutils.for_range(builder, args[2]) as loop:
                offset = builder.mul(loop.index, ir.Constant(loop.index.type, width))
                g = builder.load(builder.bitcast(builder.gep(g_at, [offset]), lanes.as_pointer()), align=4)
                d = builder.load(builder.bitcast(builder.gep(d_at, [offset]), lanes.as_pointer()), align=4)
                q = builder.fdiv(g, d)
                builder.store(builder.fadd(builder.load(quotients), builder.fmul(q, q)), quotients)
                builder.store(builder.fadd(builder.load(squares), builder.fmul(g, g)), squares)
            builder.store(builder.load(quotients), at_quotients, align=4)
            builder.store(builder.load(squares), at_squares, align=4)
            return context.get_dummy_value()

        return types.none(g_address, d_address, rows, sums), codegen

    return lane_sums


lane_sums_8, lane_sums_16 = _lane_sums(8), _lane_sums(16)


@njit(cache=True, error_model="numpy")  # Python's model tests every divisor for zero
def quotient_norms_kernel(table, width, group, out_quotients, out_grads):
    """``out_quotients[t] = ||g_t / d_t||`` and ``out_grads[t] = ||g_t||`` in torch's order (the module docstring),
    for the float32 arrays ``g_t`` at ``table[t, 0]`` and ``d_t`` at ``table[t, 1]``, of ``table[t, 2]`` elements each
    (int64 ``[k, 3]``, :func:`_table`); ``width`` 8 or 16."""
    sums = np.zeros(2 * width, np.float32)
    for t in range(table.shape[0]):
        g_address, d_address, n = table[t, 0], table[t, 1], table[t, 2]
        g = carray(f32_at(g_address), (n,))
        d = carray(f32_at(d_address), (n,))
        if n == 1:  # torch's norm of one element is its magnitude (not the root of its square, which may underflow)
            out_quotients[t] = abs(g[0] / d[0])
            out_grads[t] = abs(g[0])
            continue
        sums[:] = 0
        rows = n // width
        if width == 8:
            lane_sums_8(g_address, d_address, rows, sums)
        else:
            lane_sums_16(g_address, d_address, rows, sums)
        total_q, total_g = sums[0], sums[width]
        for j in range(1, width):
            total_q = total_q + sums[j]
            total_g = total_g + sums[width + j]
        grouped = rows * width + (n - rows * width) // group * group
        for i in range(rows * width, grouped):  # the tail's whole groups: rounded squares, in order
            q = g[i] / d[i]
            total_q = total_q + q * q
            total_g = total_g + g[i] * g[i]
        for i in range(grouped, n):
            q = g[i] / d[i]
            total_q = fma32(q, q, total_q)
            total_g = fma32(g[i], g[i], total_g)
        out_quotients[t] = np.sqrt(total_q)
        out_grads[t] = np.sqrt(total_g)


def _run(table: np.ndarray, width: int, group: int):
    quotients, norms = torch.empty(len(table)), torch.empty(len(table))
    quotient_norms_kernel(table, width, group, quotients.numpy(), norms.numpy())
    return quotients, norms


def _table(grads: List[torch.Tensor], denoms: List[torch.Tensor]) -> Optional[np.ndarray]:
    """int64 ``[k, 3]``: each gradient's and denominator's address and their size; ``None`` where some tensor is not
    a contiguous float32 CPU tensor or a denominator's size is not its gradient's (one loop: it runs every step)."""
    if len(grads) != len(denoms):
        return None
    rows = []
    for g, d in zip(grads, denoms):
        if not (g.dtype is d.dtype is torch.float32 and g.is_cpu and d.is_cpu and g.is_contiguous()
                and d.is_contiguous() and g.numel() == d.numel()):
            return None
        rows.append((g.data_ptr(), d.data_ptr(), g.numel()))
    return np.array(rows, np.int64).reshape(-1, 3)


def _torch_form(grads, denoms):
    return (torch.stack(torch._foreach_norm(torch._foreach_div(grads, denoms))),
            torch.stack(torch._foreach_norm(grads)))


_reduction: List[Optional[Tuple[int, int]]] = []  # found once: [(W, T)] or [None]


def _find_reduction() -> Optional[Tuple[int, int]]:
    """The ``(W, T)`` of :data:`CANDIDATES` whose norms equal torch's on every probe, or ``None``."""
    generator = torch.Generator().manual_seed(0)
    sizes = list(range(1, 2 * max(w for w, _ in CANDIDATES) + 1)) + [1000, 4099]
    # magnitudes from 1e-2 to 1e2, and 1e-20 times those: squares below float32's normal range
    grads = [torch.randn(n, generator=generator) * 10.0 ** (n % 5 - 2 - 20 * (n % 3 == 1)) for n in sizes]
    denoms = [torch.rand(n, generator=generator) + 1e-3 for n in sizes]
    expected = _torch_form(grads, denoms)
    for width, group in CANDIDATES:
        got = _run(_table(grads, denoms), width, group)
        if all(torch.equal(a, b) for a, b in zip(got, expected)):
            return width, group
    logger.info("gradcomp: torch's float32 norm matched none of %s; the step's norms run in torch", CANDIDATES)
    return None


@implements_form("elementwise", "quotient_norms", "numba")
@serialized
def quotient_norms(grads: List[torch.Tensor], denoms: List[torch.Tensor]):
    """``(||g_t / d_t||, ||g_t||)`` over ``t`` as two float32 ``[k]`` tensors, bitwise ``torch.stack`` of
    ``torch._foreach_norm`` of ``torch._foreach_div(grads, denoms)`` and of ``grads``; ``None`` where some tensor is
    not a contiguous float32 CPU tensor, a denominator's size is not its gradient's, or torch's reduction is not one
    this form knows (the caller's torch form runs). Nothing is mutated."""
    table = _table(grads, denoms)
    if table is None:
        return None
    if not _reduction:
        _reduction.append(_find_reduction())
    return None if _reduction[0] is None else _run(table, *_reduction[0])
