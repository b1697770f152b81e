"""The dense exchange: the framework's own allreduce of the gradient itself.

A group goes dense on a dense step (the schedule's warm-up, a group under ``min_numel``, a dtype
that is not compressed) and when the compressor's payload is the gradient itself (``Identity``, a
cast to the gradient's own dtype). The engine first adds the residuals still held for the group
into the gradient ("flush"), so nothing held back is lost; the transport then averages in place
exactly as the framework's dense path does (DDP: ``* 1/P`` then sum, so ``Identity`` is bitwise
DDP; Horovod: its ``op``).
"""
from __future__ import annotations

from typing import Optional

import torch

from gradcomp import costmodel
from gradcomp.compressors.base import Compressor
from gradcomp.exchanges.base import Exchange, payload_is_gradient
from gradcomp.exchanges.registry import exchange_name

__all__ = ["Dense"]


@exchange_name("dense")
class Dense(Exchange):
    """Allreduce of the gradient in place; no payload and no residual of this step."""

    label = "dense"
    automatic = True
    sends_gradient = True
    averages_itself = False

    def applies(self, compressor: Optional[Compressor], numel: int, dtype: torch.dtype, device, transport) -> bool:
        return compressor is None or payload_is_gradient(compressor, numel, dtype)

    def compress(self, context, handle, source, residuals) -> None:
        handle.wire = handle.grad  # the engine has already flushed the residuals into it

    def start(self, context, handle) -> None:
        grad = handle.grad
        nbytes = grad.numel() * grad.element_size()
        context.record(handle.group, nbytes, nbytes, 0.0, self.name)
        handle.work = context.transport.allreduce_average(grad, str(handle.group))

    def finish(self, context, handle, result: torch.Tensor) -> torch.Tensor:
        grad = handle.grad
        if result.data_ptr() != grad.data_ptr():  # an out-of-place allreduce
            grad.copy_(result.view(-1))
        return grad

    @classmethod
    def cost(cls, compressor, numel, cluster, kernels, dtype=torch.float32):
        """A ring allreduce of the gradient (``n`` elements of ``dtype``); no compute."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        p = cluster.world_size
        wire = 2 * (p - 1) * nbytes / p
        return costmodel.Cost(cls.name, p, numel, nbytes, wire, wire, costmodel.ring_allreduce(cluster, nbytes), 0.0)
