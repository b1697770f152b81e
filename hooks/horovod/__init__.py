"""Horovod integration: gradcomp compressors inside Horovod, through its public interfaces.

Split as Horovod itself is (``horovod/torch/compression.py`` beside ``optimizer.py``):

* :mod:`.compression` -- :class:`Compression`, Horovod compression classes backed by any
  *summable* gradcomp compressor, for the stock ``hvd.DistributedOptimizer(compression=...)``::

      >>> opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
      ...                                compression=gradcomp.hooks.horovod.Compression.fp16)

* :mod:`.optimizer` -- :func:`DistributedOptimizer`, a drop-in for ``hvd.DistributedOptimizer``
  with the same arguments (plus the engine's, as on the DDP hook: ``warmup_steps``, ``min_numel``,
  ``error_feedback``, ``backend``, ``schedule``, ``transform``, ``exchange``, ``policy``) that also
  takes the compressors whose payloads cannot be summed (``TopK``, ``TwoBit``), through
  :class:`gradcomp.engine.Engine` as the DDP hook does: one telemetry (``opt.stats()``), one checkpoint format
  (``opt.state_dict()["gradcomp"]`` loads into the DDP hook's state and back)::

      >>> opt = gradcomp.hooks.horovod.DistributedOptimizer(
      ...     opt, named_parameters=model.named_parameters(), compression=gradcomp.TopK(0.01))
      >>> hvd.broadcast_parameters(model.state_dict(), root_rank=0)
      >>> # ... loss.backward(); opt.step(); opt.zero_grad() as usual
      >>> opt.stats()["last_step"]["compression_ratio"]   # dense bytes / bytes sent

A gradcomp compressor passed straight to Horovod's own optimizer
(``hvd.DistributedOptimizer(..., compression=gradcomp.TopK(0.01))``) raises a ``TypeError`` that
names these two calls, at its first compress call (Horovod only stores ``compression`` when its
optimizer is built): importing this package installs that one guard on ``hvd.DistributedOptimizer``
(:func:`~gradcomp.hooks.horovod.compression.refuse_gradcomp_compressors`); nothing else of Horovod
is changed.

bfloat16: Horovod 0.28.1 has no bfloat16 allreduce, so ``Compression.bf16`` says what to use
instead, and the drop-in optimizer sends such payloads by allgather (for two ranks, the same bytes).
"""
from gradcomp.hooks.horovod.compression import (
    Compression,
    GradcompCompression,
    horovod_can_allreduce,
    refuse_gradcomp_compressors,
)
from gradcomp.hooks.horovod.optimizer import DistributedOptimizer

refuse_gradcomp_compressors()

__all__ = ["Compression", "GradcompCompression", "DistributedOptimizer", "horovod_can_allreduce",
           "refuse_gradcomp_compressors"]
