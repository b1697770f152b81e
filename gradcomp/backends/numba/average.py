"""The average of every rank's quantized payloads over a group's parts in one pass (the ``numba`` form of the
``*_average`` ops of :data:`gradcomp.backends.PART_OPS`).

The unfused average zeroes the group, adds each rank's decode (a read and a write of the group per rank), divides
by the ranks' count and multiplies back by Adam's frozen denominators: on charlm-small's 3-bit group (437,760
elements, ten compressed parts) about 0.8-1.1 ms warm on one thread, of which the two decodes took 0.5 and the
Python around twenty kernel calls 0.15. This form sums a tile's decodes in a scratch row and writes each element
once, divided and multiplied, in one call for every part; it also reports whether what it wrote is finite, which
the engine's commit would otherwise read again.
"""
from __future__ import annotations

import functools
from typing import Tuple

import numpy as np
import torch

from gradcomp.backends import checks, implements_parts
from gradcomp.backends.numba import threebit
from gradcomp.backends.numba.concurrency import serialized
from gradcomp.backends.numba.ops import as_array
from gradcomp.backends.parts import Part, check_parts


@functools.lru_cache(maxsize=64)
def units(parts: Tuple[Part, ...], tile: int, per_unit: int) -> np.ndarray:
    """int64 ``[U, 6]``: ``(lo, numel, codes, scales, first tile, stop tile)``, each part's tiles of ``tile``
    elements cut into runs of at most ``per_unit`` (the parallel loop's work items; a plan's parts are one tuple
    for the group's life, so this is built once)."""
    rows = []
    for part in parts:
        tiles = -(-part.numel // tile)
        rows.extend((part.lo, part.numel, part.codes, part.scales, first, min(tiles, first + per_unit))
                    for first in range(0, tiles, per_unit))
    table = np.array(rows, dtype=np.int64).reshape(-1, 6)
    table.setflags(write=False)
    return table


@implements_parts("threebit_average", "numba")
@serialized
def threebit_average(words, parts, out, multiplier=None) -> bool:
    """See :mod:`gradcomp.backends.parts` (``average``); returns whether every element written is finite."""
    checks.check_vector("threebit_average", "out", out, (torch.float32,))
    checks.check_vector("threebit_average", "multiplier", multiplier, (torch.float32,), out.numel())
    if not isinstance(words, torch.Tensor) or words.dtype != torch.int32 or words.dim() != 2 or not (
            words.is_contiguous() and words.shape[0] >= 1):
        raise TypeError(f"threebit_average: words must be a contiguous int32 [P >= 1, W] tensor, got "
                        f"{getattr(words, 'dtype', type(words).__name__)} {tuple(getattr(words, 'shape', ()))}")
    check_parts("threebit_average", parts, out.numel(), words.shape[1])
    table = units(tuple(parts), threebit.TILE, threebit.PART_TILES)
    return bool(threebit.average_kernel(as_array(words).view(np.uint32), table, np.float32(words.shape[0]),
                                        as_array(multiplier), as_array(out)))
