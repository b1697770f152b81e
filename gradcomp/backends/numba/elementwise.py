"""Elementwise passes that torch would run as several: each reads and writes its arrays once.

``divide_multiply`` takes an averaged group back into an optimizer stage's units (``out / count * multiplier``, the
division by the ranks' count and the product by Adam's frozen denominators in one pass, bitwise torch's
``out.div_(count).mul_(multiplier)``: the same two float32 operations in the same order).
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit

from gradcomp.backends import checks, implements_form
from gradcomp.backends.numba.concurrency import serialized
from gradcomp.backends.numba.ops import as_array


@njit(cache=True, error_model="numpy")  # Python's model tests every divisor for zero: a branch LLVM cannot vectorise
def divide_multiply_kernel(out, count, multiplier):
    """``out[i] = out[i] / count * multiplier[i]`` (float32 ``out`` mutated; ``count`` float32)."""
    for i in range(np.uint64(out.size)):
        out[i] = out[i] / count * multiplier[i]


@implements_form("elementwise", "divide_multiply", "numba")
@serialized
def divide_multiply(out, count: int, multiplier) -> None:
    checks.check_vector("divide_multiply", "out", out, (torch.float32,))
    checks.check_vector("divide_multiply", "multiplier", multiplier, (torch.float32,), out.numel())
    divide_multiply_kernel(as_array(out), np.float32(count), as_array(multiplier))
