"""How the Numba kernels meet Python threads: every op runs under one process-wide lock.

Parallel (``prange``) kernels release the GIL while they run, and DDP calls the ops from
two threads at once (compress on the autograd thread, decompress in Gloo's callback
thread). Without serialisation two launches overlap, which

* races the shared top-k :class:`~gradcomp.backends.numba.topk.Workspace`, and
* aborts the process under Numba's ``workqueue`` threading layer, which is not
  thread-safe (it detects concurrent launches and calls ``abort``).

So every registered op is wrapped by :func:`serialized`. The lock costs nothing measurable:
the two threads would compete for the same cores anyway.

A kernel also uses no more threads than torch's intra-op pool (``torch.get_num_threads()``), within
what Numba allows (``NUMBA_NUM_THREADS``, by default one per core). Numba's OpenMP team must meet at
the end of every parallel region; with several ranks on one machine, each with a team as large as the
machine (torchrun sets ``OMP_NUM_THREADS=1`` for torch, nothing for Numba), the teams' threads wait
for cores and every launch waits for the slowest of them. Measured: two processes on 2 cores, each a
loop of four 256 x 256 matmuls and 20 launches of the 3-bit compression of 30,000 floats, took 2.47-2.48 ms
a loop with one Numba thread each and 156-160 ms with Numba's default of two (65x; ``experiments.bench_threads``,
quiet, load 0.42).
A launcher that gives each rank torch's share of the cores thus gives the kernels the same share.

Everything about threads in the Numba backend lives in this module, so that a change to
how kernels are launched from threads (the threading layer, the lock) is made in one place.
"""
from __future__ import annotations

import functools
import threading
from typing import Callable

import numba
import torch

#: Held for the whole of every Numba op (see the module docstring).
KERNEL_LOCK = threading.Lock()


def serialized(op: Callable) -> Callable:
    """``op`` run under :data:`KERNEL_LOCK` on as many Numba threads as torch's intra-op pool, at most
    Numba's limit (Numba's setting is per calling thread, so it is made at every launch: about a
    microsecond); torch's own thread count is left as it was."""

    @functools.wraps(op)
    def locked(*args, **kwargs):
        with KERNEL_LOCK:
            threads = torch.get_num_threads()
            numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))
            try:
                return op(*args, **kwargs)
            finally:
                # Where torch and Numba share one OpenMP runtime (Numba imported first), a launch leaves
                # the calling thread's OpenMP thread count, which torch reads as its own, at Numba's pool size.
                if torch.get_num_threads() != threads:
                    torch.set_num_threads(threads)

    return locked
