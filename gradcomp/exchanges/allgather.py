"""The allgather exchange: every rank's fixed-size payload of the whole group goes to every rank.

Each rank then validates all ``P`` payloads (before anything is written), decodes them and sums
in rank order ``0..P-1`` in float32, and divides by ``P`` (:func:`average_gathered`): every rank
runs the same code on the same bytes, so the average is bitwise identical on every rank. Simple and
right for few ranks; the bytes a rank receives grow with ``P`` (:mod:`gradcomp.costmodel`).

Granularity (the engine's ``granularity``): ``"parameter"`` compresses each parameter of the group
on its own (:class:`~gradcomp.compressors.per_parameter.PerParameter`: its own top-k budget and
2-bit scale, parameters under ``min_numel`` sent dense in the same payload); ``"bucket"`` the group
as one tensor. It applies to every group, so it is also where the other selectable exchanges send
the groups they do not take.
"""
from __future__ import annotations

import time
from typing import Optional, Tuple

import torch

from gradcomp import costmodel
from gradcomp.backends import resolve_backend
from gradcomp.compressors.base import Compressor
from gradcomp.compressors.per_parameter import PerParameterCache
from gradcomp.exchanges.base import Exchange, average_finite
from gradcomp.exchanges.registry import exchange_name
from gradcomp.validation import PayloadError, validate_gathered

__all__ = ["Allgather"]


@exchange_name("allgather")
class Allgather(Exchange):
    """Allgather of the group's payload; the rank-ordered float32 average of all ``P``."""

    label = "allgather"
    selectable = True
    divides = True

    def __init__(self, granularity: str = "parameter", min_numel: int = 0):
        super().__init__(granularity, min_numel)
        self._per_parameter = PerParameterCache()

    def applies(self, compressor: Optional[Compressor], numel: int, dtype: torch.dtype, device, transport) -> bool:
        return compressor is not None

    def start(self, context, handle) -> None:
        grad = handle.grad
        context.record(handle.group, handle.payload.nbytes, grad.numel() * grad.element_size(),
                       time.perf_counter() - handle.started, self.name, resolve_backend(grad.device, context.backend))
        handle.work = context.transport.allgather(handle.wire, str(handle.group))

    def finish(self, context, handle, result: torch.Tensor) -> torch.Tensor:
        """``result``: the gathered payloads, any integer view of the ``P * nbytes`` bytes."""
        grad, layout, transport = handle.grad, handle.payload.layout, context.transport
        gathered = result.reshape(-1).view(torch.uint8)
        world_size = gathered.numel() // max(layout.nbytes, 1)
        if gathered.numel() != world_size * layout.nbytes or (transport is not None
                                                              and world_size != transport.world_size):
            raise PayloadError(
                f"the allgather of group {handle.group!r} returned {gathered.numel()} bytes, expected "
                f"{transport.world_size if transport else '?'} ranks x {layout.nbytes}; ranks disagree "
                "on the model, its dtypes or the compressor settings"
            )
        try:
            checked = validate_gathered(handle.compressor, layout, gathered, grad.numel())
        except PayloadError as error:
            raise PayloadError(f"{error.reason} (group {handle.group!r})", error.rank) from error
        out = grad if grad.dtype == torch.float32 else torch.empty(grad.numel(), dtype=torch.float32,
                                                                    device=grad.device)
        handle.finite = average_finite(handle.compressor, layout, gathered, out, context.backend, checked,
                                       handle.divisor)
        if out is not grad:
            grad.copy_(out)
            handle.finite = None  # the cast to the gradient's dtype may overflow: accept reads it
        return grad

    def granular(self, compressor: Optional[Compressor], numels: Tuple[int, ...]) -> Optional[Compressor]:
        """``compressor`` for a group of parameters of ``numels``: per parameter or whole, by granularity."""
        if compressor is None or self.granularity == "bucket" or len(numels) < 2:
            return compressor
        return self._per_parameter.get(compressor, numels, self.min_numel)

    @classmethod
    def cost(cls, compressor, numel, cluster, kernels, dtype=torch.float32):
        """A ring allgather of the whole group's payload; compress ``n``, decode ``P x n``."""
        if compressor is None:
            raise ValueError(f"exchange {cls.name!r} needs a compressor")
        p = cluster.world_size
        payload = compressor.layout(numel, dtype).nbytes
        compute = kernels.compress_s * numel + kernels.decode_s * p * numel
        return costmodel.Cost(cls.name, p, numel, payload, (p - 1) * payload, (p - 1) * payload,
                              costmodel.ring_allgather(cluster, payload), compute, {"payload": payload})
