"""The Adam stage's frozen-variance update of a param group in one pass, bitwise torch's multi-tensor ops.

:func:`gradcomp.optim.frozen_update.frozen_update` steps a group with torch's ``_foreach`` ops: the gradients times the
step's factor (a new tensor), the first moments' ``lerp_`` towards them (or a copy of them), the parameters times
``1 - lr * wd`` and their ``addcdiv_`` by the moments over the frozen denominators: five passes over memory.
``frozen_step`` does the same arithmetic element by element in one pass, reading each tensor once and writing the
moments and the parameters once, and gives torch's bits: ``g * f``, torch's ``lerp`` (``fma(w, g - m, m)`` for a
weight below 0.5 in magnitude, else ``fma(w - 1, g - m, g)``: a fused multiply-add, as its vector kernel computes it),
``p * (1 - lr * wd)`` and ``p + v * m / d`` in float32, the scalars rounded to float32 as torch rounds them. That
these are torch's operations here is checked once, at first use, against torch on probes of every tail length, both
lerp branches, the copy, with and without the factor and the decay; where a probe differs the form declines
(returns ``False`` with nothing written) and the caller's torch ops run.
"""
from __future__ import annotations

import logging
from typing import List, Optional

import numpy as np
import torch
from numba import carray, njit
from torch.autograd.graph import increment_version

from gradcomp.backends import implements_form
from gradcomp.backends.numba.concurrency import serialized
from gradcomp.backends.numba.norms import f32_at, fma32

logger = logging.getLogger(__name__)


@njit(cache=True, error_model="numpy")
def frozen_step_kernel(table, values, factor, scale, weight, copy, decay, decays):
    """For each row ``t`` of ``table`` (int64 ``[k, 5]``: the addresses of float32 ``p``, ``m``, ``g``, ``d`` and
    their size), element by element: ``g' = g * factor`` where ``scale``; ``m = g'`` where ``copy``, else torch's
    ``lerp(m, g', weight)``; ``p = p * decay`` where ``decays``; ``p = p + values[t] * m / d``. Mutates ``p``, ``m``."""
    small = abs(weight) < np.float32(0.5)
    coeff = weight if small else weight - np.float32(1.0)
    for t in range(table.shape[0]):
        n = table[t, 4]
        p, m = carray(f32_at(table[t, 0]), (n,)), carray(f32_at(table[t, 1]), (n,))
        g, d = carray(f32_at(table[t, 2]), (n,)), carray(f32_at(table[t, 3]), (n,))
        value = values[t]
        for i in range(n):
            target = g[i] * factor if scale else g[i]
            if copy:
                moment = target
            else:
                moment = fma32(coeff, target - m[i], m[i] if small else target)
            m[i] = moment
            param = p[i] * decay if decays else p[i]
            p[i] = param + value * moment / d[i]


def _table(params, exp_avgs, grads, denoms) -> Optional[np.ndarray]:
    """int64 ``[k, 5]`` of the four tensors' addresses and their size per parameter, or ``None`` where some tensor is
    not a contiguous float32 CPU tensor of its parameter's size or one is written through another (aliases)."""
    rows, written = [], set()
    for quad in zip(params, exp_avgs, grads, denoms):
        n = quad[0].numel()
        for tensor in quad:
            if not (tensor.dtype is torch.float32 and tensor.is_cpu and tensor.is_contiguous() and tensor.numel() == n):
                return None
        rows.append([tensor.data_ptr() for tensor in quad] + [n])
        written.update(rows[-1][:2])
    if len(written) != 2 * len(rows) or any(row[2] in written or row[3] in written for row in rows if row[4]):
        return None
    return np.array(rows, np.int64).reshape(-1, 5)


def _torch_form(params, exp_avgs, grads, denoms, factor, weight, copy, decay, values):
    if factor is not None:
        grads = torch._foreach_mul(grads, factor)
    if copy:
        torch._foreach_copy_(exp_avgs, grads)
    else:
        torch._foreach_lerp_(exp_avgs, grads, weight)
    if decay is not None:
        torch._foreach_mul_(params, decay)
    torch._foreach_addcdiv_(params, exp_avgs, denoms, values)


def _run(table, factor, weight, copy, decay, values) -> None:
    frozen_step_kernel(table, np.array(values, np.float32), np.float32(1.0 if factor is None else float(factor)),
                       factor is not None, np.float32(weight), copy, np.float32(1.0 if decay is None else decay),
                       decay is not None)


_agrees: List[bool] = []  # found once: [whether the kernel gives torch's bits on this build]


def _check() -> bool:
    """Whether :func:`frozen_step_kernel` equals torch's ops on probes (the module docstring)."""
    generator = torch.Generator().manual_seed(0)
    sizes = list(range(1, 41)) + [1000, 4099]

    def probe():
        return ([torch.randn(n, generator=generator) for n in sizes],
                [torch.randn(n, generator=generator) * 1e-3 for n in sizes],
                [torch.randn(n, generator=generator) * 1e-2 for n in sizes],
                [torch.rand(n, generator=generator) * 1e-2 + 1e-8 for n in sizes])

    for factor, weight, copy, decay in ((torch.tensor(0.8731), 0.1, False, 1 - 3e-5), (None, 0.6, False, None),
                                        (torch.tensor(1.7), 0.1, True, 1 - 1e-4), (None, 0.999, False, 0.9999)):
        values = [-3e-4 / (1 - 0.9 ** (5 + i)) for i in range(len(sizes))]
        tensors = probe()
        expected = [[t.clone() for t in group] for group in tensors[:2]]
        _torch_form(*expected, tensors[2], tensors[3], factor, weight, copy, decay, values)
        _run(_table(*tensors), factor, weight, copy, decay, values)
        if not all(torch.equal(a, b) for got, want in zip(tensors[:2], expected) for a, b in zip(got, want)):
            logger.info("gradcomp: torch's frozen Adam step differs from the one-pass form here; it runs in torch")
            return False
    return True


@implements_form("elementwise", "frozen_step", "numba")
@serialized
def frozen_step(params, exp_avgs, grads, denoms, factor: Optional[torch.Tensor], weight: float, copy: bool,
                decay: Optional[float], values: List[float]) -> bool:
    """The one-pass form of ``frozen_step`` (:data:`~gradcomp.backends.FORMS`); ``True`` when it stepped,
    ``False`` (nothing written) where it cannot promise torch's bits."""
    if factor is not None and (factor.numel() != 1 or factor.dtype is not torch.float32 or not factor.is_cpu):
        return False
    table = _table(params, exp_avgs, grads, denoms)
    if table is None or len(values) != len(table):
        return False
    if not _agrees:
        _agrees.append(_check())
    if not _agrees[0]:
        return False
    _run(table, factor, weight, copy, decay, values)
    increment_version(list(params) + list(exp_avgs))  # as torch's in-place ops would: autograd sees the writes
    return True
