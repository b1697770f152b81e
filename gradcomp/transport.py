"""What an integration gives the engine, and what travels from :meth:`Engine.start` to :meth:`Engine.finish`.

An adapter (``gradcomp/hooks/ddp.py``, ``gradcomp/hooks/horovod/``) subclasses :class:`Transport`
to launch its framework's collectives; it should stay a translation of the framework's objects
into engine calls. :class:`Handle` is one group's exchange in flight, filled by the engine and
its exchange (:mod:`gradcomp.exchanges`), opaque to adapters but for ``handle.work`` (what the
transport returned) and ``handle.exchange`` (which exchange carries it).
"""
from __future__ import annotations

from typing import Hashable, Optional, Tuple

import torch

from gradcomp.compressors.base import Compressor
from gradcomp.exchanges.registry import DEFAULT as DEFAULT_EXCHANGE
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
        exchanges that scatter chunks need it."""
        raise NotImplementedError(f"{type(self).__name__} has no all_to_all; use exchange={DEFAULT_EXCHANGE!r}")

    def can_allreduce(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether ``allreduce_average`` can sum ``dtype`` tensors (else payloads are gathered)."""
        return True

    def agree(self, fingerprint: torch.Tensor) -> torch.Tensor:
        """Blocking allgather of an int64 ``[F]`` CPU tensor; returns int64 ``[P, F]``."""
        raise NotImplementedError


class Handle:
    """One group's exchange in flight, from :meth:`Engine.start` to :meth:`Engine.finish`."""

    __slots__ = ("group", "keys", "numels", "grad", "exchange", "compressor", "payload", "wire", "work", "scale",
                 "started", "compress_s")

    def __init__(self, group, keys, numels, grad, exchange, compressor=None):
        self.group: Hashable = group
        self.keys: Tuple[Hashable, ...] = keys
        self.numels: Tuple[int, ...] = numels
        self.grad: torch.Tensor = grad  # the flat gradient; receives the average
        self.exchange = exchange  # the gradcomp.exchanges.Exchange that carries the group
        self.compressor: Optional[Compressor] = compressor  # None or the schedule's on a dense step
        self.payload: Optional[Payload] = None  # what the exchange compressed (a transform reads it)
        self.wire: Optional[torch.Tensor] = None  # the tensor handed to the collective
        self.work = None  # the transport's work object (a Future on DDP, a Horovod handle)
        self.scale = 1.0  # the loss scale the gradient arrived in (see Engine(grad_scaler=))
        self.started = 0.0  # time.perf_counter() when the engine began the group's step
        self.compress_s: Optional[float] = None  # compression seconds, where the exchange measures them

    @property
    def mode(self) -> str:
        """The exchange's registered name, as ``stats()`` reports it."""
        return self.exchange.name
