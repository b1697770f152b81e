"""What every launch plan of the ``cuda`` backend shares: the launch callable's type, the block and grid
sizes (:class:`LaunchConfig`) and how a tensor is passed (:func:`pointer`).

No CuPy here: the plans (:mod:`gradcomp.backends.cuda_ops`, :mod:`gradcomp.backends.cuda_compact`) are
plain functions of a ``launch`` callable, which CuPy provides on a GPU and ``tests/emulation`` on a CPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import numpy
import torch

__all__ = ["MAX_THREADS", "Launch", "LaunchConfig", "pointer"]

#: ``GRADCOMP_MAX_THREADS`` of ``csrc/gradcomp_common.cuh``: shared arrays are sized for it.
MAX_THREADS = 256
#: ``launch(kernel_name, grid, block, args)``; ``args`` are NumPy scalars: ``numpy.uint64``
#: for pointers, ``numpy.int64``/``numpy.int32`` for integers, ``numpy.float32`` for floats.
Launch = Callable[[str, int, int, Tuple], None]


@dataclass(frozen=True)
class LaunchConfig:
    """Block and grid sizes. Grid-stride loops make every size correct; these only tune.

    ``threads``: threads per block (at most :data:`MAX_THREADS`). ``max_blocks``: grid cap of
    the element-wise kernels and of top-k's count/write (whose per-block prefix costs
    O(grid)). ``histogram_blocks``: grid cap of top-k's histogram passes, lower because
    every block flushes a whole histogram with global atomics.
    """

    threads: int = 256
    max_blocks: int = 1024
    histogram_blocks: int = 256

    def __post_init__(self):
        if not 1 <= self.threads <= MAX_THREADS:
            raise ValueError(f"LaunchConfig.threads must be in [1, {MAX_THREADS}], got {self.threads}")
        if self.max_blocks < 1 or self.histogram_blocks < 1:
            raise ValueError("LaunchConfig.max_blocks and histogram_blocks must be >= 1")

    def blocks(self, work_items: int, cap: Optional[int] = None) -> int:
        """Blocks for ``work_items`` items of one thread each, at least 1, at most ``cap``."""
        return max(1, min(cap or self.max_blocks, -(-work_items // self.threads)))


def pointer(tensor: Optional[torch.Tensor]) -> numpy.uint64:
    """A kernel's pointer argument: ``tensor``'s ``data_ptr()`` (``None``: the null pointer)."""
    return numpy.uint64(0 if tensor is None else tensor.data_ptr())
