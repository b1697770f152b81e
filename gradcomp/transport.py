"""What an integration gives the engine: how its framework launches collectives.

An adapter (``gradcomp/hooks/ddp.py``, ``gradcomp/hooks/horovod/``) subclasses :class:`Transport`
to launch its framework's collectives; it should stay a translation of the framework's objects
into engine calls. What travels from :meth:`Engine.start` to :meth:`Engine.finish` is the
engine's :class:`~gradcomp.engine.Handle`.
"""
from __future__ import annotations

import torch

from gradcomp.exchanges.registry import DEFAULT as DEFAULT_EXCHANGE

__all__ = ["Transport"]


class Transport:
    """How an integration launches collectives. Subclassed by each adapter.

    Every method but :meth:`agree` only *launches* and returns the framework's work object,
    which the adapter awaits and hands to :meth:`Engine.finish` as a tensor.
    """

    world_size: int = 1
    rank: int = 0
    #: Every group's result is this rank's chunk of the average (FSDP's reduce-scatter): the engine then
    #: runs only the scattering exchanges (:attr:`gradcomp.exchanges.Exchange.scatters`).
    scatters: bool = False

    def allreduce_average(self, tensor: torch.Tensor, name: str):
        """Start averaging ``tensor`` in place over the ranks, exactly as the framework's own
        dense path does (DDP: multiply by 1/P, then sum; Horovod: ``op=Average``)."""
        raise NotImplementedError

    def allreduce_sum(self, tensor: torch.Tensor, name: str):
        """Start summing ``tensor`` in place over the ranks (a summable payload, each rank's already
        scaled by 1/P: then every framework rounds a 16-bit sum of two ranks alike)."""
        raise NotImplementedError(f"{type(self).__name__} has no allreduce_sum")

    def allgather(self, buffer: torch.Tensor, name: str):
        """Start an allgather of the uint8 ``buffer`` (the same size on every rank); the
        result is ``[P * buffer.numel()]`` bytes, rank ``r``'s at ``r * buffer.numel()``."""
        raise NotImplementedError

    def all_to_all(self, buffer: torch.Tensor, name: str) -> torch.Tensor:
        """All-to-all of the uint8 ``buffer`` of ``P`` equal blocks, block ``j`` to rank ``j``; waits
        and returns uint8 ``[P * block]``, rank ``i``'s block for this rank at ``i * block``. Only
        exchanges that scatter chunks need it."""
        raise NotImplementedError(f"{type(self).__name__} has no all_to_all; use exchange={DEFAULT_EXCHANGE!r}")

    def reduce_scatter_average(self, tensor: torch.Tensor, name: str):
        """Start averaging ``tensor`` (``[P * c]``, chunk ``j`` for rank ``j``) over the ranks, exactly as
        the framework's own dense reduce-scatter does, keeping this rank's chunk; the result is ``[c]``.
        Only a transport that :attr:`scatters` has it."""
        raise NotImplementedError(f"{type(self).__name__} does not scatter")

    def can_allreduce(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether ``allreduce_sum`` can sum ``dtype`` tensors (else payloads are gathered)."""
        return True

    def agree(self, fingerprint: torch.Tensor) -> torch.Tensor:
        """Blocking allgather of an int64 ``[F]`` CPU tensor; returns int64 ``[P, F]``."""
        raise NotImplementedError
