"""The summable allreduce: payloads that an allreduce may sum (fp16, bf16 casts) are summed in place.

A summable compressor's payload is one segment, ``"data"``, and the decoded sum of payloads equals
the sum of decoded payloads (:class:`gradcomp.Compressor`, contract 6), so each rank's gradient is
scaled by 1/P, compressed, and the transport's allreduce sums the wire segment in place; every rank
decodes the same result. A transport
that cannot reduce the segment's dtype (Horovod 0.28.1 has no bfloat16 allreduce) leaves the group
to the engine's chosen exchange, which gathers the payloads instead.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from gradcomp import costmodel
from gradcomp.compressors.base import Compressor
from gradcomp.exchanges.base import Exchange, payload_is_gradient
from gradcomp.exchanges.registry import exchange_name

__all__ = ["SummedAllreduce"]


@exchange_name("allreduce")
class SummedAllreduce(Exchange):
    """Allreduce of a summable payload's ``"data"`` segment, decoded into the gradient."""

    label = "allreduce"
    automatic = True

    def applies(self, compressor: Optional[Compressor], numel: int, dtype: torch.dtype, device, transport) -> bool:
        if compressor is None or not compressor.summable or payload_is_gradient(compressor, numel, dtype):
            return False
        wire_dtype = compressor.layout(numel, dtype).segments[0].dtype
        return transport is None or transport.can_allreduce(wire_dtype, torch.device(device))

    def compress(self, context, handle, source, residuals) -> None:
        # Scaled by 1/P before the cast, then summed: a sum of two ranks' 16-bit values rounds once, alike on
        # every framework (a 16-bit payload scaled after its cast loses bits below float16's normal range,
        # where DDP and Horovod round differently), and the scale keeps the sum in range.
        scaled = source.mul(1.0 / context.transport.world_size)
        super().compress(context, handle, scaled, residuals)
        handle.wire = handle.payload["data"]  # summed in place by the allreduce

    def start(self, context, handle) -> None:
        wire, grad = handle.wire, handle.grad
        context.record(handle.group, wire.numel() * wire.element_size(), grad.numel() * grad.element_size(),
                       time.perf_counter() - handle.started, self.name, None)
        handle.work = context.transport.allreduce_sum(wire, str(handle.group))

    def finish(self, context, handle, result: torch.Tensor) -> torch.Tensor:
        payload, grad = handle.payload, handle.grad
        data = payload["data"]
        if result.data_ptr() != data.data_ptr():  # an out-of-place allreduce
            data.copy_(result.view(-1))
        handle.compressor.decompress(payload, grad, context.backend)
        return grad

    @classmethod
    def cost(cls, compressor, numel, cluster, kernels, dtype=torch.float32):
        """A ring allreduce of the ``"data"`` segment (``2n`` bytes for fp16); no compute charged."""
        if compressor is None or not compressor.summable:
            raise ValueError(f"exchange {cls.name!r} needs a summable compressor (fp16, bf16), got {compressor!r}")
        data = compressor.layout(numel, dtype).segments[0]
        nbytes = data.nbytes
        p = cluster.world_size
        wire = 2 * (p - 1) * nbytes / p
        return costmodel.Cost(cls.name, p, numel, nbytes, wire, wire, costmodel.ring_allreduce(cluster, nbytes), 0.0)
