"""An exchange written the way a new one is: one file, one decorated class, nothing else touched.

``counted_gather`` allgathers the group's whole payload and averages it in rank order (the allgather
exchange without per-parameter granularity), and counts the groups whose step it committed: a state
saved under its own checkpoint key and a setting compared between ranks. Importing this module
registers it; :mod:`tests.test_exchanges` imports it inside a fixture and forgets it afterwards.
"""
import torch

from gradcomp import costmodel
from gradcomp.exchanges import Exchange, average_gathered, exchange_name


@exchange_name("counted_gather")
class CountedGather(Exchange):
    """Allgather of the whole group's payload; counts the committed groups."""

    label = "counted gather"
    selectable = True
    state_key = "counted_gather"
    state_what = "group counts"

    def __init__(self, granularity: str = "parameter", min_numel: int = 0):
        super().__init__(granularity, min_numel)
        self.committed = 0

    def applies(self, compressor, numel, dtype, device, transport) -> bool:
        return compressor is not None

    def start(self, context, handle) -> None:
        grad = handle.grad
        context.record(handle.group, handle.payload.nbytes, grad.numel() * grad.element_size(), 0.0, self.name)
        handle.work = context.transport.allgather(handle.wire, str(handle.group))

    def finish(self, context, handle, result: torch.Tensor) -> torch.Tensor:
        out = torch.empty(handle.grad.numel(), dtype=torch.float32, device=handle.grad.device)
        average_gathered(handle.compressor, handle.payload.layout, result.reshape(-1).view(torch.uint8), out,
                         context.backend)
        return handle.grad.copy_(out)

    def commit(self, context, handle, accept) -> None:
        self.committed += int(bool(accept))

    def settings(self):
        return {"counts": "committed groups"}

    def state_dict(self) -> dict:
        return {"committed": self.committed}

    def prepare_load(self, saved, world_size: int, rank: int):
        if not isinstance(saved, dict) or not isinstance(saved.get("committed"), int):
            raise ValueError(f"'counted_gather' must be {{'committed': int}}, got {saved!r}")
        return lambda: setattr(self, "committed", saved["committed"])

    def reset(self) -> None:
        self.committed = 0

    @classmethod
    def cost(cls, compressor, numel, cluster, kernels, dtype=torch.float32):
        p, payload = cluster.world_size, compressor.layout(numel, dtype).nbytes
        return costmodel.Cost(cls.name, p, numel, payload, (p - 1) * payload, (p - 1) * payload,
                              costmodel.ring_allgather(cluster, payload), 0.0)
