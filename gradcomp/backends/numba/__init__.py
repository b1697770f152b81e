"""The ``numba`` backend: CPU kernels compiled by Numba, the fast path for CPU tensors.

Contracts are in :mod:`gradcomp.backends`; these kernels are tested bit for bit against
:mod:`gradcomp.backends.torch_ops`. Every parallel kernel is ``@njit(parallel=True,
cache=True)`` and runs on as many threads as torch's intra-op pool, at most the threads Numba
allows (:mod:`~gradcomp.backends.numba.concurrency`), so a launcher that pins torch's threads
per rank pins the kernels' too.

The modules mirror ``csrc/``:

==================  ====================================================================
module              what lives there
==================  ====================================================================
``common``          bit casts, half-precision conversions, typed loads/stores, residual
                    target (``csrc/gradcomp_common.cuh``)
``twobit``          the fused 2-bit kernels (``csrc/twobit.cu``)
``topk``            the exact radix-select top-k and its workspace (``csrc/topk.cu``)
``topk_parts``      every small part's top-k of a per-parameter group in one call
``concurrency``     the lock every op runs under, and why (Python threads, threading layer)
``ops``             the registered ops: argument checks, tensors to NumPy views
``compact``         compact top-k's encode and check over a group's parts, one pass each
``part_check``      the quantizers' received-payload check over a group's parts, one loop
``elementwise``     passes torch would run as several (an average back in a stage's units)
``norms``           a step's gradient norms and their quotients' by the denominators, one pass, torch's bits
``frozen_step``     the Adam stage's frozen-variance update of a param group, one pass, torch's bits
``caught_up_step``  the same update of parameters whose coordinates wait (top-k), one pass, torch's bits
``average``         every rank's quantized payloads averaged over a group's parts, one write each
``group_parts``     a group's quantized parts as one table of work units; their compress in one call
==================  ====================================================================

Importing this package registers the ops (:mod:`gradcomp.backends` does so on first use).

Numba's on-disk cache (``cache=True``) is invalidated by a change to the file that holds
the cached function, not to the files of the functions it calls: after editing
``common.py``, delete ``__pycache__/*.nbi`` and ``*.nbc`` beside it (or touch the kernel
modules) so that ``twobit`` and ``topk`` recompile.
"""
from __future__ import annotations

import sys

if sys.byteorder != "little":  # the 2-bit kernels address the code words as bytes
    raise ImportError("the numba backend assumes a little-endian CPU")

from gradcomp.backends.numba import average, caught_up_step, compact, elementwise, frozen_step, norms, ops, part_check  # noqa: E402,F401,E501  (registers the ops)
