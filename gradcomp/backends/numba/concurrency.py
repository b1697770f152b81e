"""How the Numba kernels meet Python threads: every op runs under one process-wide lock.

Parallel (``prange``) kernels release the GIL while they run, and DDP calls the ops from
two threads at once (compress on the autograd thread, decompress in Gloo's callback
thread). Without serialisation two launches overlap, which

* races the shared top-k :class:`~gradcomp.backends.numba.topk.Workspace`, and
* aborts the process under Numba's ``workqueue`` threading layer, which is not
  thread-safe (it detects concurrent launches and calls ``abort``).

So every registered op is wrapped by :func:`serialized`. The lock costs nothing measurable:
the two threads would compete for the same cores anyway.

Everything about threads in the Numba backend lives in this module, so that a change to
how kernels are launched from threads (the threading layer, the lock) is made in one place.
"""
from __future__ import annotations

import functools
import threading
from typing import Callable

#: Held for the whole of every Numba op (see the module docstring).
KERNEL_LOCK = threading.Lock()


def serialized(op: Callable) -> Callable:
    """``op`` run under :data:`KERNEL_LOCK`."""

    @functools.wraps(op)
    def locked(*args, **kwargs):
        with KERNEL_LOCK:
            return op(*args, **kwargs)

    return locked
