"""The framework's sparse allreduce of a sparse gradient (an embedding's, Horovod's ``sparse_allreduce``).

The engine never picks it (``runnable = False``): an adapter whose framework averages sparse
gradients itself launches that collective and records it here, so that ``stats()`` shows how the
group travelled. No compression, no residual.
"""
from __future__ import annotations

from typing import Hashable

import torch

from gradcomp.exchanges.base import Exchange
from gradcomp.exchanges.registry import exchange_name

__all__ = ["FrameworkSparse"]


@exchange_name("sparse")
class FrameworkSparse(Exchange):
    """A sparse gradient averaged by the framework itself; see the module docstring."""

    label = "sparse allreduce"
    runnable = False
    modelled = False
    averages_itself = False

    @classmethod
    def record(cls, record, group: Hashable, grad: torch.Tensor) -> None:
        """Count the sparse ``grad``'s exchange with the telemetry's ``record``: the bytes of its values
        (what a sparse allreduce hands over of this rank's), against the dense gradient's."""
        element = grad.element_size()
        record(group, grad._values().numel() * element, grad.numel() * element, 0.0, cls.name)

    def applies(self, compressor, numel, dtype, device, transport) -> bool:
        return False

    def start(self, context, handle) -> None:
        raise NotImplementedError("the framework launches its sparse allreduce itself")

    def finish(self, context, handle, result):
        raise NotImplementedError("the framework launches its sparse allreduce itself")
