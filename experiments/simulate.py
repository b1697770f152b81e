"""P data-parallel ranks simulated in one process, through gradcomp's own engine.

Every simulated rank has its own replica of the model, its own optimizer and its own
:class:`~gradcomp.engine.Engine` (residuals, stage state, schedule), built by the same set-up the
DDP hook uses. One step runs, as DDP and its comm hook do:

1. every rank's forward and backward on its own micro-batch;
2. for each DDP bucket (DDP's own size-capped assignment, in reverse parameter order): every
   rank's ``engine.start`` on the bucket's flat gradient, then the collective, computed here in
   rank order (``sum_r x_r`` for an allreduce of ``x_r = g_r / P``, the concatenation for an
   allgather), then every rank's ``engine.finish``; the bucket is written back into the
   replica's ``.grad``;
3. whatever the training loop does between ``backward()`` and ``optimizer.step()``, then each
   rank's ``optimizer.step()``.

With two ranks this is bitwise the real 2-rank DDP run over Gloo for the same seed (a sum of two
terms does not depend on the order, and every kernel is deterministic; ``tests/test_simulate.py``
checks it). It needs no process group, no sockets and no second process, so a screen of
compressors x stages x workloads runs one job per core. Exchanges that block inside ``start``
(two-phase) and the settings check between ranks (all replicas share one configuration by
construction) are not simulated.

Example::

    >>> sim = Simulation(model, lambda m: torch.optim.AdamW(m.parameters()), attach, world_size=2)
    >>> losses = sim.step([(x0, y0), (x1, y1)], loss_fn)
"""
from __future__ import annotations

import copy
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from gradcomp.transport import Transport

__all__ = ["Simulation", "SimulatedTransport", "ddp_buckets"]

#: DDP's default bucket caps: the first bucket is small so that the exchange starts early.
FIRST_BUCKET_BYTES = dist._DEFAULT_FIRST_BUCKET_BYTES
BUCKET_BYTES = 25 * 1024 * 1024


def ddp_buckets(params: Sequence[torch.nn.Parameter], first_bytes: int = FIRST_BUCKET_BYTES,
                bytes_cap: int = BUCKET_BYTES) -> List[List[int]]:
    """DDP's assignment of ``params`` (indices into it) to buckets, by its own function, in reverse
    order of the parameters (the order gradients become ready in a forward-ordered model)."""
    order = list(range(len(params)))[::-1]
    tensors = [params[i] for i in order]
    buckets, _ = dist._compute_bucket_assignment_by_size(tensors, [first_bytes, bytes_cap], [False] * len(tensors),
                                                         order)
    return [list(bucket) for bucket in buckets]


class _Collective:
    """One collective of the simulated ranks: each rank contributes, the last completes everyone."""

    def __init__(self, kind: str, world_size: int):
        self.kind, self.world_size = kind, world_size
        self.parts: List[torch.Tensor] = []
        self.futures: List[torch.futures.Future] = []

    def contribute(self, tensor: torch.Tensor) -> torch.futures.Future:
        future = torch.futures.Future()
        self.parts.append(tensor)
        self.futures.append(future)
        if len(self.parts) == self.world_size:
            self._complete()
        return future

    def _complete(self) -> None:
        if self.kind == "allreduce":
            total = self.parts[0].clone()
            for part in self.parts[1:]:
                total.add_(part)
            for part in self.parts:
                part.copy_(total)
            results = self.parts
        else:
            gathered = torch.cat([part.reshape(-1) for part in self.parts])
            results = [gathered] * self.world_size
        for future, result in zip(self.futures, results):
            future.set_result([result])


class SimulatedTransport(Transport):
    """The collectives of one simulated rank: contributions to :class:`_Collective` objects shared by
    every rank and keyed by the collective's name (the group), in the order the ranks call them."""

    def __init__(self, rank: int, world_size: int, pending: dict):
        self.rank, self.world_size, self._pending = rank, world_size, pending

    def _collective(self, kind: str, name: str) -> _Collective:
        key = (kind, name)
        collective = self._pending.get(key)
        if collective is None or len(collective.parts) == self.world_size:
            collective = self._pending[key] = _Collective(kind, self.world_size)
        return collective

    def allreduce_average(self, tensor: torch.Tensor, name: str) -> torch.futures.Future:
        tensor.mul_(1.0 / self.world_size)  # as DDP's reducer and the DDP transport: scale, then sum
        return self._collective("allreduce", name).contribute(tensor)

    def allreduce_sum(self, tensor: torch.Tensor, name: str) -> torch.futures.Future:
        return self._collective("allreduce", name).contribute(tensor)

    def allgather(self, buffer: torch.Tensor, name: str) -> torch.futures.Future:
        return self._collective("allgather", name).contribute(buffer)

    def agree(self, fingerprint: torch.Tensor) -> torch.Tensor:
        return fingerprint.reshape(1, -1).expand(self.world_size, -1)


