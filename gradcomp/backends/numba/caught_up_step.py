"""The Adam stage's caught-up frozen step of a param group's late parameters in one pass, bitwise torch's ops.

Under a sparsifier :func:`gradcomp.optim.frozen_update.caught_up_update` steps each parameter whose coordinates wait
(:mod:`gradcomp.optim.catch_up`) with torch's ops: the waits advanced, ``c`` looked up per element, ``g * c`` (times
the step's factor), the first moments' ``lerp_`` towards it, the parameters times ``1 - lr * wd`` and their
``addcdiv_`` by the moments over the frozen denominators, then the rest of the burst ``g * (1 - c)`` (times the factor)
``addcdiv_``-ed on, and each wait zeroed where the average is nonzero: about a dozen passes over memory and five new
tensors as large as the gradients. ``caught_up_step`` does the same arithmetic in one sweep with the same bits
(``fma`` for torch's ``lerp`` as in :mod:`.frozen_step`; on charlm-small's 28 tensors, 437,760 elements, 2 % of them
sent, one thread: 0.56 ms against torch's 15 ms and the plain frozen step's 0.18, informal), checked once, at first
use, against torch on probes of every tail length, waits of every kind and the factor and decay on and off; where a
probe differs the form declines (returns ``False`` with nothing written) and the caller's torch ops run.
"""
from __future__ import annotations

import logging
from typing import List, Optional

import numpy as np
import torch
from llvmlite import ir
from numba import carray, njit, types
from numba.extending import intrinsic
from torch.autograd.graph import increment_version

from gradcomp.backends import implements_form
from gradcomp.backends.numba.concurrency import serialized
from gradcomp.backends.numba.norms import f32_at, fma32

logger = logging.getLogger(__name__)


