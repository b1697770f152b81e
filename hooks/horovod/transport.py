"""How the drop-in optimizer's engine launches collectives: Horovod's async ops on a process set."""
from __future__ import annotations

from typing import Dict, Tuple

import horovod.torch as hvd
import torch
from horovod.torch import mpi_ops as _hvd_mpi_ops
from horovod.torch.mpi_ops import Average

from gradcomp.engine import Transport

__all__ = ["HorovodTransport", "horovod_can_allreduce"]

_ALLREDUCE_SUPPORT: Dict[Tuple[torch.dtype, str], bool] = {}


def horovod_can_allreduce(dtype: torch.dtype, device) -> bool:
    """Whether the installed Horovod has an allreduce for ``dtype`` tensors on ``device``.

    Read from the bindings Horovod dispatches to (``horovod_torch_allreduce_async_<type>``),
    so a later Horovod that adds bfloat16 is used as soon as it is installed.
    """
    device = torch.device(device)
    key = (dtype, device.type)
    if key not in _ALLREDUCE_SUPPORT:
        type_name = torch.empty(0, dtype=dtype, device=device).type()
        function = "horovod_torch_allreduce_async_" + type_name.replace(".", "_")
        _ALLREDUCE_SUPPORT[key] = hasattr(_hvd_mpi_ops.mpi_lib, function)
    return _ALLREDUCE_SUPPORT[key]

class HorovodTransport(Transport):
    """Collectives through Horovod's async ops on ``process_set``, reducing with ``op``."""

    def __init__(self, process_set, op, gradient_predivide_factor: float):
        self.process_set, self.op = process_set, op
        # As Horovod: split the average across pre- and post-scaling (1 / size is Horovod's).
        self._scale = {"prescale_factor": 1.0 / gradient_predivide_factor,
                       "postscale_factor": gradient_predivide_factor} if op == Average else {}

    world_size = property(lambda self: self.process_set.size())
    rank = property(lambda self: self.process_set.rank())

    def allreduce_average(self, tensor, name):
        return hvd.allreduce_async_(tensor, name=name, op=self.op, process_set=self.process_set, **self._scale)

    def allreduce_sum(self, tensor, name):
        return hvd.allreduce_async_(tensor, name=name, op=hvd.Sum, process_set=self.process_set)

    def allgather(self, buffer, name):
        # Horovod's CPU collectives reject int8; payload sizes are multiples of 8, so the
        # int64 view (same bytes) always exists.
        wire = buffer.view(torch.int64 if buffer.numel() % 8 == 0 else torch.uint8)
        return hvd.allgather_async(wire, name=f"gradcomp.{name}", process_set=self.process_set)

    def all_to_all(self, buffer, name):
        wire = buffer.view(torch.int64 if buffer.numel() % 8 == 0 else torch.uint8)  # as in allgather
        received = hvd.alltoall(wire, name=f"gradcomp.{name}", process_set=self.process_set)
        return received.view(torch.uint8)

    def can_allreduce(self, dtype, device) -> bool:
        return horovod_can_allreduce(dtype, device)

    def agree(self, fingerprint):
        return hvd.allgather(fingerprint.view(1, -1), name="gradcomp.settings", process_set=self.process_set)