class Simulation:
    """``world_size`` simulated data-parallel ranks of ``model`` (see the module docstring).

    Args:
        model: the model; every rank gets a deep copy (identical parameters, as after DDP's broadcast).
        make_optimizer: ``model -> optimizer`` for each rank's replica.
        attach: ``(rank, replica, optimizer, transport) -> engine``: gradcomp's set-up for one rank
            (``None`` for dense DDP: the bucket is averaged as DDP's allreduce does).
        world_size: simulated ranks ``P``.
    """

    def __init__(self, model: torch.nn.Module, make_optimizer: Callable, attach: Optional[Callable],
                 world_size: int = 2):
        self.world_size = world_size
        self.replicas = [copy.deepcopy(model) for _ in range(world_size)]
        self.optimizers = [make_optimizer(replica) for replica in self.replicas]
        self._pending: dict = {}
        self.transports = [SimulatedTransport(r, world_size, self._pending) for r in range(world_size)]
        self.engines = [attach(r, self.replicas[r], self.optimizers[r], self.transports[r]) if attach else None
                        for r in range(world_size)]
        for engine in self.engines:
            if engine is not None:
                engine.agreement_steps = ()  # one configuration for every replica, by construction
        named = [[(n, p) for n, p in replica.named_parameters() if p.requires_grad] for replica in self.replicas]
        self._named = named
        self.buckets = ddp_buckets([p for _, p in named[0]])

    def backward(self, batches: Sequence[Tuple], loss_fn: Callable, sync: bool = True,
                 scale: float = 1.0) -> List[float]:
        """Every rank's forward and backward on its batch (``loss * scale``), then, if ``sync``, the
        exchange of every bucket (the averaged gradient lands in each replica's ``.grad``); without
        ``sync`` the gradients accumulate locally, as under DDP's ``no_sync``. Returns each rank's loss."""
        losses = []
        for replica, batch in zip(self.replicas, batches):
            loss = loss_fn(replica, *batch)
            (loss * scale if scale != 1.0 else loss).backward()
            losses.append(float(loss.detach()))
        if sync:
            self.exchange()
        return losses

    def exchange(self) -> None:
        """Average every bucket across the ranks through their engines (DDP's hook path)."""
        flats, handles = [], []
        for index, bucket in enumerate(self.buckets):
            for rank in range(self.world_size):
                params = [self._named[rank][i][1] for i in bucket]
                flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                                  for p in params])
                flats.append((rank, bucket, flat))
                handles.append(self._start(rank, index, bucket, flat))
        for (rank, bucket, flat), handle in zip(flats, handles):
            engine = self.engines[rank]
            result = handle.work.value()[0] if engine is not None else handle.value()[0]
            average = engine.finish(handle, result) if engine is not None else result
            self._write_back(rank, bucket, average)
        for engine in self.engines:
            if engine is not None:
                engine.end_step()

    def _start(self, rank: int, index: int, bucket: List[int], flat: torch.Tensor):
        engine = self.engines[rank]
        if engine is None:  # dense DDP: scale by 1/P, sum
            return self.transports[rank].allreduce_average(flat, str(index))
        keys = [self._named[rank][i][0] for i in bucket]
        numels = [self._named[rank][i][1].numel() for i in bucket]
        return engine.start(flat, keys, numels, index)

    def _write_back(self, rank: int, bucket: List[int], flat: torch.Tensor) -> None:
        offset = 0
        for i in bucket:
            param = self._named[rank][i][1]
            piece = flat[offset: offset + param.numel()].view_as(param)
            offset += param.numel()
            if param.grad is None:
                param.grad = piece.clone()
            else:
                param.grad.copy_(piece)

    def step(self) -> None:
        """Every rank's ``optimizer.step()``."""
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