@intrinsic
def i16_at(typingctx, address):
    """The int16 pointer at the integer ``address`` (a tensor's ``data_ptr()``)."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], ir.PointerType(ir.IntType(16)))

    return types.CPointer(types.int16)(address), codegen


#: Elements per block: each block's waits advanced, then its shares looked up, then its arithmetic, in three loops
#: over a scratch block; one loop doing all three reads the table per element and stays scalar (1.3 ms on
#: charlm-small's 437,760 elements, one thread, informal), the three 0.4 ms.
BLOCK = 4096


@njit(cache=True, error_model="numpy")
def caught_up_kernel(table, values, shares, factor, scale, weight, decay, decays):
    """For each row ``t`` of ``table`` (int64 ``[k, 6]``: the addresses of float32 ``p``, ``m``, ``g``, ``d``, of the
    int16 waits ``w`` and their size), element by element: ``a = w + 1``, ``c = shares[a]``; ``x = g * c`` (times
    ``factor`` where ``scale``); ``m = lerp(m, x, weight)``; ``p = p * decay`` where ``decays``; ``p = p + v * m / d``;
    ``r = g * (1 - c)`` (times ``factor``); ``p = p + v * r / d``; ``w = a`` where ``g == 0``, else 0. Mutates ``p``,
    ``m``, ``w``. A wait at the table's end stays there (the stage clamps them far below it, ``catch_up.MAX_WAIT``):
    nothing is read past ``shares`` and no int16 overflows. Where ``g`` is zero ``shares[0]`` stands for ``c``: with
    every share in ``[0, 1]`` (the caller's check) ``g * c`` and ``g * (1 - c)`` are the same signed zeros."""
    small = abs(weight) < np.float32(0.5)
    coeff = weight if small else weight - np.float32(1.0)
    last = np.int16(shares.shape[0] - 1)
    ages, cs = np.empty(BLOCK, np.int16), np.empty(BLOCK, np.float32)
    for t in range(table.shape[0]):
        n = table[t, 5]
        p, m = carray(f32_at(table[t, 0]), (n,)), carray(f32_at(table[t, 1]), (n,))
        g, d = carray(f32_at(table[t, 2]), (n,)), carray(f32_at(table[t, 3]), (n,))
        w = carray(i16_at(table[t, 4]), (n,))
        for start in range(0, n, BLOCK):
            end = min(n, start + BLOCK)
            _advance(w[start:end], g[start:end], last, ages)
            _shares(g[start:end], ages, shares, cs)
            _caught_up(p[start:end], m[start:end], g[start:end], d[start:end], cs, values[t], factor, scale, coeff,
                       small, decay, decays)


@njit(cache=True, error_model="numpy")
def _advance(w, g, last, ages):
    """``ages = min(w + 1, last)``; ``w = ages`` where ``g == 0``, else 0 (int16; vectorizes)."""
    for i in range(w.shape[0]):
        age = w[i] + np.int16(1)
        age = age if age < last else last
        ages[i] = age
        w[i] = age if g[i] == 0 else np.int16(0)


@njit(cache=True, error_model="numpy")
def _shares(g, ages, shares, cs):
    """``cs = shares[ages]`` where ``g`` is nonzero, ``shares[0]`` elsewhere."""
    for i in range(g.shape[0]):
        cs[i] = shares[ages[i] if g[i] != 0 else 0]


@njit(cache=True, error_model="numpy")
def _caught_up(p, m, g, d, cs, value, factor, scale, coeff, small, decay, decays):
    """The arithmetic of :func:`caught_up_kernel` on one block, ``c = cs[i]`` (vectorizes)."""
    one = np.float32(1.0)
    for i in range(p.shape[0]):
        c = cs[i]
        target = g[i] * c
        if scale:
            target = target * factor
        moment = fma32(coeff, target - m[i], m[i] if small else target)
        m[i] = moment
        param = p[i] * decay if decays else p[i]
        param = param + value * moment / d[i]
        rest = g[i] * (-c + one)
        if scale:
            rest = rest * factor
        p[i] = param + value * rest / d[i]


def _table(params, exp_avgs, grads, denoms, waits) -> Optional[np.ndarray]:
    """int64 ``[k, 6]`` of the five tensors' addresses and their size per parameter, or ``None`` where some tensor is
    not a contiguous CPU tensor (float32; the waits int16) of its parameter's size or one is written through another."""
    rows, written = [], set()
    for five in zip(params, exp_avgs, grads, denoms, waits):
        n = five[0].numel()
        for tensor, dtype in zip(five, (torch.float32,) * 4 + (torch.int16,)):
            if not (tensor.dtype is dtype and tensor.is_cpu and tensor.is_contiguous() and tensor.numel() == n):
                return None
        rows.append([tensor.data_ptr() for tensor in five] + [n])
        written.update([rows[-1][0], rows[-1][1], rows[-1][4]])
    if len(written) != 3 * len(rows) or any(row[2] in written or row[3] in written for row in rows if row[5]):
        return None
    return np.array(rows, np.int64).reshape(-1, 6)


def torch_form(params, exp_avgs, grads, denoms, waits, shares, factor, weight, decay, values) -> None:
    """The same step in torch's ops (:func:`~gradcomp.optim.frozen_update.caught_up_update`'s, whose bits the form
    keeps)."""
    torch._foreach_add_(waits, 1)
    c = [shares.index_select(0, wait.view(-1).int()).view(wait.shape) for wait in waits]
    targets = torch._foreach_mul(grads, c)
    if factor is not None:
        torch._foreach_mul_(targets, factor)
    torch._foreach_lerp_(exp_avgs, targets, weight)
    if decay is not None:
        torch._foreach_mul_(params, decay)
    torch._foreach_addcdiv_(params, exp_avgs, denoms, values)
    torch._foreach_neg_(c)
    torch._foreach_add_(c, 1.0)
    rest = torch._foreach_mul(grads, c)
    if factor is not None:
        torch._foreach_mul_(rest, factor)
    torch._foreach_addcdiv_(params, rest, denoms, values)
    for wait, grad in zip(waits, grads):
        wait.mul_(grad == 0)


def _run(table, shares, factor, weight, decay, values) -> None:
    caught_up_kernel(table, np.array(values, np.float32), shares.numpy(),
                     np.float32(1.0 if factor is None else float(factor)), factor is not None, np.float32(weight),
                     np.float32(1.0 if decay is None else decay), decay is not None)


_unit: List[tuple] = []  # the last table found in [0, 1]: (its address, its version)


def _within_unit(shares: torch.Tensor) -> bool:
    """Whether every share lies in ``[0, 1]`` (the kernel's ``shares[0]`` where ``g`` is zero relies on it); a table
    found so is remembered until it changes."""
    key = (shares.data_ptr(), shares._version)
    if _unit and _unit[0] == key:
        return True
    if not bool(((shares >= 0) & (shares <= 1)).all()):
        return False
    _unit[:] = [key]
    return True


_agrees: List[bool] = []  # found once: [whether the kernel gives torch's bits on this build]


def _check(shares: torch.Tensor) -> bool:
    """Whether :func:`caught_up_kernel` equals :func:`torch_form` on probes (the module docstring)."""
    generator = torch.Generator().manual_seed(0)
    sizes = list(range(1, 41)) + [1000, 4099]
    for factor, weight, decay in ((torch.tensor(0.8731), 0.1, 1 - 3e-5), (None, 0.6, None), (torch.tensor(1.7), 0.1,
                                                                                                  None)):
        grads = [torch.randn(n, generator=generator) * (torch.rand(n, generator=generator) < 0.3) for n in sizes]
        tensors = ([torch.randn(n, generator=generator) for n in sizes],
                   [torch.randn(n, generator=generator) * 1e-3 for n in sizes], grads,
                   [torch.rand(n, generator=generator) * 1e-2 + 1e-8 for n in sizes],
                   [torch.randint(0, 60, (n,), generator=generator, dtype=torch.int16) for n in sizes])
        values = [-3e-4 / (1 - 0.9 ** (5 + i)) for i in range(len(sizes))]
        expected = [[t.clone() for t in group] for group in tensors]
        torch_form(*expected, shares, factor, weight, decay, values)
        _run(_table(*tensors), shares, factor, weight, decay, values)
        if not all(torch.equal(a, b) for got, want in zip(tensors, expected) for a, b in zip(got, want)):
            logger.info("gradcomp: torch's caught-up Adam step differs from the one-pass form here; it runs in torch")
            return False
    return True


@implements_form("elementwise", "caught_up_step", "numba")
@serialized
def caught_up_step(params, exp_avgs, grads, denoms, waits, shares: torch.Tensor, factor: Optional[torch.Tensor],
                   weight: float, decay: Optional[float], values: List[float]) -> bool:
    """The one-pass form of ``caught_up_step`` (:data:`~gradcomp.backends.FORMS`); ``True`` when it stepped,
    ``False`` (nothing written) where it cannot promise torch's bits."""
    if factor is not None and (factor.numel() != 1 or factor.dtype is not torch.float32 or not factor.is_cpu):
        return False
    if not (shares.dtype is torch.float32 and shares.is_cpu and shares.is_contiguous() and shares.dim() == 1
            and 1 < shares.numel() <= 2**15 and _within_unit(shares)):
        return False
    table = _table(params, exp_avgs, grads, denoms, waits)
    if table is None or len(values) != len(table):
        return False
    if not _agrees:
        _agrees.append(_check(shares))
    if not _agrees[0]:
        return False
    _run(table, shares, factor, weight, decay, values)
    increment_version(list(params) + list(exp_avgs) + list(waits))  # as torch's in-place ops would
    return True
