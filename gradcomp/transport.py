"""What an integration gives the engine, and what travels from :meth:`Engine.start` to :meth:`Engine.finish`.

An adapter (``gradcomp/hooks/ddp.py``, ``gradcomp/hooks/horovod/``) subclasses :class:`Transport`
to launch its framework's collectives; it should stay a translation of the framework's objects
into engine calls. :class:`Handle` is one group's exchange in flight, opaque to adapters but for
``handle.work`` (what the transport returned) and ``handle.mode``.
"""
from __future__ import annotations

from typing import Hashable, Optional, Tuple

import torch

from gradcomp.compressors.base import Compressor
from gradcomp.payload import Payload

__all__ = ["Transport", "Handle"]


class Transport:
    """How an integration launches collectives. Subclassed by each adapter.

    Every method but :meth:`agree` only *launches* and returns the framework's work object,
    which the adapter awaits and hands to :meth:`Engine.finish` as a tensor.
    """

    world_size: int = 1
    rank: int = 0

    def allreduce_average(self, tensor: torch.Tensor, name: str):
        """Start averaging ``tensor`` in place over the ranks, exactly as the framework's own
        dense path does (DDP: multiply by 1/P, then sum; Horovod: ``op=Average``)."""
        raise NotImplementedError

    def allgather(self, buffer: torch.Tensor, name: str):
        """Start an allgather of the uint8 ``buffer`` (the same size on every rank); the
        result is ``[P * buffer.numel()]`` bytes, rank ``r``'s at ``r * buffer.numel()``."""
        raise NotImplementedError

    def all_to_all(self, buffer: torch.Tensor, name: str) -> torch.Tensor:
        """All-to-all of the uint8 ``buffer`` of ``P`` equal blocks, block ``j`` to rank ``j``; waits
        and returns uint8 ``[P * block]``, rank ``i``'s block for this rank at ``i * block``. Only
        the two-phase exchange (:mod:`gradcomp.two_phase`) needs it."""
        raise NotImplementedError(f"{type(self).__name__} has no all_to_all; use exchange='allgather'")

    def can_allreduce(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether ``allreduce_average`` can sum ``dtype`` tensors (else payloads are gathered)."""
        return True

    def agree(self, fingerprint: torch.Tensor) -> torch.Tensor:
        """Blocking allgather of an int64 ``[F]`` CPU tensor; returns int64 ``[P, F]``."""
        raise NotImplementedError


class Handle:
    """One group's exchange in flight, from :meth:`Engine.start` to :meth:`Engine.finish`."""

    __slots__ = ("group", "keys", "numels", "grad", "mode", "compressor", "payload", "work", "scale")

    def __init__(self, group, keys, numels, grad, mode, compressor=None, payload=None):
        self.group: Hashable = group
        self.keys: Tuple[Hashable, ...] = keys
        self.numels: Tuple[int, ...] = numels
        self.grad: torch.Tensor = grad  # the flat gradient; receives the average
        self.mode: str = mode  # "dense" | "allreduce" | "allgather" | "two_phase"
        self.compressor: Optional[Compressor] = compressor
        self.payload: Optional[Payload] = payload
        self.work = None  # the transport's work object (a Future on DDP, a Horovod handle)
        self.scale = 1.0  # the loss scale the gradient arrived in (see Engine(grad_scaler=))
